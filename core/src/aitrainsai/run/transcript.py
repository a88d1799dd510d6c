"""The agent's conversation as the run stores it: its tools called with the agent's caps, a message cut to a bound
before it reaches the ledger, and each turn's outcome read back from the transcript."""

from __future__ import annotations

from typing import Any, cast
from collections.abc import Callable

from aitrainsai.chat import Message
from aitrainsai.parsing import UntrustedInputError, load_json
from aitrainsai.tools import call_tool_async

AGENT_ARGUMENT_CHARS = 2_000_000  # write_file carries whole files; the workspace enforces its own caps
AGENT_RESULT_CHARS = 100_000
MAX_STORED_MESSAGE = 2 * AGENT_ARGUMENT_CHARS + 100_000  # what one message may add to the ledger
MAX_STORED_TEXT = AGENT_ARGUMENT_CHARS + 1_000


async def call_agent_tool(tools: dict[str, Callable], name: Any, arguments: Any) -> str:
    """One of the agent's tool calls, answered as text (``error: ...`` for anything wrong, never raised)."""
    return await call_tool_async(tools, name, arguments, max_argument_chars=AGENT_ARGUMENT_CHARS,
                                 max_result_chars=AGENT_RESULT_CHARS)


def is_object(arguments: Any) -> bool:
    """Whether a call's arguments are a JSON object (none at all counts as ``{}``): a submission that parses."""
    if arguments in (None, ""):
        return True
    if isinstance(arguments, str):
        try:
            arguments = load_json(arguments, what="arguments", max_bytes=AGENT_ARGUMENT_CHARS)
        except UntrustedInputError:
            return False
    return isinstance(arguments, dict)


def stored(message: Message) -> Message:
    """``message`` as the ledger keeps it: itself, or cut to ``MAX_STORED_MESSAGE`` characters (:func:`capped`)."""
    return capped(message) if size(message) > MAX_STORED_MESSAGE else message


def size(message: Message) -> int:
    """An upper bound of the message's stored size, computed without serialising it."""
    total = len(str(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        total += len(str(function.get("arguments") or "")) if isinstance(function, dict) else len(str(call))
    return total + 1_000 * len(message)


def capped(message: Message) -> Message:
    """The message with its texts cut to a total of ``MAX_STORED_MESSAGE`` characters, so that one huge reply cannot
    grow the ledger past a bound. A cut tool call's arguments are no longer JSON: the call is answered with an error,
    as an oversized one would be; calls past the budget are dropped (and so never run)."""
    budget = [MAX_STORED_MESSAGE]

    def cut(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        keep = max(0, min(len(value), MAX_STORED_TEXT, budget[0]))
        budget[0] -= keep
        return value if keep == len(value) else value[:keep] + f"...[{len(value)} characters cut]"

    out: dict[str, Any] = {k: cut(v) for k, v in message.items() if k != "tool_calls"}
    if "tool_calls" in message:
        calls = []
        for call in message.get("tool_calls") or []:
            if budget[0] <= 0:
                break
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                calls.append({**{k: cut(v) for k, v in call.items() if k != "function"},
                              "function": {k: cut(v) for k, v in call["function"].items()}})
        out["tool_calls"] = calls
    return cast(Message, out)


def turn_results(messages: list[Message]) -> list[str]:
    """Per assistant turn: "failed" (it did not parse, or a call of it was answered "error: ..."), "ok" (calls that
    all succeeded) or "none" (no call)."""
    out: list[str] = []
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            answers = []
            for reply in messages[index + 1:]:
                if reply.get("role") not in ("tool", "user"):
                    break
                answers.append(str(reply.get("content", "")))
            out.append("failed" if any(a.startswith("error: ") for a in answers)
                       else "ok" if message.get("tool_calls") else "none")
    return out
