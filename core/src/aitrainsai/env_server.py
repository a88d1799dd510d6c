"""Old path of :mod:`aitrainsai.jobs.env_server` (kept importable for one release)."""

import sys

import aitrainsai.jobs.env_server

sys.modules[__name__] = aitrainsai.jobs.env_server
