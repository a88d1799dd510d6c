"""Public: the seeded generator and the tools. An agent's job may import this module.

An item is a chain of integer operations applied to a starting number, such as "Ava starts at 14, adds 9, then
multiplies by 3. What number does Ava reach?". From level 2 on, some operands (and at level 4 possibly the start) are
fruit counts stored in crates, reachable only through the ``count_fruit`` tool. Every intermediate value stays a
non-negative integer; division rounds down.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from aitrainsai import Item

FAMILY = "calc_chain"
MAX_OPERAND = 10**12  # tools refuse bigger operands

NAMES = (
    "Ava", "Ben", "Cleo", "Dario", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Luca", "Maya", "Nils",
    "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Xena", "Yusuf", "Zoe", "Aiko", "Bruno",
    "Carmen", "Dev", "Esme", "Felix", "Gemma", "Hamid", "Ivy", "Jack", "Kofi", "Lena", "Milo", "Nora", "Otto",
    "Pablo", "Rhea", "Soren", "Theo", "Uma", "Viktor", "Willa", "Yara", "Zane",
)
FRUITS = ("apples", "pears", "plums", "lemons", "figs", "limes", "peaches", "cherries", "apricots", "mangoes")
CRATES = "ABCDEFGH"


@dataclass(frozen=True)
class Level:
    steps: tuple[int, int]  # fewest and most operations after the start
    start: tuple[int, int]
    add: tuple[int, int]  # literal operands of add and subtract
    factor: tuple[int, int]  # literal operands of multiply, divide and remainder
    ops: tuple[str, ...]
    lookups: int  # operations whose operand is a crate count
    cap: int  # every intermediate value stays at or below this
    crates: int = 0
    fruits: int = 0
    counts: tuple[int, int] = (0, 0)
    lookup_start: bool = False  # the start may be a crate count too


LEVELS: dict[int, Level] = {
    1: Level(steps=(1, 2), start=(2, 40), add=(2, 20), factor=(2, 9), ops=("add", "subtract", "multiply"), lookups=0,
             cap=400),
    2: Level(steps=(3, 3), start=(10, 99), add=(5, 60), factor=(2, 9), ops=("add", "subtract", "multiply", "divide"),
             lookups=1, crates=3, fruits=3, counts=(5, 60), cap=5_000),
    3: Level(steps=(4, 5), start=(20, 400), add=(10, 300), factor=(2, 12),
             ops=("add", "subtract", "multiply", "divide", "remainder"), lookups=2, crates=4, fruits=4,
             counts=(10, 250), cap=50_000),
    4: Level(steps=(6, 7), start=(50, 900), add=(10, 900), factor=(2, 15),
             ops=("add", "subtract", "multiply", "divide", "remainder"), lookups=3, crates=6, fruits=5,
             counts=(20, 900), cap=200_000, lookup_start=True),
}

VERBS = {
    "add": "adds {}",
    "subtract": "subtracts {}",
    "multiply": "multiplies by {}",
    "divide": "divides by {} (rounding down)",
    "remainder": "takes the remainder after dividing by {}",
}


def apply(op: str, a: int, b: int) -> int:
    """The result of one operation; ``divide`` rounds down."""
    if op == "add":
        return a + b
    if op == "subtract":
        return a - b
    if op == "multiply":
        return a * b
    if op == "divide":
        return a // b
    if op == "remainder":
        return a % b
    raise ValueError(f"unknown operation {op!r}")


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    if level not in LEVELS:
        raise ValueError(f"level {level} is not one of {tuple(LEVELS)}")
    return [_item(seed, level, index) for index in range(n)]


def _item(seed: int, level: int, index: int) -> Item:
    rng = random.Random(f"{FAMILY}:{seed}:{level}:{index}")
    spec = LEVELS[level]
    while True:
        drawn = _draw(rng, spec)
        if drawn is not None:
            question, answer, crates = drawn
            return Item(family=FAMILY, level=level, seed=seed, index=index, question=question, answer=str(answer),
                        world={"crates": crates})


def _draw(rng: random.Random, spec: Level) -> tuple[str, int, dict] | None:
    """One candidate item, or None when the draw is unusable (the caller draws again)."""
    crates: dict[str, dict[str, int]] = {}
    for crate in sorted(rng.sample(CRATES, spec.crates)):
        crates[crate] = {fruit: rng.randint(*spec.counts) for fruit in sorted(rng.sample(FRUITS, spec.fruits))}
    slots = [(crate, fruit) for crate in crates for fruit in crates[crate]]
    rng.shuffle(slots)

    def lookup() -> tuple[str, int]:
        crate, fruit = slots.pop()
        return f"the number of {fruit} in crate {crate}", crates[crate][fruit]

    n_steps = rng.randint(*spec.steps)
    if spec.lookup_start and rng.random() < 0.5:
        start_text, value = lookup()
    else:
        value = rng.randint(*spec.start)
        start_text = str(value)
    lookup_steps = set(rng.sample(range(n_steps), spec.lookups))
    clauses: list[str] = []
    ops: list[str] = []
    for step in range(n_steps):
        last = step == n_steps - 1
        if step in lookup_steps:
            text, operand = lookup()
            op = "subtract" if operand < value and rng.random() < 0.5 else "add"
            if value + operand > spec.cap:
                return None
        else:
            choice = _literal_step(rng, spec, value, last, used_remainder="remainder" in ops)
            if choice is None:
                return None
            op, operand = choice
            text = str(operand)
        value = apply(op, value, operand)
        ops.append(op)
        clauses.append(VERBS[op].format(text))
    name = rng.choice(NAMES)
    if len(clauses) == 1:
        chain = f" and {clauses[0]}"
    else:
        chain = ", " + ", ".join(clauses[:-1]) + f", then {clauses[-1]}"
    question = f"{name} starts at {start_text}{chain}. What number does {name} reach?"
    literals = re.findall(r"\d+", question)
    if value <= 0 or (literals and int(literals[-1]) == value):
        return None  # keep 0 rare and never let the last number in the question be the answer
    return question, value, crates


def _literal_step(rng: random.Random, spec: Level, value: int, last: bool,
                  used_remainder: bool) -> tuple[str, int] | None:
    """An operation with a literal operand that keeps the value a positive integer within the level's cap.

    A chain takes at most one remainder, never as its last operation, so that answers stay spread out."""
    options = []
    for op in spec.ops:
        if op == "subtract" and value > spec.add[0]:
            options.append(op)
        elif op == "multiply" and value * spec.factor[1] <= spec.cap:
            options.append(op)
        elif op == "divide" and value >= 2 * spec.factor[1]:
            options.append(op)
        elif op == "remainder" and not (last or used_remainder) and value > spec.factor[1] * 3:
            options.append(op)
        elif op == "add" and value + spec.add[1] <= spec.cap:
            options.append(op)
    if not options:
        return None
    op = rng.choice(options)
    if op == "add":
        return op, rng.randint(*spec.add)
    if op == "subtract":
        return op, rng.randint(spec.add[0], min(spec.add[1], value - 1))
    if op == "remainder":
        return op, rng.randint(max(3, spec.factor[0]), spec.factor[1])
    return op, rng.randint(*spec.factor)


def _operand(value: int, name: str) -> int:
    if abs(value) > MAX_OPERAND:
        raise ValueError(f"{name} is too large (the limit is {MAX_OPERAND:,} in absolute value)")
    return value


def add(a: int, b: int) -> int:
    """Add two integers: a + b.

    Args:
        a: the first number
        b: the number to add to it
    """
    return _operand(a, "a") + _operand(b, "b")


def subtract(a: int, b: int) -> int:
    """Subtract one integer from another: a - b.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return _operand(a, "a") - _operand(b, "b")


def multiply(a: int, b: int) -> int:
    """Multiply two integers: a * b.

    Args:
        a: the first factor
        b: the second factor
    """
    return _operand(a, "a") * _operand(b, "b")


def divide(a: int, b: int) -> int:
    """Divide a by b, rounding down to a whole number (17 / 5 gives 3).

    Args:
        a: the number to divide
        b: the divisor, not zero
    """
    if b == 0:
        raise ValueError("cannot divide by zero")
    return _operand(a, "a") // _operand(b, "b")


def remainder(a: int, b: int) -> int:
    """The remainder after dividing a by b (17 and 5 give 2).

    Args:
        a: the number to divide
        b: the divisor, not zero
    """
    if b == 0:
        raise ValueError("cannot divide by zero")
    return _operand(a, "a") % _operand(b, "b")


def count_fruit(world: dict, crate: str, fruit: str) -> int:
    """Look up how many of one fruit a crate holds.

    Args:
        crate: the crate's letter, such as B
        fruit: the fruit, plural as in the question, such as apples
    """
    crates = world["crates"]
    key = crate.strip().upper().removeprefix("CRATE ").strip()
    if key not in crates:
        raise KeyError(f"no crate {crate[:40]!r}; crates: {', '.join(crates) or 'none'}")
    contents = crates[key]
    kind = fruit.strip().lower()
    if kind not in contents:
        raise KeyError(f"crate {key} holds no {fruit[:40]!r}; it holds {', '.join(contents)}")
    return contents[kind]


TOOLS = (add, subtract, multiply, divide, remainder, count_fruit)
