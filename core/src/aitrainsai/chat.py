"""Chat formatting for trainers that feed a model tokens: ChatML text with Hermes tool calls, tool-call parsing, and
the tokens between turns. Used by the local inner trainer, the tinker outer trainer and any outer trainer that renders
its own prompts (a Tinker-style sampler). No torch here: rendering is text, and :class:`ChatTokens` turns text into ids
with any tokenizer that has ``encode(text, add_special_tokens=False)``.

The format, as SmolLM2 and Qwen2.5 write it::

    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>{one JSON schema a line}</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>...<|im_end|>\\n

Tool schemas go into the system message (appended to the conversation's own, else a system message of their own);
consecutive tool results become one user turn of ``<tool_response>`` blocks. Replies are parsed the way vLLM's
``hermes`` parser (which prime-rl uses) parses them: any block that is not a JSON object with ``name`` and
``arguments`` makes the whole reply plain text, with a parse error saying why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Required, cast

from pydantic import BaseModel, ConfigDict, with_config
from typing_extensions import TypedDict  # pydantic validates only this TypedDict on Python 3.11


class ToolFunction(TypedDict):
    """The function a tool call names and its arguments, a JSON object as text (a ``FunctionCall`` as a dict)."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One tool call of an assistant message, in the OpenAI format."""

    id: str
    type: Literal["function"]
    function: ToolFunction


@with_config(ConfigDict(extra="allow"))
class Message(TypedDict, total=False):
    """An OpenAI-format chat message, as the system passes it: ``role`` always, ``content``, ``tool_calls`` (an
    assistant's), ``tool_call_id`` and ``name`` (a tool result's). Other keys pass through."""

    role: Required[str]
    content: str | None
    tool_calls: list[ToolCall]
    tool_call_id: str
    name: str


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
_PLACEHOLDER = "\x00reply\x00"


class FunctionCall(BaseModel):
    """The function a tool call names and its arguments, as the OpenAI wire format carries them."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # a JSON object, as text (the OpenAI wire format)


class ChatToolCall(BaseModel):
    """A :class:`ToolCall`, typed."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message, typed. :meth:`of` reads the dicts the episode loop and the families pass around."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, message: Message | ChatMessage) -> ChatMessage:
        if isinstance(message, ChatMessage):
            return message
        calls = message.get("tool_calls") or None
        typed = [_tool_call(c, k) for k, c in enumerate(calls)] if calls else None
        name, call_id = message.get("name"), message.get("tool_call_id")
        return cls(role=str(message.get("role", "")), content=_text(message.get("content")), tool_calls=typed,
                   tool_call_id=None if call_id is None else str(call_id), name=None if name is None else str(name))

    def to_dict(self) -> Message:
        return cast(Message, self.model_dump(mode="json", exclude_none=True))


class ParsedReply(BaseModel):
    """A sampled reply read as a message: ``content`` is the text before the first ``<tool_call>`` when the calls
    parse, else the whole text; ``error`` says why a reply that tried to call a tool has no calls."""

    model_config = ConfigDict(extra="forbid")

    content: str
    calls: list[FunctionCall]
    error: str | None = None

    def message(self, *, first_call: int = 0) -> Message:
        """The assistant message, with call ids ``call_{first_call}``, ``call_{first_call + 1}``, ..."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [{"id": f"call_{first_call + k}", "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for k, call in enumerate(self.calls)]
        return message


def parse_reply(text: str) -> ParsedReply:
    """Read the Hermes tool calls in ``text``. Never raises: a malformed call gives a reply with no calls, all
    text, and an error."""
    if "<tool_call>" not in text:
        return ParsedReply(content=text, calls=[])
    calls = []
    for closed, open_ended in TOOL_CALL.findall(text):
        try:
            call = json.loads(closed or open_ended)
        except (ValueError, RecursionError) as exc:  # nesting too deep for the parser is malformed too
            reason = exc if isinstance(exc, ValueError) else "nested too deeply"
            return ParsedReply(content=text, calls=[], error=f"a <tool_call> block is not valid JSON ({reason})")
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return ParsedReply(content=text, calls=[],
                               error="a <tool_call> block is not a JSON object with name and arguments")
        calls.append(FunctionCall(name=str(call["name"]), arguments=json.dumps(call["arguments"], ensure_ascii=False)))
    return ParsedReply(content=text[:text.find("<tool_call>")], calls=calls)


def parse_tool_calls(text: str) -> tuple[str, list[ToolFunction]]:
    """``(content, calls)`` of a reply, each call ``{"name": ..., "arguments": <JSON string>}``; a reply with no
    valid calls is all content. :func:`parse_reply` also says why."""
    parsed = parse_reply(text)
    return parsed.content, [{"name": call.name, "arguments": call.arguments} for call in parsed.calls]


def format_tool_call(call: FunctionCall) -> str:
    """One call as a Hermes block; arguments that are not JSON go in as a JSON string."""
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass(frozen=True)
class ChatML:
    """ChatML rendering. ``default_system`` is the system message a model's template adds when a conversation has
    none (SmolLM2's: "You are a helpful AI assistant named SmolLM, trained by Hugging Face")."""

    default_system: str | None = None
    start: str = "<|im_start|>"
    end: str = "<|im_end|>"

    def render(self, messages: Sequence[Message | ChatMessage], tool_schemas: Sequence[dict] = (), *,
               add_generation_prompt: bool = False) -> str:
        turns = self.turns(messages, tool_schemas)
        if turns and turns[0][0] != "system" and self.default_system is not None:
            turns.insert(0, ("system", self.default_system))
        text = "".join(f"{self.start}{role}\n{content}{self.end}\n" for role, content in turns)
        return text + (f"{self.start}assistant\n" if add_generation_prompt else "")

    def turns(self, messages: Sequence[Message | ChatMessage], tool_schemas: Sequence[dict] = ()
              ) -> list[tuple[str, str]]:
        """``(role, text)`` per rendered turn: tools in the system turn, assistant calls as Hermes blocks, each run of
        tool results as one user turn."""
        turns: list[tuple[str, str]] = []
        merging = False  # the last turn holds tool results
        for raw in messages:
            message = ChatMessage.of(raw)
            if message.role == "tool":
                block = f"<tool_response>\n{message.content or ''}\n</tool_response>"
                if merging:
                    turns[-1] = ("user", turns[-1][1] + "\n" + block)
                else:
                    turns.append(("user", block))
                merging = True
                continue
            merging = False
            content = message.content or ""
            for call in message.tool_calls or []:
                content += ("\n" if content else "") + format_tool_call(call.function)
            turns.append((message.role, content))
        if tool_schemas:
            listing = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in tool_schemas)
            prompt = TOOLS_PROMPT.format(tools=listing)
            if turns and turns[0][0] == "system":
                turns[0] = ("system", f"{turns[0][1]}\n\n{prompt}")
            else:
                turns.insert(0, ("system", prompt))
        return turns


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class ChatTokens:
    """A :class:`ChatML` format with a tokenizer: prompt ids, and the ids between turns (cached)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatML):
        self.tokenizer = tokenizer
        self.template = template
        self.end_of_turn = template.end
        end = self.encode(template.end)
        self.end_of_turn_id: int | None = end[0] if len(end) == 1 else None
        self._bridges: dict[tuple, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: Sequence[Message | ChatMessage], tool_schemas: Sequence[dict] = (), *,
               add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, tool_schemas, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Message | ChatMessage], tool_schemas: Sequence[dict] = ()) -> list[int]:
        return self.encode(self.render(messages, tool_schemas, add_generation_prompt=True))

    def bridge_ids(self, following: Sequence[Message | ChatMessage], reply_ended: bool, *,
                   cache: bool = True) -> list[int]:
        """The tokens after a sampled reply: its end of turn (unless the reply sampled it, ``reply_ended``), the
        ``following`` messages (tool results, a user message) and the next generation prompt. Found by rendering
        with and without them. ``cache=False`` for a long-lived instance that sees ever new messages."""
        typed = [ChatMessage.of(m) for m in following]
        key = (tuple(m.model_dump_json() for m in typed), reply_ended)
        if key not in self._bridges or not cache:
            head = [ChatMessage(role="user", content="?"), ChatMessage(role="assistant", content=_PLACEHOLDER)]
            before = self.render(head)
            after = self.render(head + typed, add_generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat format renders earlier messages differently once later messages follow")
            tail = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
            if reply_ended and tail.startswith(self.end_of_turn):
                tail = tail[len(self.end_of_turn):]
            ids = self.encode(tail + after[len(before):])
            if not cache:
                return ids
            self._bridges[key] = ids
        return list(self._bridges[key])


def _text(content: Any) -> str | None:
    return None if content is None else content_text(content)


def content_text(content: Any) -> str:
    """A message's content as text: a string as it is, the text of OpenAI content parts (dicts or objects with a
    ``text``), anything else as ``str``; none is ``""``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, dict) else str(getattr(part, "text", "") or "")
                       for part in content)
    return "" if content is None else str(content)


def openai_message(message: Any) -> Message:
    """A verifiers message (typed, any version, or already a dict) as an OpenAI chat message: its role, text content,
    tool calls, and the call a tool result answers."""
    if isinstance(message, dict):
        return cast(Message, message)
    out: Message = {"role": str(getattr(message, "role", "")),
                    "content": content_text(getattr(message, "content", ""))}
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    if getattr(message, "tool_call_id", None):
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool_call(call: Any, index: int) -> ChatToolCall:
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return ChatToolCall(id=str(call.get("id") or f"call_{index}"),
                        function=FunctionCall(name=str(function.get("name", "")), arguments=arguments))
