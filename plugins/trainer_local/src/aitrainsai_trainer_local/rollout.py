"""Multi-turn rollouts with tool calls, batched: the transcript as OpenAI messages and the tokens training needs.

Rendering and tool-call parsing are :mod:`aitrainsai.chat`'s (ChatML with Hermes tool calls, SmolLM2's default
system message): the tool schemas go in the system message, tool results come back as ``<tool_response>`` blocks in a
user turn, and a reply with any malformed ``<tool_call>`` block is plain text.

Tokens are kept, not re-tokenised: a conversation's token ids are its prompt, then each reply exactly as sampled,
then the template's tokens between turns; ``completion_mask`` selects the sampled ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from aitrainsai import ChatTokens, Item, Message, TaskFamily, call_tool, parse_tool_calls
from aitrainsai_trainer_local.model import CHAT
from aitrainsai_trainer_local.lora import LoraModel
from aitrainsai_trainer_local.sampling import Sampler


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


def rollout(policy: LoraModel, conversations: Sequence[Conversation], *, max_new_tokens: int, temperature: float,
            seed: int = 0, sampler: Sampler | None = None) -> list[Rollout]:
    """Run every conversation to its end in one batch: a reply without a tool call ends it, and so does the
    ``turn_limit``-th reply (its calls are not run). ``temperature == 0`` is greedy. Pass ``sampler`` to reuse one
    built from the current weights (it carries its own token count)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    chat = ChatTokens(policy.tokenizer, CHAT)
    sampler = sampler or Sampler(policy.inference_model(), policy.stop_ids, policy.pad_id)
    generator = torch.Generator().manual_seed(seed)
    states = []
    for conversation in conversations:
        if conversation.turn_limit < 1:
            raise ValueError("turn_limit must be at least 1")
        prompt = chat.prompt_ids(conversation.messages, conversation.tool_schemas)
        states.append(_State(conversation, [m.copy() for m in conversation.messages], prompt, pending=list(prompt)))
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
            run_tool = state.conversation.run_tool or partial(call_tool, tools)
            tool_messages: list[Message] = []
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
