"""Old path of :mod:`aitrainsai_trainer_local.local_model` (kept importable for one release)."""

import sys

import aitrainsai_trainer_local.local_model

sys.modules[__name__] = aitrainsai_trainer_local.local_model
