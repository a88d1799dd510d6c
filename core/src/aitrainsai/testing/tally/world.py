"""Public: the tally family's seeded generator and its tool; a job's code may import this module.

An item asks for the total of a few labelled bins, such as "Tally bins amber-417 and cobalt-92: what do they hold
together?"; the world holds the count of every bin, which only the ``count`` tool reads. At level n the question sums
n + 1 bins out of n + 3. Small and fast on purpose: the fake family of :mod:`aitrainsai.testing`.
"""

from __future__ import annotations

import random

from aitrainsai.families import Item

FAMILY = "tally"
LEVELS = (1, 2, 3)
COLOURS = ("amber", "azure", "cobalt", "coral", "ivory", "jade", "lilac", "ochre", "olive", "ruby", "sable", "teal")


def count(world: dict, label: str) -> int:
    """Look up how many things one bin holds.

    Args:
        label: the bin's label, such as amber-417
    """
    bins = world["bins"]
    key = label.strip().lower()
    if key not in bins:
        raise KeyError(f"no bin {label[:40]!r}; bins: {', '.join(bins)}")
    return bins[key]


TOOLS = (count,)


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    return items(FAMILY, seed, level, n)


def items(family: str, seed: int, level: int, n: int) -> list[Item]:
    """``n`` items of ``family`` (a tally family's name) at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level {level} is not one of {LEVELS}")
    return [_item(family, seed, level, index) for index in range(n)]


def _item(family: str, seed: int, level: int, index: int) -> Item:
    rng = random.Random(f"{family}:{seed}:{level}:{index}")
    labels = [f"{colour}-{rng.randint(10, 999)}" for colour in rng.sample(COLOURS, level + 3)]
    bins = {label: rng.randint(1, 999) for label in labels}
    asked = rng.sample(labels, level + 1)
    question = f"Tally bins {', '.join(asked[:-1])} and {asked[-1]}: what do they hold together?"
    return Item(family=family, level=level, seed=seed, index=index, question=question,
                answer=str(sum(bins[label] for label in asked)), world={"bins": bins})
