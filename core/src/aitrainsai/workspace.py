"""Old path of :mod:`aitrainsai.jobs.workspace` (kept importable for one release)."""

import sys

import aitrainsai.jobs.workspace

sys.modules[__name__] = aitrainsai.jobs.workspace
