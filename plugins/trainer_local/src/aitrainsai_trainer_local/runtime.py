"""The local model runtime as a public API: SmolLM2-135M-Instruct with a LoRA adapter, its chat format, sampling and
log-probabilities. Other plugins (the ``local-lm`` outer trainer) build on this module only; the rest of this
package (policy, sampling, llama, rollout) is internal and may change.

    model = LocalModel.create(lora_rank=8, lora_alpha=16.0)
    prompt = model.chat.prompt_ids(messages, tool_schemas)
    reply = model.generate(prompt, max_new_tokens=64, temperature=1.0, generator=torch.Generator())
    logprobs = model.logprobs(prompt, reply, temperature=1.0, grad=True)  # a tensor, differentiable in the adapter
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from aitrainsai.chat import ChatTokens
from aitrainsai_trainer_local.llama import selected_logprobs
from aitrainsai_trainer_local.model import BASE_MODEL, CHAT, DType
from aitrainsai_trainer_local.policy import LoraSettings, Policy
from aitrainsai_trainer_local.sampling import Sampler

__all__ = ["BASE_MODEL", "LocalModel"]


class LocalModel:
    """The base model with a trainable LoRA adapter."""

    base_model = BASE_MODEL

    def __init__(self, policy: Policy):
        self._policy = policy
        self.chat = ChatTokens(policy.tokenizer, CHAT)

    @classmethod
    def create(cls, *, lora_rank: int, lora_alpha: float, dtype: DType = "auto", seed: int = 0) -> "LocalModel":
        """A fresh adapter (it starts as the base model)."""
        return cls(Policy.load(lora=LoraSettings(lora_rank, lora_alpha), dtype=dtype, seed=seed))

    @classmethod
    def load(cls, adapter: Path | str, *, dtype: DType = "auto") -> "LocalModel":
        """The adapter :meth:`save` wrote, trainable."""
        return cls(Policy.load(adapter=adapter, trainable=True, dtype=dtype))

    def save(self, adapter: Path | str) -> None:
        self._policy.save_adapter(adapter)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters (what an optimiser steps)."""
        return self._policy.trainable_parameters()

    def decode(self, ids: Sequence[int]) -> str:
        return self._policy.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def stop_ids(self) -> list[int]:
        return self._policy.stop_ids

    def generate(self, prompt: Sequence[int], *, max_new_tokens: int, temperature: float,
                 generator: torch.Generator) -> list[int]:
        """One reply to ``prompt`` with the current weights (the stop token included when one was sampled);
        ``temperature == 0`` is greedy."""
        policy = self._policy
        sampler = Sampler(policy.inference_model(), policy.stop_ids, policy.pad_id)
        (reply,) = sampler.generate([list(prompt)], None, max_new_tokens, temperature, generator)
        return reply

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int], *, temperature: float,
                 grad: bool) -> torch.Tensor:
        """Log-probabilities of each ``completion`` token after ``prompt`` under the current weights: float32, on
        the model's device with a graph when ``grad``, else detached on the CPU."""
        fast = self._policy.fast
        with torch.set_grad_enabled(grad):
            cache, prompt_last = fast.prefill([list(prompt)], self._policy.pad_id, inplace=False)
            ids = torch.tensor([list(completion)], dtype=torch.long, device=self._policy.device)
            valid = torch.ones_like(ids, dtype=torch.bool)
            hidden = fast.forward(ids, valid, cache)
            before = torch.cat([prompt_last[:, None], hidden[:, :-1]], 1)[0]
            values = selected_logprobs(before, fast.lm_head, ids[0], temperature)
        return values.float() if grad else values.detach().float().cpu()
