"""Old path of :mod:`aitrainsai.jobs.verifiers_env` (kept importable for one release)."""

import sys

import aitrainsai.jobs.verifiers_env

sys.modules[__name__] = aitrainsai.jobs.verifiers_env
