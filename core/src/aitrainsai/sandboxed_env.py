"""Old path of :mod:`aitrainsai.jobs.sandboxed_env` (kept importable for one release)."""

import sys

import aitrainsai.jobs.sandboxed_env

sys.modules[__name__] = aitrainsai.jobs.sandboxed_env
