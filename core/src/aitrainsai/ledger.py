"""Old path of :mod:`aitrainsai.run.ledger` (kept importable for one release)."""

import sys

import aitrainsai.run.ledger

sys.modules[__name__] = aitrainsai.run.ledger
