"""The hidden eval, run by the core: one code path scores the untrained base (pre) and a trained checkpoint (post).

A family's eval is its own: its hidden items, its system prompt and tools, its turn limit, greedy replies, and its
scorer. What differs between inner trainers is only the model, reached through a :class:`ChatEngine`: a callable
from a batch of conversations (messages and tool schemas) to the model's next reply in each. The local trainer's
engine generates with its bf16/fp32 model; a remote trainer's engine might call its inference server. This module
drives the turns: it runs each reply's tool calls with the family's tools bound to the item, feeds the results back,
and stops at a reply without a tool call or at the family's turn limit (that reply's calls are not run).

Conversations run in fixed batches of the engine's ``batch_size``, each to its end, so the same weights give the same
scores. :class:`EngineSpec` names everything about an engine that changes a score; with the family's version and the
eval size it keys the run's baseline cache (:class:`aitrainsai.run.baseline.Baselines`).

Nothing here imports agent code: the evaluation sees the family (trusted, installed) and the engine's replies.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.tools import call_tool

if TYPE_CHECKING:
    from aitrainsai.chat import Message, ToolCall
    from aitrainsai.families import Item, TaskFamily


class EngineSpec(BaseModel):
    """Everything about a chat engine that can change a score (the checkpoint aside)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = Field(description="the engine's kind, e.g. 'local'")
    base_model: str
    dtype: str = Field(description="the dtype the engine computes in, resolved (not 'auto')")
    max_new_tokens: int = Field(ge=1, description="per reply")
    batch_size: int = Field(ge=1, description="conversations generated together")
    extra: dict[str, Any] = Field(default_factory=dict, description="any other setting that changes a reply")

    def key(self) -> str:
        extra = ",".join(f"{k}={self.extra[k]}" for k in sorted(self.extra))
        return (f"{self.engine}|{self.base_model}|{self.dtype}|tokens={self.max_new_tokens}|batch={self.batch_size}"
                + (f"|{extra}" if extra else ""))


@dataclass
class ChatRequest:
    """One conversation's next turn: ``key`` names the conversation for the engine (stable from turn to turn within
    one batch), ``messages`` is the whole conversation so far, ``tools`` the tool schemas."""

    key: str
    messages: list[Message]
    tools: list[dict]


class ChatEngine(Protocol):
    """A model behind a chat interface: ``engine(requests)`` returns one assistant message per request (a dict with
    ``content`` and, when it calls tools, ``tool_calls`` in OpenAI form; ids are reassigned here). Greedy and
    deterministic. :meth:`new_batch` is called before each batch of fresh conversations."""

    spec: EngineSpec

    def __call__(self, requests: Sequence[ChatRequest]) -> list[Message]: ...

    def new_batch(self) -> None: ...


@dataclass
class Conversation:
    """One eval conversation in progress: its messages and the tools bound to its item."""

    messages: list[Message]
    tools: dict[str, Any]
    replies: int = 0
    calls: int = 0


class EvalResult(BaseModel):
    """Per-item scores of one evaluation, in the hidden set's order."""

    model_config = ConfigDict(extra="forbid")

    family: str
    level: int
    eval_seed: int
    eval_size: int
    engine: EngineSpec
    item_scores: list[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]]  # a worker's file is data
    transcripts: list[list[dict[str, Any]]] = Field(default_factory=list, exclude=True, repr=False)

    @property
    def score(self) -> float:
        return sum(self.item_scores) / len(self.item_scores) if self.item_scores else 0.0


def evaluate_items(family: TaskFamily, items: Sequence[Item], engine: ChatEngine, *,
                   turn_limit: int | None = None) -> tuple[list[float], list[list[Message]]]:
    """``family.score(item, transcript)`` for each item after a greedy conversation through ``engine`` (see the
    module docstring); returns the scores and the transcripts."""
    starts = [([m.copy() for m in family.initial_messages(item)], family.tools(item)) for item in items]
    transcripts = converse(starts, family.tool_schemas(), engine, turn_limit=turn_limit or family.turn_limit)
    scores = [float(family.score(item, transcript)) for item, transcript in zip(items, transcripts)]
    return scores, transcripts


def converse(starts: Sequence[tuple[list[Message], dict[str, Any]]], schemas: list[dict], engine: ChatEngine, *,
             turn_limit: int) -> list[list[Message]]:
    """The conversations that start with each ``(messages, bound tools)`` of ``starts``, played greedily through
    ``engine`` in fixed batches to a reply without a tool call or to ``turn_limit`` replies; no scoring. A worker
    that must not hold a family's scorer runs this half; the trusted side scores the transcripts."""
    if turn_limit < 1:
        raise ValueError("turn_limit must be at least 1")
    batch_size = engine.spec.batch_size
    transcripts: list[list[Message]] = []
    for start in range(0, len(starts), batch_size):
        batch = [Conversation(list(messages), tools) for messages, tools in starts[start:start + batch_size]]
        engine.new_batch()
        active = list(range(len(batch)))
        while active:
            replies = engine([ChatRequest(str(start + i), batch[i].messages, schemas) for i in active])
            if len(replies) != len(active):
                raise RuntimeError(f"the engine answered {len(replies)} of {len(active)} conversations")
            still = []
            for index, reply in zip(active, replies):
                conversation = batch[index]
                calls = _take_turn(conversation, reply)
                if calls and conversation.replies < turn_limit:
                    _run_calls(conversation, calls)
                    still.append(index)
            active = still
        transcripts.extend(conversation.messages for conversation in batch)
    return transcripts


def evaluate_family(family: TaskFamily, level: int, engine: ChatEngine, *, eval_size: int) -> EvalResult:
    """The family's hidden eval at ``level`` (its first ``eval_size`` items) through ``engine``."""
    items = family.hidden_eval(eval_size, level)
    scores, transcripts = evaluate_items(family, items, engine)
    return EvalResult(family=family.name, level=level, eval_seed=family.eval_seed, eval_size=len(items),
                      engine=engine.spec, item_scores=scores, transcripts=transcripts)


def _take_turn(conversation: Conversation, reply: Message) -> list[ToolCall]:
    """Append the engine's reply (tool call ids numbered per conversation); return its calls."""
    calls: list[ToolCall] = []
    for call in reply.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append({"id": f"call_{conversation.calls + len(calls)}", "type": "function",
                          "function": {"name": function.get("name"), "arguments": function.get("arguments")}})
    message: Message = {"role": "assistant", "content": reply.get("content") or ""}
    if calls:
        message["tool_calls"] = calls
    conversation.messages.append(message)
    conversation.replies += 1
    return calls


def _run_calls(conversation: Conversation, calls: list[ToolCall]) -> None:
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        conversation.messages.append({"role": "tool", "tool_call_id": call["id"], "name": str(name),
                                      "content": call_tool(conversation.tools, name, arguments)})
    conversation.calls += len(calls)


# -- what the scores are compared by ---------------------------------------------------------------------------------
def family_version(family: TaskFamily) -> str:
    """A digest of the family's installed package (every ``.py`` file): a changed generator, seed or scorer is a new
    version, so that no cached baseline outlives it. Read once per package and process."""
    return _package_digest(type(family).__module__.split(".")[0])


@functools.cache
def _package_digest(name: str) -> str:
    import importlib

    package = importlib.import_module(name)
    assert package.__file__ is not None, f"{name} is a namespace package"
    root = Path(package.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def paired_bootstrap(pre: Sequence[float], post: Sequence[float], n: int = 10_000, seed: int = 0,
                     confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(post − pre), resampling items (pairs) with replacement."""
    if len(pre) != len(post):
        raise ValueError("pre and post scores must be paired: the same items in the same order")
    if not pre:
        raise ValueError("no scores")
    diff = [b - a for a, b in zip(pre, post)]
    size = len(diff)
    rng = random.Random(seed)
    means = sorted(sum(diff[rng.randrange(size)] for _ in range(size)) / size for _ in range(n))
    tail = (1.0 - confidence) / 2
    return _quantile(means, tail), _quantile(means, 1.0 - tail)


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
