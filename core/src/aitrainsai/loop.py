"""Old path of :mod:`aitrainsai.run.loop` (kept importable for one release)."""

import sys

import aitrainsai.run.loop

sys.modules[__name__] = aitrainsai.run.loop
