"""Multi-turn rollouts with tool calls, batched: the transcript as OpenAI messages and the tokens training needs.

Tool calls use the Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, parsed the way
vLLM's ``hermes`` parser (which prime-rl uses) parses them: any block that is not a JSON object with ``name`` and
``arguments`` makes the whole reply plain text. The model sees the tool schemas and the format through its chat
template when the template takes ``tools``, else in the system message (Qwen2.5's wording); tool results go back as
tool messages, rendered as ``<tool_response>`` blocks in a user turn when the template has no tool role.

Tokens are kept, not re-tokenised: a conversation's token ids are its prompt, then each reply exactly as sampled,
then the template's tokens between turns; ``completion_mask`` selects the sampled ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from aitrainsai.families import Item, Message, TaskFamily
from aitrainsai.tools import call_tool
from aitrainsai_trainer_local.policy import Policy
from aitrainsai_trainer_local.sampling import Sampler

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
_PLACEHOLDER = "\x00reply\x00"


@dataclass
class Conversation:
    """Where a rollout starts: the messages (system + user), the tools bound to the item, their schemas. A
    conversation whose tools live elsewhere (a sandboxed job environment) gives ``run_tool(name, arguments)``, which
    answers each call with its result text, instead of ``tools``."""

    messages: list[Message]
    tools: Mapping[str, Callable] = field(default_factory=dict)
    tool_schemas: list[dict] = field(default_factory=list)
    turn_limit: int = 1
    run_tool: Callable[[str, str], str] | None = None


def family_conversation(family: TaskFamily, item: Item, turn_limit: int | None = None) -> Conversation:
    """How a family's eval starts on ``item``: its messages, the tools bound to the item, the family's turn limit."""
    return Conversation(family.initial_messages(item), family.tools(item), family.tool_schemas(),
                        turn_limit or family.turn_limit)


@dataclass
class Rollout:
    """One finished conversation."""

    messages: list[Message]  # the starting messages, then assistant (with tool_calls) and tool messages
    prompt_ids: list[int]  # the rendered starting messages and the generation prompt
    completion_ids: list[int]  # everything after the prompt: replies as sampled and the tokens between turns
    completion_mask: list[int]  # 1 for sampled tokens
    turn_ids: list[list[int]]  # each reply's sampled tokens
    truncated: bool = False  # the last reply stopped at max_new_tokens

    @property
    def transcript(self) -> list[Message]:
        return self.messages

    @property
    def turns(self) -> int:
        return len(self.turn_ids)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of a reply: content is the text before the first ``<tool_call>``; each call is
    ``{"name": ..., "arguments": <JSON string>}``. A reply with no valid calls is all content."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for closed, open_ended in TOOL_CALL.findall(text):
        try:
            call = json.loads(closed or open_ended)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return text, []
        calls.append({"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)})
    return text[:text.find("<tool_call>")], calls


class ChatFormat:
    """Renders conversations with a tokenizer's chat template, adding tools where the template lacks them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template
        self.end_of_turn = tokenizer.eos_token
        self.end_of_turn_id = tokenizer.eos_token_id
        self._bridges: dict[tuple, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: Sequence[Message], tool_schemas: Sequence[dict] = (), *,
               add_generation_prompt: bool = False) -> str:
        messages = [dict(m) for m in messages]
        if self.native_tools:
            return self.tokenizer.apply_chat_template(messages, tools=list(tool_schemas) or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        if tool_schemas:
            listing = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in tool_schemas)
            prompt = TOOLS_PROMPT.format(tools=listing)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        return self.tokenizer.apply_chat_template(_tool_results_as_user(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Message], tool_schemas: Sequence[dict] = ()) -> list[int]:
        return self.encode(self.render(messages, tool_schemas, add_generation_prompt=True))

    def bridge_ids(self, tool_messages: Sequence[Message], reply_ended: bool) -> list[int]:
        """The template's tokens after a reply: its end of turn (unless the reply sampled it, ``reply_ended``), the
        tool messages, and the next generation prompt. Found by rendering with and without them."""
        contents = tuple((m.get("name"), m["content"]) for m in tool_messages)
        key = (contents, reply_ended)
        if key not in self._bridges:
            head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER}]
            before = self.render(head)
            after = self.render(head + [dict(m) for m in tool_messages], add_generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat template renders earlier messages differently once tool messages follow")
            tail = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
            if reply_ended and tail.startswith(self.end_of_turn):
                tail = tail[len(self.end_of_turn):]
            self._bridges[key] = self.encode(tail + after[len(before):])
        return list(self._bridges[key])


def _tool_results_as_user(messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        if message.get("role") != "tool":
            out.append({"role": message["role"], "content": message.get("content") or ""})
            continue
        block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        if out and out[-1].get("_tool"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "_tool": True})
    for message in out:
        message.pop("_tool", None)
    return out


@dataclass
class _State:
    conversation: Conversation
    messages: list[Message]
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    turn_ids: list[list[int]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    truncated: bool = False
    calls: int = 0


def rollout(policy: Policy, conversations: Sequence[Conversation], *, max_new_tokens: int, temperature: float,
            seed: int = 0, sampler: Sampler | None = None) -> list[Rollout]:
    """Run every conversation to its end in one batch: a reply without a tool call ends it, and so does the
    ``turn_limit``-th reply (its calls are not run). ``temperature == 0`` is greedy. Pass ``sampler`` to reuse one
    built from the current weights (it carries its own token count)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    chat = ChatFormat(policy.tokenizer)
    sampler = sampler or Sampler(policy.inference_model(), policy.stop_ids, policy.pad_id)
    generator = torch.Generator().manual_seed(seed)
    states = []
    for conversation in conversations:
        if conversation.turn_limit < 1:
            raise ValueError("turn_limit must be at least 1")
        prompt = chat.prompt_ids(conversation.messages, conversation.tool_schemas)
        states.append(_State(conversation, [dict(m) for m in conversation.messages], prompt, pending=list(prompt)))
    active = list(range(len(states)))
    rows: list[int] | None = None
    stop_ids = set(policy.stop_ids)
    while active:
        replies = sampler.generate([states[i].pending for i in active], rows, max_new_tokens, temperature, generator)
        next_active, next_rows = [], []
        for row, (index, reply) in enumerate(zip(active, replies)):
            state = states[index]
            state.completion_ids += reply
            state.completion_mask += [1] * len(reply)
            state.turn_ids.append(list(reply))
            ended = bool(reply) and reply[-1] in stop_ids
            state.truncated = not ended
            text_ids = reply[:-1] if ended else reply
            text = policy.tokenizer.decode(text_ids, skip_special_tokens=True)
            content, calls = parse_tool_calls(text)
            message: Message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{state.calls + k}", "type": "function", "function": call}
                    for k, call in enumerate(calls)]
            state.messages.append(message)
            if not calls or len(state.turn_ids) >= state.conversation.turn_limit:
                continue
            tools = state.conversation.tools
            tools = tools if isinstance(tools, dict) else dict(tools)
            run_tool = state.conversation.run_tool or (lambda name, arguments: call_tool(tools, name, arguments))
            tool_messages = []
            for tool_call in message["tool_calls"]:
                name, arguments = tool_call["function"]["name"], tool_call["function"]["arguments"]
                result = run_tool(name, arguments)
                tool_messages.append({"role": "tool", "tool_call_id": tool_call["id"], "name": str(name),
                                      "content": result})
            state.calls += len(calls)
            state.messages += tool_messages
            bridge = chat.bridge_ids(tool_messages, reply_ended=ended and reply[-1] == chat.end_of_turn_id)
            state.completion_ids += bridge
            state.completion_mask += [0] * len(bridge)
            # The cache lacks the reply's last sampled token (never fed back) and the bridge.
            state.pending = reply[-1:] + bridge
            next_active.append(index)
            next_rows.append(row)
        active, rows = next_active, next_rows
    return [Rollout(s.messages, s.prompt_ids, s.completion_ids, s.completion_mask, s.turn_ids, s.truncated)
            for s in states]
