"""The local trainer's chat engine for the core's hidden eval (:mod:`aitrainsai.evaluation`): greedy replies from a
:class:`~aitrainsai_trainer_local.lora.LoraModel`, the base model or an adapter on it.

Tokens are kept from turn to turn, as in training rollouts: a continued conversation is fed only its last sampled
token and the template's tokens between turns (never a re-tokenised transcript), through a KV cache kept for the
batch. So a conversation the core drives turn by turn gets exactly the tokens :func:`rollout` would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

import torch

from aitrainsai import ChatRequest, ChatTokens, EngineSpec, Message, parse_tool_calls
from aitrainsai_trainer_local.model import BASE_MODEL, CHAT
from aitrainsai_trainer_local.lora import LoraModel
from aitrainsai_trainer_local.llama import FastLlama
from aitrainsai_trainer_local.sampling import Sampler


@dataclass
class _Conversation:
    seen: int  # messages the engine has fed to the model (its own replies included)
    last: list[int] = field(default_factory=list)  # the last reply's sampled tokens
    ended_turn: bool = False  # the last reply sampled the end-of-turn token itself
    calls: int = 0


class LocalChatEngine:
    """Greedy replies, batch by batch; see the module docstring. ``spec`` names the settings that change a score."""

    def __init__(self, policy: LoraModel, *, max_new_tokens: int, batch_size: int):
        self.policy = policy
        self.chat = ChatTokens(policy.tokenizer, CHAT)
        self.spec = EngineSpec(engine="local", base_model=BASE_MODEL, dtype=str(policy.dtype).removeprefix("torch."),
                               max_new_tokens=max_new_tokens, batch_size=batch_size)
        self._model = policy.inference_model()
        self._stop = set(policy.stop_ids)
        self._sampler: Sampler | None = None
        self._conversations: dict[str, _Conversation] = {}
        self._rows: dict[str, int] = {}
        self._generator = torch.Generator().manual_seed(0)

    @property
    def model(self) -> FastLlama:
        """The forward it generates with (LoRA merged in); its counters say how much work the replies took."""
        return self._model

    def new_batch(self) -> None:
        self._sampler = Sampler(self._model, self.policy.stop_ids, self.policy.pad_id)
        self._conversations, self._rows = {}, {}

    def __call__(self, requests: Sequence[ChatRequest]) -> list[Message]:
        if self._sampler is None:
            self.new_batch()
        known = [request.key in self._conversations for request in requests]
        if any(known) and not all(known):
            raise ValueError("one call either starts conversations or continues them: call new_batch() between")
        if not any(known):
            pending = [self.chat.prompt_ids(r.messages, r.tools) for r in requests]
            rows = None
            for request in requests:
                self._conversations[request.key] = _Conversation(seen=len(request.messages))
        else:
            pending, rows = [], []
            for request in requests:
                state = self._conversations[request.key]
                following = request.messages[state.seen:]
                bridge = self.chat.bridge_ids(following, reply_ended=state.ended_turn)
                pending.append(state.last[-1:] + bridge)  # the cache lacks the last sampled token and the bridge
                rows.append(self._rows[request.key])
                state.seen = len(request.messages)
        assert self._sampler is not None  # new_batch() made one
        replies = self._sampler.generate(pending, rows, self.spec.max_new_tokens, 0.0, self._generator)
        self._rows = {request.key: row for row, request in enumerate(requests)}
        messages = []
        for request, reply in zip(requests, replies):
            state = self._conversations[request.key]
            ended = bool(reply) and reply[-1] in self._stop
            text = self.policy.tokenizer.decode(reply[:-1] if ended else reply, skip_special_tokens=True)
            content, calls = parse_tool_calls(text)
            message: Message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": f"call_{state.calls + k}", "type": "function", "function": call}
                                         for k, call in enumerate(calls)]
                state.calls += len(calls)
            state.last = list(reply)
            state.ended_turn = ended and reply[-1] == self.chat.end_of_turn_id
            state.seen += 1  # its own reply
            messages.append(message)
        return messages
