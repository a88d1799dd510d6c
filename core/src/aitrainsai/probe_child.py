"""Old path of :mod:`aitrainsai.jobs.probe_child` (kept importable for one release)."""

import sys

import aitrainsai.jobs.probe_child

sys.modules[__name__] = aitrainsai.jobs.probe_child
