"""Task families: what the outer agent is asked to teach a small model.

A family subclasses :class:`TaskFamily`. Its public part — the seeded generator and the tool functions — is what an
agent's job may import (listed in ``public_modules``). Its private part — the hidden eval set, the overlap check, the
scorer and the reference solver — lives on the family class, which agent code may never import.
"""

from __future__ import annotations

import copy
import hashlib
from abc import ABC, abstractmethod
import json
import re
from functools import cached_property
from typing import Any, Callable, ClassVar, Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.components import Component
from aitrainsai.tools import bind, call_tool, tool_schema

Message = dict[str, Any]
"""An OpenAI chat message: ``{"role": ..., "content": ..., "tool_calls": [...], "tool_call_id": ...}``."""


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


class EvalInterface(BaseModel):
    """How the hidden eval talks to the trained model; a job's environment must present the same interface."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str
    tools: list[dict]
    answer_format: str
    turn_limit: int


class DevExample(BaseModel):
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


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
ANSWER_LINE = re.compile(r"answer\s*[:=]\s*(.+)", re.I)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str | None, fallback: Literal["last_line", "last_number"] = "last_line") -> str:
    """The final answer in a reply: the last ``<answer>...</answer>``, else what follows the last ``Answer:``,
    else (``fallback``) the last non-empty line or the last number in the reply."""
    if not text:
        return ""
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
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


def final_reply(transcript: Sequence[Message]) -> str:
    """The content of the last assistant message that has text."""
    for message in reversed(transcript):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str) and message["content"].strip():
            return message["content"]
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
    eval_seed: ClassVar[int]  # set it in the family's private module: the public generator plus this seed is the hidden set
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

    def overlap(self, rows: Iterable[Any]) -> list[int]:
        """Indices of dataset rows that contain a hidden-eval item at any level.

        A row may be an :class:`Item`, a dict (any string values are searched) or a string. A row matches when any of
        its text contains a hidden question, compared with whitespace collapsed and case folded.
        """
        keys = {_normalise(item.question) for item in self._hidden_items}
        hits = []
        for index, row in enumerate(rows):
            texts = [_normalise(t) for t in _row_texts(row)]
            if any(text in keys or any(key in text for key in keys) for text in texts):
                hits.append(index)
        return hits

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
    def solve(self, item: Item, session: "ToolSession") -> str:
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
        examples = [DevExample(item=item, transcript=self.reference_transcript(item)) for item in self.dev_examples(level)]
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


def _normalise(text: str) -> str:
    return " ".join(str(text).split()).casefold()


def _row_texts(row: Any) -> list[str]:
    if isinstance(row, Item):
        return [row.question]
    if isinstance(row, str):
        return [row]
    if isinstance(row, dict):
        return [t for value in row.values() for t in _row_texts(value)]
    if isinstance(row, (list, tuple)):
        return [t for value in row for t in _row_texts(value)]
    return []
