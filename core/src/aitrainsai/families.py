"""Task families: what the outer agent is asked to teach a small model.

A family subclasses :class:`TaskFamily`. Its public part — the seeded generator and the tool functions — is what an
agent's job may import (listed in ``public_modules``). Its private part — the hidden eval set, the overlap check, the
scorer and the reference solver — lives on the family class, which agent code may never import.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import unicodedata
from abc import ABC, abstractmethod
from collections import Counter
from functools import cached_property
from itertools import chain
from typing import Any, ClassVar, Literal
from collections.abc import Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.chat import Message
from aitrainsai.components import Component
from aitrainsai.jobs.format import JobFormat
from aitrainsai.tools import bind, call_tool, tool_schema


class Item(BaseModel):
    """One generated problem: the question, the exact answer, and the world its tools read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    level: int
    seed: int
    index: int
    question: str
    answer: str
    world: dict[str, Any] = Field(default_factory=dict)

    @property
    def id(self) -> str:
        """A content hash: equal items have equal ids, whatever seed produced them."""
        return hashlib.sha256(self.to_json(keys=("family", "question", "answer")).encode()).hexdigest()[:16]

    def to_json(self, keys: Sequence[str] | None = None) -> str:
        data = self.model_dump()
        if keys is not None:
            data = {k: data[k] for k in keys}
        return json.dumps(data, sort_keys=True, separators=(",", ":"))


class Constraints(BaseModel):
    """Hard limits a job must respect; the probe refuses a job that breaks one."""

    model_config = ConfigDict(extra="forbid")

    allowed_bases: list[str] = Field(default_factory=list)
    max_train_steps: int = 200
    max_dataset_size: int = 5_000
    max_wall_seconds: int = 1_800
    max_train_tokens: int | None = Field(None, description=(
        "the most tokens a job may sample in training (steps x rows per step x group x turns x new tokens per "
        "turn), where the inner trainer counts its work so: a budget in work, the same on a fast or a slow machine"))


class EvalInterface(BaseModel):
    """How the hidden eval talks to the trained model; a job's environment must present the same interface."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str
    tools: list[dict]
    answer_format: str
    turn_limit: int


class DevExample(BaseModel):
    """A worked example the agent is shown: an item and the transcript of a model that solved it with the tools."""

    model_config = ConfigDict(extra="forbid")

    item: Item
    transcript: list[Message]


class TaskSpec(BaseModel):
    """Everything the agent is shown about a family at one level."""

    model_config = ConfigDict(extra="forbid")

    family: str
    level: int
    held_out: bool
    goal: str
    constraints: Constraints
    eval_interface: EvalInterface
    public_modules: list[str]
    dev_examples: list[DevExample]
    job_format: JobFormat = "verifiers"  # what the agent writes (aitrainsai.jobs.format); the run chooses it

    def render(self) -> str:
        """The spec as markdown, the way the agent reads it."""
        lines = [
            f"# Task family: {self.family} (level {self.level})",
            "",
            "## What to teach",
            self.goal,
            "",
            "## Hard constraints",
            f"- base model: one of {', '.join(self.constraints.allowed_bases) or '(set by the inner trainer)'}",
            f"- training steps: at most {self.constraints.max_train_steps}",
            f"- dataset: at most {self.constraints.max_dataset_size} items, none from the hidden eval",
            f"- wall time: at most {self.constraints.max_wall_seconds} s",
            *([f"- sampled tokens in training: at most {self.constraints.max_train_tokens} (steps x "
               "prompts_per_step x group_size x max_turns x max_new_tokens)"]
              if self.constraints.max_train_tokens is not None else []),
            "",
            "## Eval interface (the hidden eval uses exactly this)",
            "System prompt:",
            "```",
            self.eval_interface.system_prompt,
            "```",
            f"Answer format: {self.eval_interface.answer_format}",
            f"Turn limit: {self.eval_interface.turn_limit}",
            "Tools (OpenAI function schemas):",
            "```json",
            json.dumps(self.eval_interface.tools, indent=1),
            "```",
            f"Modules your job may import (generator and tools): {', '.join(self.public_modules)}",
            "",
            "## Dev examples",
        ]
        for n, example in enumerate(self.dev_examples, 1):
            lines += [f"### Example {n}", f"Question: {example.item.question}", f"Answer: {example.item.answer}",
                      "Reference transcript:", "```json", json.dumps(example.transcript, indent=1), "```"]
        return "\n".join(lines) + "\n"

    def render_compact(self) -> str:
        """The spec in brief, for an agent with a small context: the goal, the hard constraints, the eval interface
        without its system prompt and tool schemas (the job's environment.py holds them), one dev example without
        its transcript."""
        c, interface = self.constraints, self.eval_interface
        tools = ", ".join(schema.get("function", {}).get("name", "?") for schema in interface.tools) or "none"
        lines = [
            f"# Task: {self.family} (level {self.level})",
            f"Goal: {self.goal}",
            f"Hard constraints: base model {' or '.join(c.allowed_bases) or '(set by the inner trainer)'}; "
            f"at most {c.max_train_steps} training steps; at most {c.max_dataset_size} dataset items, none from "
            f"the hidden eval; at most {c.max_wall_seconds} s wall time.",
            f"Hidden eval: {interface.answer_format} Turn limit {interface.turn_limit}. Tools: {tools}. "
            f"Your job may import {', '.join(self.public_modules)}.",
        ]
        if self.dev_examples:
            item = self.dev_examples[0].item
            lines.append(f"Example: {item.question} -> {item.answer}")
        return "\n".join(lines) + "\n"


ANSWER_LINE = re.compile(r"answer\s*[:=]\s*(.+)", re.I)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

MAX_REPLY_CHARS = 100_000
"""The most of a reply that :func:`extract_answer` reads: a longer reply is read from its last ``MAX_REPLY_CHARS``
characters, where its final answer is, so that scoring takes bounded time whatever a model or a worker sends."""

_OPEN, _CLOSE = "<answer>", "</answer>"
_TAG_CASE = str.maketrans("ANSWER\u017f", "answers")  # every letter re.IGNORECASE matches in the tags (\u017f: long s)


def extract_answer(text: str | None, fallback: Literal["last_line", "last_number"] = "last_line") -> str:
    """The final answer in a reply: the last ``<answer>...</answer>``, else what follows the last ``Answer:``,
    else (``fallback``) the last non-empty line or the last number in the reply. Linear in the reply, of which it
    reads at most the last ``MAX_REPLY_CHARS`` characters."""
    if not text:
        return ""
    text = text[-MAX_REPLY_CHARS:]
    tagged = _last_tagged(text)
    if tagged is not None:
        return tagged.strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        match = ANSWER_LINE.search(line)
        if match:
            found = match.group(1).strip()
            numbers = NUMBER.findall(found) if fallback == "last_number" else []
            return numbers[-1] if numbers else found
    if fallback == "last_number":
        numbers = NUMBER.findall(text)
        return numbers[-1] if numbers else ""
    return lines[-1] if lines else ""


def _last_tagged(text: str) -> str | None:
    """The last match of ``<answer>(.*?)</answer>`` (case-insensitive, across lines) as ``re.findall`` finds them, in
    five linear searches instead of a scan to the end from every unclosed tag. ``findall`` is back at "looking for
    an opening tag" after every closing one; so the last match opens at the first opening tag after the last closing
    tag that precedes the last opening tag followed by a closing one, and ends at the first closing tag after it."""
    folded = text.translate(_TAG_CASE)  # same length, so positions carry over
    last_close = folded.rfind(_CLOSE)
    last_open = folded.rfind(_OPEN, 0, last_close) if last_close >= 0 else -1
    if last_open < 0:
        return None
    before = folded.rfind(_CLOSE, 0, last_open)
    start = folded.find(_OPEN, before + len(_CLOSE) if before >= 0 else 0) + len(_OPEN)
    return text[start:folded.find(_CLOSE, start)]


def final_reply(transcript: Sequence[Message]) -> str:
    """The content of the last assistant message that has text."""
    return last_text(transcript, "assistant")


def last_text(messages: Sequence[Any], role: str) -> str:
    """The text of the last message from ``role`` that has any: a reward function reads the question with
    ``last_text(prompt, "user")`` and the reply with ``last_text(completion, "assistant")``. Messages may be dicts or
    objects with ``role`` and ``content`` attributes (verifiers passes either)."""
    for message in reversed(messages or []):
        get = message.get if isinstance(message, dict) else lambda key, m=message: getattr(m, key, None)
        content = get("content")
        if get("role") == role and isinstance(content, str) and content.strip():
            return content
    return ""


class TaskFamily(Component, ABC):
    """A task family. Subclasses set the class attributes and implement :meth:`generate` and :meth:`solve`.

    ``generate`` is the public, seeded generator: the same (seed, level, n) gives the same items byte for byte.
    ``tool_functions`` are plain functions whose first parameter is ``world``. ``solve`` is the reference solver: it
    must use the tools, through :meth:`ToolSession.call`, and reach score 1.0 on every item.
    """

    held_out: ClassVar[bool] = False
    levels: ClassVar[tuple[int, ...]] = (1, 2, 3)
    default_level: ClassVar[int] = 1
    eval_size: ClassVar[int] = 200
    # set it in the family's private module: the public generator plus this seed is the hidden set
    eval_seed: ClassVar[int]
    dev_seed: ClassVar[int] = 7
    turn_limit: ClassVar[int] = 4
    goal: ClassVar[str]
    system_prompt: ClassVar[str]
    answer_format: ClassVar[str] = "End your final reply with <answer>ANSWER</answer>."
    answer_fallback: ClassVar[Literal["last_line", "last_number"]] = "last_line"
    public_modules: ClassVar[tuple[str, ...]] = ()
    tool_functions: ClassVar[tuple[Callable, ...]] = ()

    # -- public: generator and tools -------------------------------------------------------------------------
    @abstractmethod
    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        """``n`` items at ``level`` from ``seed``: the same arguments give the same items, byte for byte."""

    def tools(self, item: Item) -> dict[str, Callable]:
        """The tool functions bound to a private copy of ``item``'s world, by name: call once per conversation, so
        that a tool that writes state never leaks it into another conversation."""
        world = copy.deepcopy(item.world)
        return {fn.__name__: bind(fn, world) for fn in self.tool_functions}

    def tool_schemas(self) -> list[dict]:
        return [tool_schema(fn) for fn in self.tool_functions]

    # -- private: eval, scoring, reference -------------------------------------------------------------------
    def hidden_eval(self, n: int | None = None, level: int | None = None) -> list[Item]:
        """The hidden eval set: ``eval_size`` items at the default level from a fixed seed (a prefix if ``n``)."""
        n = self.eval_size if n is None else n
        return self.generate(self.eval_seed, self.default_level if level is None else level, n)

    def dev_examples(self, level: int | None = None, n: int = 3) -> list[Item]:
        """Items the agent may see; disjoint from the hidden set."""
        hidden = {item.id for item in self._hidden_items}
        level = self.default_level if level is None else level
        items = [item for item in self.generate(self.dev_seed, level, n * 2 + 4) if item.id not in hidden]
        return items[:n]

    @cached_property
    def _hidden_items(self) -> list[Item]:
        return [item for level in self.levels for item in self.hidden_eval(level=level)]

    @cached_property
    def _overlap_index(self) -> _OverlapIndex:
        return _OverlapIndex(self._hidden_items)

    def overlap(self, rows: Iterable[Any]) -> list[int]:
        """Indices of dataset rows that contain a hidden-eval item at any level.

        A row may be an :class:`Item`, a dict (its string values and long keys, nested, are searched) or a string. Text
        is compared as words and numbers after folding spellings that read alike (see :func:`_skeleton`); a row
        matches an item when it holds all the numbers of the item's question and enough of the question's rare words
        and word runs, fewer when it also holds the item's answer (see :class:`_OverlapIndex`).
        """
        index = self._overlap_index
        return [n for n, row in enumerate(rows) if index.matches(_skeleton("\n".join(_row_texts(row))))]

    def normalise_answer(self, answer: str) -> str:
        """How answers compare: whitespace trimmed and collapsed; numbers compared as numbers."""
        text = " ".join(str(answer).split())
        if not NUMBER.fullmatch(text):
            return text
        number = float(text.replace(",", ""))
        return str(int(number)) if number.is_integer() else repr(number)

    def score(self, item: Item, transcript: Sequence[Message]) -> float:
        """1.0 if the final answer equals the item's answer, else 0.0. Families with partial credit override this."""
        given = extract_answer(final_reply(transcript), self.answer_fallback)
        return float(self.normalise_answer(given) == self.normalise_answer(item.answer))

    @abstractmethod
    def solve(self, item: Item, session: ToolSession) -> str:
        """Reference solver: call tools through ``session`` and return the final answer string."""

    def reference_transcript(self, item: Item) -> list[Message]:
        session = ToolSession(self, item)
        answer = self.solve(item, session)
        return session.finish(f"<answer>{answer}</answer>")

    # -- the spec --------------------------------------------------------------------------------------------
    def task_spec(self, level: int | None = None, constraints: Constraints | None = None) -> TaskSpec:
        level = self.default_level if level is None else level
        if level not in self.levels:
            raise ValueError(f"{self.name}: level {level} is not one of {self.levels}")
        examples = [DevExample(item=item, transcript=self.reference_transcript(item))
                    for item in self.dev_examples(level)]
        return TaskSpec(
            family=self.name,
            level=level,
            held_out=self.held_out,
            goal=self.goal,
            constraints=constraints or Constraints(),
            eval_interface=EvalInterface(
                system_prompt=self.system_prompt,
                tools=self.tool_schemas(),
                answer_format=self.answer_format,
                turn_limit=self.turn_limit,
            ),
            public_modules=list(self.public_modules),
            dev_examples=examples,
        )

    def initial_messages(self, item: Item) -> list[Message]:
        """The conversation the eval starts from."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": item.question}]


class ToolSession:
    """A conversation in progress on one item: records each tool call and its result as OpenAI messages."""

    def __init__(self, family: TaskFamily, item: Item):
        self.family = family
        self.item = item
        self.tools = family.tools(item)
        self.messages: list[Message] = family.initial_messages(item)

    def call(self, name: str, /, **arguments: Any) -> str:
        call_id = f"call_{sum(1 for m in self.messages if m['role'] == 'tool')}"
        payload = json.dumps(arguments, sort_keys=True)
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": payload}}]})
        result = call_tool(self.tools, name, payload)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
        return result

    def finish(self, reply: str) -> list[Message]:
        self.messages.append({"role": "assistant", "content": reply})
        return self.messages


# -- the hidden-eval overlap check -------------------------------------------------------------------------------
# Similarity is weighted containment: the share of an item's question features (its words, and its runs of two and
# three words) that a row holds, each feature weighted by its rarity among the hidden questions, so that template
# wording counts little and names, ids and numbers count a lot.
OVERLAP_SIMILARITY = 0.9  # enough on the question alone
OVERLAP_SIMILARITY_WITH_ANSWER = 0.75  # enough when the row also holds the item's answer

_Feature = str | tuple[str, ...]  # a word, or a run of two or three words

_TOKEN = re.compile(r"[a-z]+|[1-9][0-9]*|0(?![0-9])")  # words and numbers, leading zeros dropped
_THOUSANDS = re.compile(r",(?<=[0-9],)(?=[0-9]{3}(?![0-9]))")  # the comma in 1,000; led by a literal: fast
# letters that render like Latin ones: Cyrillic, Greek, Armenian, Latin small capitals and variants
_CONFUSABLES = dict(pair.split(":") for pair in (
    "а:a А:a в:b В:b е:e Е:e к:k К:k м:m М:m н:h Н:h о:o О:o р:p Р:p с:c С:c т:t Т:t х:x Х:x у:y У:y ү:y Ү:y "
    "ь:b г:r п:n ѵ:v ѕ:s Ѕ:s і:i І:i ј:j Ј:j ӏ:l Ӏ:l ԁ:d Ԁ:d һ:h Һ:h ԛ:q Ԛ:q ԝ:w Ԝ:w "
    "Α:a α:a Β:b β:b Ε:e ε:e Ζ:z Η:h η:n Ι:i ι:i Κ:k κ:k Μ:m μ:u Ν:n ν:v Ο:o ο:o Ρ:p ρ:p Τ:t τ:t Υ:y υ:u "
    "Χ:x χ:x γ:y ω:w օ:o ս:u ո:n հ:h ց:g զ:q ı:i ȷ:j ɑ:a ɡ:g ɩ:i ɪ:i ʀ:r ᴀ:a ʙ:b ᴄ:c ᴅ:d ᴇ:e ꜰ:f ɢ:g ʜ:h "
    "ᴊ:j ᴋ:k ʟ:l ᴍ:m ɴ:n ᴏ:o ᴘ:p ꞯ:q ꜱ:s ᴛ:t ᴜ:u ᴠ:v ᴡ:w ʏ:y ᴢ:z ø:o ł:l đ:d ħ:h ƀ:b ɨ:i ŧ:t ƶ:z ǀ:l"
).split())
_FILLERS = frozenset("\u115f\u1160\u3164\uffa0")  # Hangul fillers: letters that render as nothing


class _Fold(dict):
    """A ``str.translate`` table, filled on demand: drops marks and invisible characters, maps look-alike letters to
    Latin ones and the decimal digits of any script to ASCII ones."""

    def __missing__(self, code: int) -> str | None:
        if len(self) > 65_536:  # stay small, whatever text comes by
            self.clear()
        char = chr(code)
        category = unicodedata.category(char)
        if char in _CONFUSABLES:
            value = _CONFUSABLES[char]
        elif category[0] == "M" or category in ("Cf", "Cn", "Co", "Cs") or char in _FILLERS:
            value = None
        elif category == "Cc":
            value = " " if char.isspace() else None
        elif category == "Nd":
            value = str(unicodedata.decimal(char))
        else:
            value = char
        self[code] = value
        return value


_FOLD = _Fold()


def _skeleton(text: str) -> list[str]:
    """The words and numbers of ``text``, folded so that spellings that read alike compare equal.

    Unicode compatibility forms are unfolded (NFKD: full-width and styled letters and digits become plain ones,
    accents come apart), marks and format characters (zero-width spaces and joiners, soft hyphens, bidi controls)
    are dropped, look-alike letters become Latin ones, case is folded, thousands separators and leading zeros go;
    any other character separates words.
    """
    if text.isascii():
        text = text.lower()
    else:
        text = unicodedata.normalize("NFKD", text).translate(_FOLD).casefold()
    return _TOKEN.findall(_THOUSANDS.sub("", text) if "," in text else text)


class _Runs:
    """The features of a token sequence: its words and its runs of two and three words."""

    __slots__ = ("words", "pairs", "triples")

    def __init__(self, tokens: Sequence[str]):
        self.words = set(tokens)
        self.pairs = set(zip(tokens, tokens[1:]))
        self.triples = set(zip(tokens, tokens[1:], tokens[2:]))


class _Probe:
    """One hidden item as the overlap check sees it: its question's weighted features, numbers and answer."""

    __slots__ = ("weights", "words", "pairs", "triples", "total", "shares", "numbers", "answer", "anchors")

    def __init__(self, runs: _Runs, weight: Callable[[_Feature], float], numbers: frozenset[str],
                 answer: frozenset[str]):
        self.words, self.pairs, self.triples = frozenset(runs.words), frozenset(runs.pairs), frozenset(runs.triples)
        features: list[_Feature] = [*self.words, *self.pairs, *self.triples]
        self.weights = {feature: weight(feature) for feature in features}
        self.total = sum(self.weights.values())
        self.shares: dict[str, float] = {}  # each feature's weight spread over its words: what a missing word loses
        for feature, value in self.weights.items():
            parts = {feature} if isinstance(feature, str) else set(feature)
            for word in parts:
                self.shares[word] = self.shares.get(word, 0.0) + value / len(parts)
        self.numbers = numbers
        self.answer = answer  # empty when the answer is no evidence: it is in the item's question or world too
        # a bag of the right words holds every word and every key, but few of these runs
        anchors = self._enough(lambda f: (isinstance(f, tuple) and len(f), self.weights[f]))
        self.anchors = (self.triples & anchors, self.pairs & anchors, self.words & anchors)

    def _enough(self, order: Callable[[_Feature], Any]) -> frozenset[_Feature]:
        """The first features in ``order`` that a matching row cannot all miss: missing them loses too much."""
        chosen, kept = [], self.total
        for feature in sorted(self.weights, key=order, reverse=True):
            chosen.append(feature)
            kept -= self.weights[feature]
            if kept < OVERLAP_SIMILARITY_WITH_ANSWER * self.total:
                break
        return frozenset(chosen)

    def keys(self) -> frozenset[_Feature]:
        """What the item is filed under: its rarest features, of which a matching row holds at least one."""
        return self._enough(lambda f: (self.weights[f], isinstance(f, tuple) and len(f)))

    def possible(self, runs: _Runs) -> bool:
        """Whether the row holds the question's numbers and one of its anchors (its rarest runs): cheap, tried first."""
        triples, pairs, words = self.anchors
        return self.numbers <= runs.words and not (
            triples.isdisjoint(runs.triples) and pairs.isdisjoint(runs.pairs) and words.isdisjoint(runs.words))

    def bound(self, words: set[str]) -> float:
        """An upper bound on :meth:`similarity` from the row's words alone: cheap, tried next."""
        return 1 - sum(map(self.shares.__getitem__, self.words - words)) / self.total

    def similarity(self, runs: _Runs) -> float:
        """The weighted share of the question's features that the row holds."""
        found: Iterable[_Feature] = chain(self.words & runs.words, self.pairs & runs.pairs, self.triples & runs.triples)
        return sum(map(self.weights.__getitem__, found)) / self.total


class _OverlapIndex:
    """The hidden items, indexed for the overlap check.

    A row matches an item when it holds every number of the item's question and its similarity to the question is at
    least ``OVERLAP_SIMILARITY``, or ``OVERLAP_SIMILARITY_WITH_ANSWER`` when the row also holds the item's answer.
    Each item is filed under its rarest features (:meth:`_Probe.keys`), so a row is compared only with the items
    that share one of them, and then only in full when cheaper checks do not rule the item out.
    """

    def __init__(self, items: Iterable[Item]):
        parsed = []
        for item in items:
            tokens = _skeleton(item.question)
            if tokens:
                context = set(tokens) | set(_skeleton("\n".join(_row_texts(item.world))))
                answer = frozenset(_skeleton(item.answer))
                parsed.append((_Runs(tokens), frozenset(t for t in tokens if t.isdigit()),
                               answer if not answer <= context else frozenset()))
        frequency = Counter(f for runs, _, _ in parsed for f in chain(runs.words, runs.pairs, runs.triples))
        rarity = {f: math.log((len(parsed) + 1) / (count + 0.5)) for f, count in frequency.items()}
        self.probes = [_Probe(runs, rarity.__getitem__, numbers, answer) for runs, numbers, answer in parsed]
        self.index: dict[_Feature, list[int]] = {}
        for n, probe in enumerate(self.probes):
            for key in probe.keys():
                self.index.setdefault(key, []).append(n)
        self.keys = frozenset(self.index)

    def matches(self, tokens: Sequence[str]) -> bool:
        """Whether a row with these tokens (from :func:`_skeleton`) holds a hidden item."""
        runs = _Runs(tokens)
        keys = (runs.triples & self.keys) | (runs.pairs & self.keys) | (runs.words & self.keys)
        for n in {n for key in keys for n in self.index[key]}:
            probe = self.probes[n]
            if not probe.possible(runs):
                continue
            loose = probe.answer and probe.answer <= runs.words
            need = OVERLAP_SIMILARITY_WITH_ANSWER if loose else OVERLAP_SIMILARITY
            if probe.bound(runs.words) >= need and probe.similarity(runs) >= need:
                return True
        return False


_SCALARS = frozenset((int, float, bool, type(None)))
_LONG_KEY = 24  # a dict key longer than this is searched as text; shorter ones are field names


def _row_texts(row: Any) -> list[str]:
    """The strings of a row, in order: an item's question, answer and world, or the string values (and long keys) of
    nested dicts and lists."""
    texts: list[str] = []
    add = texts.append

    def walk(value: Any) -> None:
        if type(value) is dict or isinstance(value, dict):
            for key, part in value.items():
                if type(key) is str and len(key) > _LONG_KEY:
                    add(key)
                if type(part) is str:
                    add(part)
                elif type(part) not in _SCALARS:
                    walk(part)
        elif type(value) is list or isinstance(value, (list, tuple)):
            for part in value:
                if type(part) is str:
                    add(part)
                elif type(part) not in _SCALARS:
                    walk(part)
        elif isinstance(value, str):
            add(value)
        elif isinstance(value, Item):
            walk({"question": value.question, "answer": value.answer, "world": value.world})

    try:
        walk(row)
    except RecursionError:  # nested deeper than the stack allows: walk it with a stack of our own
        texts.clear()
        stack = [row]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                add(value)
            elif isinstance(value, dict):
                for key, part in reversed(value.items()):
                    stack.append(part)
                    if isinstance(key, str) and len(key) > _LONG_KEY:
                        stack.append(key)
            elif isinstance(value, (list, tuple)):
                stack.extend(reversed(value))
            elif isinstance(value, Item):
                stack.append({"question": value.question, "answer": value.answer, "world": value.world})
    return texts
