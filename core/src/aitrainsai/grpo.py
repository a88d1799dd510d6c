"""Old path of :mod:`aitrainsai.is_grpo` (kept importable for one release)."""

import sys

import aitrainsai.is_grpo

sys.modules[__name__] = aitrainsai.is_grpo
