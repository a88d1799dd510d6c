"""Old path of :mod:`aitrainsai.jobs.remote_env` (kept importable for one release)."""

import sys

import aitrainsai.jobs.remote_env

sys.modules[__name__] = aitrainsai.jobs.remote_env
