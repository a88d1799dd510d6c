"""Old path of :mod:`aitrainsai.cli.report` (kept importable for one release)."""

import sys

import aitrainsai.cli.report

sys.modules[__name__] = aitrainsai.cli.report
