"""Public: the seeded generator and the tools. An agent's job may import this module.

An item is a string and a pipeline of transforms to apply to it in order, such as "Take the string 'tomaki' and
apply these steps in order: 1) reverse it; 2) convert it to uppercase. What is the result?". From level 3 on, the
input string is a note and some step parameters are settings, reachable only through the ``read_note`` and
``read_setting`` tools. Strings are made of letters and single spaces; every step changes the string.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, cast

from aitrainsai import Item

FAMILY = "string_pipeline"
MAX_TEXT = 500  # tools refuse longer strings and longer results

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
NOTE_LABELS = (
    "harbor", "attic", "orchard", "cellar", "garden", "tower", "bridge", "meadow", "studio", "market", "lantern",
    "compass", "quarry", "pantry", "chapel", "forge",
)
SETTING_LABELS = ("shift", "width", "offset", "span", "turns", "cut", "margin", "stride", "depth", "reach")

NUMERIC_OPS = ("keep_first", "keep_last", "drop_first", "rotate_left", "rotate_right")
OPS = ("reverse", "upper", "lower", "title", "replace", "remove_repeats") + NUMERIC_OPS
WEIGHTS = {"reverse": 3, "upper": 1, "lower": 1, "title": 1, "replace": 3, "remove_repeats": 2, "keep_first": 1,
           "keep_last": 1, "drop_first": 1, "rotate_left": 1.5, "rotate_right": 1.5}  # how often each op is tried first


@dataclass(frozen=True)
class Level:
    steps: tuple[int, int]  # fewest and most transforms
    words: tuple[int, int]  # words in the input string
    syllables: tuple[int, int]  # syllables per word
    settings: int = 0  # steps whose number is a setting, read with read_setting
    from_note: bool = False  # the input string is a note, read with read_note
    replace_width: int = 1  # the longest substring a replace step swaps
    max_shift: int = 2  # the largest literal rotation
    ops: tuple[str, ...] = OPS  # the transforms a step may be


LEVELS: dict[int, Level] = {
    # level 1: one of the transforms the untrained 135M base sometimes gets right (it scores weakly, not 0)
    1: Level(steps=(1, 1), words=(1, 1), syllables=(2, 3), ops=("upper", "title", "keep_first")),
    2: Level(steps=(2, 3), words=(1, 2), syllables=(2, 3), max_shift=3),
    3: Level(steps=(3, 4), words=(2, 3), syllables=(2, 3), settings=1, from_note=True, max_shift=4),
    4: Level(steps=(5, 6), words=(3, 4), syllables=(2, 4), settings=2, from_note=True, replace_width=2,
             max_shift=5),
}


# -- the transforms, shared by the generator and the tools ---------------------------------------------------------
def remove_repeated(text: str) -> str:
    """``text`` without the characters that already appeared earlier in it (spaces included)."""
    seen: set[str] = set()
    kept = []
    for char in text:
        if char not in seen:
            seen.add(char)
            kept.append(char)
    return "".join(kept)


def rotated(text: str, n: int) -> str:
    """``text`` rotated left by ``n`` (right when negative): the first n characters move to the end."""
    if not text:
        return text
    n %= len(text)
    return text[n:] + text[:n]


def transform(op: str, text: str, arg: int | tuple[str, str] | None = None) -> str:
    """``text`` after one transform; ``arg`` is the count of a slice or rotation, or replace's (old, new) pair."""
    if op == "reverse":
        return text[::-1]
    if op == "upper":
        return text.upper()
    if op == "lower":
        return text.lower()
    if op == "title":
        return text.title()
    if op == "replace":
        old, new = cast("tuple[str, str]", arg)
        return text.replace(old, new)
    if op == "remove_repeats":
        return remove_repeated(text)
    count = cast(int, arg)  # the numeric transforms' count
    if op == "keep_first":
        return text[:count]
    if op == "keep_last":
        return text[-count:]
    if op == "drop_first":
        return text[count:]
    if op == "rotate_left":
        return rotated(text, count)
    if op == "rotate_right":
        return rotated(text, -count)
    raise ValueError(f"unknown transform {op!r}")


def step_text(op: str, arg: int | tuple[str, str] | None, setting: str | None = None) -> str:
    """How a step reads in the question; with ``setting``, its number is that setting's value, called k."""
    if op == "replace":
        old, new = cast("tuple[str, str]", arg)
        return f"replace every '{old}' with '{new}'"
    number = "k" if setting else str(arg)
    where = f", where k is the setting '{setting}'" if setting else ""
    characters = "character" if number == "1" else "characters"
    texts = {
        "reverse": "reverse it",
        "upper": "convert it to uppercase",
        "lower": "convert it to lowercase",
        "title": "convert it to title case",
        "remove_repeats": "remove repeated characters, keeping the first of each",
        "keep_first": f"keep the first {number} {characters}{where}",
        "keep_last": f"keep the last {number} {characters}{where}",
        "drop_first": f"drop the first {number} {characters}{where}",
        "rotate_left": f"rotate it left by {number}{where}",
        "rotate_right": f"rotate it right by {number}{where}",
    }
    return texts[op]


# -- the generator -------------------------------------------------------------------------------------------------
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
            question, answer, world = drawn
            return Item(family=FAMILY, level=level, seed=seed, index=index, question=question, answer=answer,
                        world=world)


def _word(rng: random.Random, syllables: tuple[int, int]) -> str:
    word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(*syllables)))
    return word + rng.choice(CONSONANTS) if rng.random() < 0.3 else word


def _draw(rng: random.Random, spec: Level) -> tuple[str, str, dict] | None:
    """One candidate item, or None when the draw is unusable (the caller draws again)."""
    source = " ".join(_word(rng, spec.syllables) for _ in range(rng.randint(*spec.words)))
    n_steps = rng.randint(*spec.steps)
    setting_steps = set(rng.sample(range(n_steps), spec.settings))
    setting_labels = rng.sample(SETTING_LABELS, spec.settings + 2 if spec.settings else 0)
    settings: dict[str, int] = {}
    chain = [source]
    texts = []
    for step in range(n_steps):
        drawn = _step(rng, spec, chain, from_setting=step in setting_steps)
        if drawn is None:
            return None
        op, arg, result = drawn
        setting = None
        if step in setting_steps:
            setting = setting_labels[len(settings)]
            settings[setting] = cast(int, arg)  # a setting step is a numeric transform
        texts.append(step_text(op, arg, setting))
        chain.append(result)
    for label in setting_labels[len(settings):]:
        settings[label] = rng.randint(1, 6)  # settings no step reads
    notes: dict[str, str] = {}
    if spec.from_note:
        labels = rng.sample(NOTE_LABELS, 3)
        notes = {label: " ".join(_word(rng, spec.syllables) for _ in range(rng.randint(*spec.words)))
                 for label in labels[1:]}
        notes[labels[0]] = source
        subject = f"the note labelled '{labels[0]}'"
    else:
        subject = f"the string '{source}'"
    if n_steps == 1:
        question = f"Take {subject} and {texts[0]}. What is the result?"
    else:
        numbered = "; ".join(f"{n}) {text}" for n, text in enumerate(texts, 1))
        question = f"Take {subject} and apply these steps in order: {numbered}. What is the result?"
    world = {"notes": dict(sorted(notes.items())), "settings": dict(sorted(settings.items()))}
    return question, chain[-1], world


def _step(rng: random.Random, spec: Level, chain: list[str],
          from_setting: bool) -> tuple[str, int | tuple[str, str] | None, str] | None:
    """A transform of ``chain[-1]`` that gives a new, clean string (no edge or double spaces, 2+ characters)."""
    text = chain[-1]
    candidates = [op for op in (NUMERIC_OPS if from_setting else OPS) if op in spec.ops]
    ops = sorted(candidates, key=lambda op: -rng.random() ** (1 / WEIGHTS[op]))  # a weighted shuffle
    for op in ops:
        arg: int | tuple[str, str] | None
        if op in NUMERIC_OPS:
            arg = _count(rng, spec, op, text, from_setting)
        elif op == "replace":
            arg = _replacement(rng, spec, text)
        else:
            arg = None
        if arg is None and (op in NUMERIC_OPS or op == "replace"):
            continue
        result = transform(op, text, arg)
        clean = len(result) >= 2 and result == result.strip() and "  " not in result
        if clean and result not in chain:
            return op, arg, result
    return None


def _count(rng: random.Random, spec: Level, op: str, text: str, from_setting: bool) -> int | None:
    """How many characters a slice or rotation of ``text`` takes, or None when it can't apply.

    A slice keeps at least half the string, so that long pipelines don't shrink it to a few letters."""
    if len(text) <= 2:
        return None
    if op in ("keep_first", "keep_last"):
        return rng.randint(max(2, (len(text) + 1) // 2), len(text) - 1)
    if op == "drop_first":
        return rng.randint(1, len(text) // 2)
    top = min(len(text) - 1, 6 if from_setting else spec.max_shift)
    return rng.randint(1, top) if top >= 1 else None


def _replacement(rng: random.Random, spec: Level, text: str) -> tuple[str, str] | None:
    """An (old, new) pair for a replace step on ``text``: old is in ``text``; None when the draw changes nothing."""
    letters = [i for i, char in enumerate(text) if char != " "]
    start = rng.choice(letters)
    old = text[start:start + rng.randint(1, spec.replace_width)]
    if " " in old:
        old = old[0]
    new = "".join(rng.choice(CONSONANTS + VOWELS) for _ in old)
    new = new.upper() if old.isupper() else new
    return (old, new) if new != old else None


# -- the tools -----------------------------------------------------------------------------------------------------
def _checked(text: str, name: str = "text") -> str:
    if len(text) > MAX_TEXT:
        raise ValueError(f"{name} is {len(text)} characters long; the limit is {MAX_TEXT}")
    return text


def reverse(text: str) -> str:
    """Reverse a string: 'abc' becomes 'cba'.

    Args:
        text: the string to reverse
    """
    return _checked(text)[::-1]


def change_case(text: str, case: Literal["upper", "lower", "title"]) -> str:
    """Convert a string to uppercase, lowercase or title case (each word capitalised).

    Args:
        text: the string to convert
        case: upper, lower or title
    """
    return transform(case, _checked(text))


def replace(text: str, old: str, new: str) -> str:
    """Replace every occurrence of old in a string with new (case-sensitive).

    Args:
        text: the string to change
        old: the substring to find, not empty
        new: what to put in its place (may be empty)
    """
    _checked(text)
    if not old:
        raise ValueError("old must not be empty")
    result = text.replace(_checked(old, "old"), _checked(new, "new"))
    return _checked(result, "the result")


def slice_text(text: str, start: int, end: int | None = None) -> str:
    """Cut out part of a string, as Python's text[start:end] does: positions count from 0, end is excluded,
    negative positions count from the end. Keep the first 3 characters: start=0, end=3. Keep the last 3: start=-3.
    Drop the first 2: start=2.

    Args:
        text: the string to cut
        start: the first position to keep
        end: the position to stop before; leave it out to keep the rest of the string
    """
    return _checked(text)[start:end]


def remove_repeats(text: str) -> str:
    """Remove every character that already appeared earlier in a string, keeping the first of each (spaces count):
    'banana' becomes 'ban'.

    Args:
        text: the string to clean
    """
    return remove_repeated(_checked(text))


def rotate(text: str, direction: Literal["left", "right"], n: int) -> str:
    """Rotate a string: left by n moves the first n characters to the end ('abcde' left by 2 is 'cdeab'); right by
    n moves the last n characters to the front ('abcde' right by 2 is 'deabc').

    Args:
        text: the string to rotate
        direction: left or right
        n: how many characters to move
    """
    return rotated(_checked(text), n if direction == "left" else -n)


def read_note(world: dict, label: str) -> str:
    """Read the string stored in a note.

    Args:
        label: the note's label, such as harbor
    """
    notes = world["notes"]
    key = label.strip().strip("'\"").lower()
    if key not in notes:
        raise KeyError(f"no note {label[:40]!r}; notes: {', '.join(notes) or 'none'}")
    return notes[key]


def read_setting(world: dict, label: str) -> int:
    """Read the number stored in a setting.

    Args:
        label: the setting's name, such as width
    """
    settings = world["settings"]
    key = label.strip().strip("'\"").lower()
    if key not in settings:
        raise KeyError(f"no setting {label[:40]!r}; settings: {', '.join(settings) or 'none'}")
    return settings[key]


TOOLS = (reverse, change_case, replace, slice_text, remove_repeats, rotate, read_note, read_setting)
