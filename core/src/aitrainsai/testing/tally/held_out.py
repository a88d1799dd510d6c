"""The public module of tally's held-out twin (the same items under another name): its generator and tools."""

from aitrainsai.families import Item
from aitrainsai.testing.tally.world import TOOLS, items

__all__ = ["FAMILY", "TOOLS", "generate"]

FAMILY = "tally_held_out"


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    return items(FAMILY, seed, level, n)
