"""Old path of :mod:`aitrainsai.run.episode` (kept importable for one release)."""

import sys

import aitrainsai.run.episode

sys.modules[__name__] = aitrainsai.run.episode
