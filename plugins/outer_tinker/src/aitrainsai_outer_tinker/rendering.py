"""The tinker trainer's renderers: one per chat format, chosen by the base model.

- :class:`HermesRenderer` — ChatML with Hermes JSON tool calls (the core's :mod:`aitrainsai.chat`): Qwen3 instruct
  (``Qwen/Qwen3-*-Instruct-2507``: tool schemas as JSON lines in ``<tools>`` in the system turn, calls as
  ``<tool_call>`` JSON, results as ``<tool_response>`` blocks in a user turn) and SmolLM2, which the local server
  serves. The history is one growing token prefix: a reply's exact tokens continue into the next prompt.
- :class:`Qwen35Renderer` — Qwen3.5 / Qwen3.6 without thinking (``Qwen/Qwen3.6-35B-A3B``): XML-style calls
  ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``, tool results
  grouped in one user turn, an empty ``<think>\\n\\n</think>\\n\\n`` opening each assistant turn after the last user
  message, content trimmed. The history is rendered anew each turn (the sampled tokens are not a token prefix of the
  next prompt: the tokenizer merges across the boundary), so a multi-turn episode trains as one datum per turn.

Why written here rather than imported: the reference implementation, tinker-cookbook's ``renderers/qwen3_5.py``,
installs with torch, datasets and a pinned transformers (``<=5.5.4`` in 0.5.8); its split-out ``tml-renderers``
(0.2.1) imports torch and renders the blank line before a first call differently from the cookbook and the Hugging
Face template. The tests pin this module's token ids, turn by turn, to the cookbook's own output on Qwen3.5's real
tokenizer (both installed apart, for the tests only: ``.venv/pinned/tinker-renderers``). One deliberate difference:
non-string call arguments render as JSON (``true``, ``null``), as Qwen3.6's template does; the cookbook's renderer
writes Python's ``True``/``None`` (its own docstring says Qwen3.6 diverges there).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal, Protocol

from aitrainsai import ChatMessage, ChatML, ChatTokens, FunctionCall, Message, ParsedReply, parse_reply

from aitrainsai_outer_tinker import local

LOCAL_BASE_MODEL = "SmolLM2-135M-Instruct"
"""The local server's model (``aitrainsai_tinker_local_server.MODEL_NAME``)."""

QWEN3_INSTRUCT = ChatML()
"""Qwen3 instruct's template as the core renders it: ChatML, no default system message."""

Format = Literal["hermes", "qwen3_5"]
SUPPORTED = ("Qwen3.5 / Qwen3.6 models (Qwen/Qwen3.5-*, Qwen/Qwen3.6-*), Qwen3 instruct models "
             "(Qwen/Qwen3-*-Instruct-*) and the local server's " + LOCAL_BASE_MODEL)


def chat_format(base_model: str) -> Format | None:
    """The chat format of ``base_model``; None where none of the renderers here speaks it."""
    name = base_model.rsplit("/", 1)[-1]
    if name.startswith(("Qwen3.5-", "Qwen3.6-")):
        return "qwen3_5"
    if (name.startswith("Qwen3-") and "Instruct" in name) or name == LOCAL_BASE_MODEL:
        return "hermes"
    return None


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Renderer(Protocol):
    """What the trainer needs of a chat format."""

    format: Format
    tokenizer: Any
    end_of_turn_id: int | None
    continues: bool
    """Whether a reply's sampled tokens continue into the next prompt (a :class:`HermesRenderer`, whose ``bridge``
    gives what follows)."""

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict]) -> list[int]: ...

    def parse(self, completion: Sequence[int]) -> ParsedReply: ...

    def reply(self, message: Message) -> list[int]:
        """The tokens an assistant ``message`` is sampled as after :meth:`prompt`: its text, its calls in the
        format's syntax and the end of turn (what a supervised warm start trains on)."""
        ...

    def encode(self, text: str) -> list[int]: ...


class HermesRenderer:
    """ChatML + Hermes JSON calls over :class:`aitrainsai.chat.ChatTokens`."""

    format: Format = "hermes"
    continues = True

    def __init__(self, chat: ChatTokens):
        self.chat = chat
        self.tokenizer: Any = chat.tokenizer  # a Hugging Face-style tokenizer: it decodes too
        self.end_of_turn_id = chat.end_of_turn_id

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict]) -> list[int]:
        return self.chat.prompt_ids(messages, tools)

    def bridge(self, following: Sequence[Message], reply_ended: bool) -> list[int]:
        return self.chat.bridge_ids(following, reply_ended=reply_ended, cache=False)

    def parse(self, completion: Sequence[int]) -> ParsedReply:
        return parse_reply(self.tokenizer.decode(list(completion), skip_special_tokens=True))

    def reply(self, message: Message) -> list[int]:
        typed = ChatMessage.of(message)
        if typed.role != "assistant":
            raise ValueError(f"a reply is an assistant message, not a {typed.role!r} one")
        (_, text), = self.chat.template.turns([typed])
        return self.chat.encode(text + self.chat.end_of_turn)

    def encode(self, text: str) -> list[int]:
        return self.chat.encode(text)


QWEN35_TOOLS = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, but "
    "NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=(?P<name>[^>\n]+)>\s*(?P<body>.*?)\s*</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(?P<name>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


class Qwen35Renderer:
    """Qwen3.5 / Qwen3.6, thinking disabled. ``tokenizer`` encodes special-token text as the special tokens (a
    Hugging Face tokenizer's ``encode(text, add_special_tokens=False)`` does)."""

    format: Format = "qwen3_5"
    continues = False
    end = "<|im_end|>"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = self.encode(self.end)
        self.end_of_turn_id = ids[0] if len(ids) == 1 else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: Sequence[Message], tools: Sequence[dict], *,
               add_generation_prompt: bool = True) -> str:
        typed = [ChatMessage.of(m) for m in messages]
        out: list[str] = []
        system = ""
        if typed and typed[0].role == "system":
            system = (typed[0].content or "").strip()
            typed = typed[1:]
        if tools:
            declared = QWEN35_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            system = declared + ("\n\n" + system if system else "")
        if system or tools:
            out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        last_user = max((k for k, m in enumerate(typed) if m.role == "user"), default=-1)
        k = 0
        while k < len(typed):
            message = typed[k]
            content = (message.content or "").strip()
            if message.role == "tool":
                blocks = []
                while k < len(typed) and typed[k].role == "tool":
                    blocks.append(f"<tool_response>\n{(typed[k].content or '').strip()}\n</tool_response>")
                    k += 1
                out.append("<|im_start|>user\n" + "\n".join(blocks) + "<|im_end|>\n")
                continue
            if message.role == "assistant":
                text = (EMPTY_THINK if k > last_user else "") + _assistant_text(message)
                out.append(f"<|im_start|>assistant\n{text}<|im_end|>\n")
            else:
                out.append(f"<|im_start|>{message.role}\n{content}<|im_end|>\n")
            k += 1
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n" + EMPTY_THINK)
        return "".join(out)

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict]) -> list[int]:
        return self.encode(self.render(messages, tools))

    def reply(self, message: Message) -> list[int]:
        """Sampled after the prompt's empty think block: the text, a blank line, the calls, the end of turn."""
        typed = ChatMessage.of(message)
        if typed.role != "assistant":
            raise ValueError(f"a reply is an assistant message, not a {typed.role!r} one")
        return self.encode(_assistant_text(typed) + self.end)

    def parse(self, completion: Sequence[int]) -> ParsedReply:
        """The reply sampled after the prompt's empty think block: text, then XML calls. Never raises: a malformed
        call gives a reply with no calls, all text, and an error (the core's rule for Hermes calls)."""
        text = self.tokenizer.decode(list(completion), skip_special_tokens=False)
        if text.endswith(self.end):
            text = text[:-len(self.end)]
        text = _THINK.sub("", text)
        return parse_xml_calls(text)


def _assistant_text(message: ChatMessage) -> str:
    """An assistant turn's text in Qwen3.5's format, reasoning dropped (as the history keeps it)."""
    content = _THINK.sub("", (message.content or "").strip()).strip()
    if not message.tool_calls:
        return content
    calls = "\n".join(_format_call(call.function) for call in message.tool_calls)
    return content + ("\n\n" if content else "") + calls


def parse_xml_calls(text: str) -> ParsedReply:
    """Qwen3.5's ``<tool_call><function=...><parameter=...>`` blocks in ``text``; a parameter's value is JSON where it
    parses as JSON, else the text (the cookbook's and vLLM's ``qwen3_xml`` rule)."""
    if "<tool_call>" not in text:
        return ParsedReply(content=text.strip(), calls=[])
    calls = []
    for closed, open_ended in _CALL.findall(text):
        block = closed if closed else open_ended
        if not closed:
            return ParsedReply(content=text, calls=[], error="a <tool_call> block is not closed")
        match = _FUNCTION.match(block)
        if match is None or not match.group("name").strip():
            return ParsedReply(content=text, calls=[], error="a <tool_call> block is not a <function=NAME> block")
        body, arguments, at = match.group("body"), {}, 0
        for parameter in _PARAMETER.finditer(body):
            if body[at:parameter.start()].strip() or not parameter.group("name").strip():
                return ParsedReply(content=text, calls=[],
                                   error="a <function> block holds something other than <parameter> blocks")
            value = parameter.group("value").strip("\n")
            try:
                arguments[parameter.group("name").strip()] = json.loads(value)
            except (ValueError, RecursionError):
                arguments[parameter.group("name").strip()] = value
            at = parameter.end()
        if body[at:].strip():
            return ParsedReply(content=text, calls=[],
                               error="a <function> block holds something other than <parameter> blocks")
        calls.append(FunctionCall(name=match.group("name").strip(),
                                  arguments=json.dumps(arguments, ensure_ascii=False)))
    return ParsedReply(content=text[:text.find("<tool_call>")].strip(), calls=calls)


def _format_call(call: FunctionCall) -> str:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    lines = [f"<tool_call>\n<function={call.name}>"]
    for name, value in arguments.items():
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines.append(f"<parameter={name}>\n{shown}\n</parameter>")
    lines.append("</function>\n</tool_call>")
    return "\n".join(lines)


class EmbeddedTokenizer:
    """A Hugging Face-style ``encode``/``decode`` over a tokenizer embedded in ``tml-renderers`` (Qwen3's, Qwen3.5's):
    special-token text encodes as the special token, as ``AutoTokenizer.encode(text, add_special_tokens=False)``
    does. Offline; the same vocabulary as the Hub's files (its ordinary-text encoding was not compared with the Hub
    tokenizer here: no Hub)."""

    def __init__(self, tok: Any):
        self.tok = tok
        specials = sorted(tok.all_special_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
        self._specials = set(specials)
        self.eos_token_id = tok.encode_special("<|im_end|>")
        self.name_or_path = type(tok).__name__

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        if split_special_tokens:
            return list(self.tok.encode_ordinary(text))
        ids: list[int] = []
        for part in self._split.split(text):
            if part:
                ids += [self.tok.encode_special(part)] if part in self._specials else self.tok.encode_ordinary(part)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.tok.decode(list(ids))
        return self._split.sub("", text) if skip_special_tokens else text

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.tok.encode_special(token)


@lru_cache(maxsize=2)
def embedded_tokenizer(format: Format) -> EmbeddedTokenizer:
    """Qwen3.5's (``qwen3_5``) or Qwen3's (``hermes``) tokenizer from ``tml-renderers`` (loads in seconds)."""
    import tml_renderers

    kinds = tml_renderers.tokenizers
    return EmbeddedTokenizer(kinds.Qwen35Tokenizer() if format == "qwen3_5" else kinds.Qwen3Tokenizer())


def local_chat() -> ChatTokens:
    """The local model's tokenizer and chat format, as the local server serves it (no weights loaded); without that
    server installed, :class:`~aitrainsai_outer_tinker.local.LocalServerMissing` naming it."""
    return local.server().local_chat()


def renderer(format: Format, tokenizer: Any, *, local: bool = False) -> Renderer:
    """The renderer of ``format`` over ``tokenizer`` (``local``: the local model's own ChatML, with its default
    system message)."""
    if format == "qwen3_5":
        return Qwen35Renderer(tokenizer)
    if local:
        return HermesRenderer(local_chat())
    return HermesRenderer(ChatTokens(tokenizer, QWEN3_INSTRUCT))


def policy_renderer(base_model: str, format: Format, tokenizer: Literal["service", "tml-renderers"],
                    training: Any = None) -> Renderer:
    """The renderer the policy on ``base_model`` speaks ``format`` with (the trainer's and its warm start's): over
    the local model's own tokenizer, the copy embedded in ``tml-renderers``, or the service's (``training``'s, a
    ``tinker.TrainingClient``; None renders offline only)."""
    local = base_model == LOCAL_BASE_MODEL
    if local and format == "hermes":
        return renderer("hermes", None, local=True)
    if local:
        chosen = local_chat().tokenizer
    elif tokenizer == "tml-renderers":
        chosen = embedded_tokenizer(format)
    else:
        chosen = training.get_tokenizer()
    return renderer(format, chosen)


def stop_tokens(chat: Renderer | ChatTokens) -> list[int]:
    """The tokens that end a reply: the end of turn (and the tokenizer's end of sequence, where it differs)."""
    stops = [chat.end_of_turn_id] if chat.end_of_turn_id is not None else []
    eos = getattr(chat.tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in stops:
        stops.append(eos)
    if not stops:
        raise ValueError("the tokenizer has no single end-of-turn token to stop sampling on")
    return stops
