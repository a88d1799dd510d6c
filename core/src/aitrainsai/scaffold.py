"""Old path of :mod:`aitrainsai.cli.scaffold` (kept importable for one release)."""

import sys

import aitrainsai.cli.scaffold

sys.modules[__name__] = aitrainsai.cli.scaffold
