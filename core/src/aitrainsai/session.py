"""Old path of :mod:`aitrainsai.run.session` (kept importable for one release)."""

import sys

import aitrainsai.run.session

sys.modules[__name__] = aitrainsai.run.session
