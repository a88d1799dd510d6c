"""Old path of :mod:`aitrainsai.cli.progress` (kept importable for one release)."""

import sys

import aitrainsai.cli.progress

sys.modules[__name__] = aitrainsai.cli.progress
