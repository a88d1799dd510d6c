"""The hidden-eval overlap check: disguised hidden items are found, honest generated data is not, big rows are cheap."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest

from aitrainsai.families import Item, TaskFamily, _Probe, _skeleton
from aitrainsai.plugins import Plugins

pytestmark = pytest.mark.hostile

FAMILIES = ("calc_chain", "dispatch", "ledger", "multi_hop", "string_pipeline", "triage")
HOMOGLYPHS = dict(zip("aceijopsxy", "асеіјорѕху"))  # Latin letter -> Cyrillic look-alike
FULL_WIDTH = {c: chr(ord(c) + 0xFEE0) for c in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"}
PUNCTUATION = str.maketrans({"?": "!", ".": " .", ",": ";", ":": " -", "'": '"', "(": "[", ")": "]", "-": " - "})


@pytest.fixture(scope="module")
def families() -> dict[str, TaskFamily]:
    registry = Plugins.load().task_families
    return {name: registry.get(name)() for name in FAMILIES if name in registry}


def family(families: dict[str, TaskFamily], name: str) -> TaskFamily:
    if name not in families:
        pytest.skip(f"needs the {name} family")
    return families[name]


# -- disguises: each changes how a question looks, not what it asks ---------------------------------------------------
def zero_width(q: str, rng: random.Random) -> str:
    at = rng.randrange(1, len(q))
    return q[:at] + "\u200b" + q[at:]


def no_final_mark(q: str, rng: random.Random) -> str:
    at = q.rfind("?")
    return q[:at] + q[at + 1:] if at >= 0 else q.rstrip(".!")


def homoglyph(q: str, rng: random.Random) -> str:
    at = rng.choice([i for i, c in enumerate(q) if c in HOMOGLYPHS])
    return q[:at] + HOMOGLYPHS[q[at]] + q[at + 1:]


def full_width(q: str, rng: random.Random) -> str:
    """Full-width digits, and one full-width word, so that a question without digits changes too."""
    words = q.split(" ")
    at = rng.randrange(len(words))
    words[at] = "".join(FULL_WIDTH.get(c, c) for c in words[at])
    return re.sub(r"[0-9]", lambda m: FULL_WIDTH[m.group()], " ".join(words))


def shouting(q: str, rng: random.Random) -> str:
    return q.upper().translate(PUNCTUATION).replace(" ", "  ")


def embedded(q: str, rng: random.Random) -> str:
    return f"Q: {q.rstrip('?.')}, please answer with care."


def combined(q: str, rng: random.Random) -> str:
    return embedded(full_width(homoglyph(zero_width(no_final_mark(q, rng), rng), rng), rng), rng).upper()


DISGUISES: dict[str, Callable[[str, random.Random], str]] = {
    "zero-width space": zero_width, "no final mark": no_final_mark, "homoglyph": homoglyph,
    "full-width": full_width, "case, spaces and punctuation": shouting, "embedded": embedded, "combined": combined}


def levels(fam: TaskFamily) -> list[int]:
    return [fam.default_level, fam.levels[-1]]


@pytest.mark.parametrize("disguise", DISGUISES)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_disguised_hidden_set_is_found(families, name, disguise):
    fam = family(families, name)
    rng = random.Random(f"{name}/{disguise}")
    for level in levels(fam):
        hidden = fam.hidden_eval(level=level)
        questions = [DISGUISES[disguise](item.question, rng) for item in hidden]
        assert questions != [item.question for item in hidden]
        as_text = fam.overlap(questions)
        as_rows = fam.overlap([{"question": q, "answer": item.answer, "world": item.world}
                               for q, item in zip(questions, hidden)])
        as_chat = fam.overlap([{"prompt": [{"role": "system", "content": fam.system_prompt},
                                           {"role": "user", "content": q}], "answer": item.answer}
                               for q, item in zip(questions, hidden)])
        for found in (as_text, as_rows, as_chat):
            assert len(found) >= 0.98 * len(hidden), f"level {level}: {len(found)} of {len(hidden)} found"


@pytest.mark.parametrize("name", FAMILIES)
def test_honest_generated_data_is_rarely_flagged(families, name):
    """The job template's rows from another seed: a flag is a chance near-collision, dropped by the probe."""
    fam = family(families, name)
    for level in fam.levels:
        items = fam.generate(20240 + level, level, 500)
        rows = [{"question": i.question, "answer": i.answer, "world": i.world} for i in items]
        assert len(fam.overlap(rows)) <= 0.01 * len(rows), f"level {level}"


def test_the_answer_lets_a_reworded_question_match(families):
    fam = family(families, "ledger")
    item = fam.hidden_eval()[0]
    reworded = item.question.replace("starts with", "begins with").replace("What is", "Tell me")
    assert fam.overlap([reworded]) == []
    assert fam.overlap([{"question": reworded, "answer": item.answer}]) == [0]
    assert fam.overlap([{"question": reworded, "answer": str(int(item.answer) + 1)}]) == []


def test_a_hidden_item_is_found_in_any_row_shape(families):
    fam = family(families, "calc_chain")
    item = fam.hidden_eval()[3]
    half = item.question.index(" ", len(item.question) // 2)
    rows = [item, item.question, {"data": [{"text": item.question}]}, {item.question: 1},
            {"question": [item.question[:half], item.question[half:]]}, ("x", [item.question])]
    assert fam.overlap(rows) == list(range(len(rows)))
    assert fam.overlap([{"question": "What is 2 + 2?", "answer": "4"}, 17, None]) == []


def test_a_changed_number_is_another_question(families):
    fam = family(families, "calc_chain")
    item = fam.hidden_eval()[0]
    number = re.search(r"\d+", item.question).group()
    assert fam.overlap([item.question.replace(number, str(int(number) + 100), 1)]) == []


def test_skeleton_folds_what_reads_alike():
    assert _skeleton("Аvа\u200b starts at １６, adds 1,000!") == ["ava", "starts", "at", "16", "adds", "1000"]
    assert _skeleton("CAFÉ déjà-vu ﬁne 𝐁𝐨𝐥𝐝 ⓐ") == ["cafe", "deja", "vu", "fine", "bold", "a"]
    assert _skeleton("T-0042 at 06:05, T0042 ٣") == ["t", "42", "at", "6", "5", "t", "42", "3"]
    assert _skeleton("so\u00adft w\u2060ord\ufeff x\u0000y ΡΟ") == ["soft", "word", "xy", "po"]


def test_big_rows_cost_one_comparison_per_item_at_most(families, monkeypatch):
    """64 KB rows of hidden-set words, or of gutted hidden questions: each row is compared with each item at most
    once, and most items never (they are ruled out by their rare words first)."""
    fam = family(families, "triage")
    hidden = [item.question for item in fam._hidden_items]
    words = sorted({word for question in hidden for word in question.split()})
    rng = random.Random(0)

    def fill(piece: Callable[[], str]) -> str:
        parts: list[str] = []
        while sum(map(len, parts)) < 64_000:
            parts.append(piece())
        return " ".join(parts)[:64_000]

    def gutted() -> str:
        return " ".join(w for n, w in enumerate(rng.choice(hidden).split()) if n % 3 != 1)

    rows = [fill(lambda: rng.choice(words)) for _ in range(3)] + [fill(gutted) for _ in range(3)]
    rows.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(20_000)))
    calls = []
    similarity = _Probe.similarity
    monkeypatch.setattr(_Probe, "similarity", lambda self, runs: calls.append(id(self)) or similarity(self, runs))
    assert fam.overlap(rows) == []
    assert len(calls) <= len(rows) * len(fam._overlap_index.probes)
    assert len(calls) < 0.5 * len(rows) * len(fam._overlap_index.probes)
    assert fam.overlap([fill(lambda: rng.choice(hidden))]) == [0]


def test_honest_rows_are_compared_with_few_items(families, monkeypatch):
    """No rows x items scan: an honest row is compared in full with a handful of the hidden items."""
    fam = family(families, "multi_hop")
    calls = []
    similarity = _Probe.similarity
    monkeypatch.setattr(_Probe, "similarity", lambda self, runs: calls.append(1) or similarity(self, runs))
    rows = [{"question": i.question, "answer": i.answer, "world": i.world} for i in fam.generate(99, 4, 200)]
    fam.overlap(rows)
    assert len(calls) < 0.01 * len(rows) * len(fam._overlap_index.probes)


def test_items_are_rows_too(families):
    fam = family(families, "string_pipeline")
    hidden = fam.hidden_eval(level=2)[:5]
    assert fam.overlap([Item(**{**item.model_dump(), "seed": 1}) for item in hidden]) == [0, 1, 2, 3, 4]
