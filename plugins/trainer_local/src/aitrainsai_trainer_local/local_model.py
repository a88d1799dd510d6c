"""The local model runtime as a public API: SmolLM2-135M-Instruct with a LoRA adapter, its chat format, sampling and
log-probabilities. Other plugins (the tinker plugin's local server) build on this module only; the rest of this
package (policy, sampling, llama, rollout) is internal and may change.

    model = LocalModel.create(lora_rank=8, lora_alpha=16.0)
    prompt = model.chat.prompt_ids(messages, tool_schemas)
    reply = model.generate(prompt, max_new_tokens=64, temperature=1.0, generator=torch.Generator())
    logprobs = model.logprobs(prompt, reply, temperature=1.0, grad=True)  # a tensor, differentiable in the adapter
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

import torch

from aitrainsai import ChatTokens
from aitrainsai_trainer_local.llama import PROJECTIONS, FastLlama, left_pad, selected_logprobs
from aitrainsai_trainer_local.model import BASE_MODEL, CHAT, DType
from aitrainsai_trainer_local.lora import LoraSettings, LoraModel
from aitrainsai_trainer_local.sampling import Sampler

__all__ = ["BASE_MODEL", "PROJECTIONS", "LocalModel", "LocalSampler", "load_chat"]


class LocalModel:
    """The base model with a trainable LoRA adapter."""

    base_model = BASE_MODEL

    def __init__(self, policy: LoraModel):
        self._policy = policy
        self.chat = ChatTokens(policy.tokenizer, CHAT)

    @classmethod
    def create(cls, *, lora_rank: int, lora_alpha: float, dtype: DType = "auto", seed: int = 0,
               target_modules: Sequence[str] | None = None, device: str | None = None) -> LocalModel:
        """A fresh adapter (it starts as the base model); ``target_modules`` picks the projections that get LoRA
        (default: all of :data:`PROJECTIONS`)."""
        targets = tuple(target_modules) if target_modules is not None else PROJECTIONS
        return cls(LoraModel.load(lora=LoraSettings(lora_rank, lora_alpha, targets), dtype=dtype, seed=seed,
                               device=device))

    @classmethod
    def load(cls, adapter: Path | str, *, dtype: DType = "auto") -> LocalModel:
        """The adapter :meth:`save` wrote, trainable."""
        return cls(LoraModel.load(adapter=adapter, trainable=True, dtype=dtype))

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

    def token_logprobs(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                       grad: bool) -> list[torch.Tensor]:
        """Per row ``(inputs, targets)`` of equal length: the log-probability of ``targets[i]`` after
        ``inputs[: i + 1]`` under the current (unmerged) weights, as float32 tensors; one batched forward pass,
        differentiable in the adapter when ``grad`` (else detached on the CPU)."""
        fast, pad = self._policy.fast, self._policy.pad_id
        inputs = [list(i) for i, _ in rows]
        if any(not row or len(row) != len(t) for row, (_, t) in zip(inputs, rows)):
            raise ValueError("every row needs as many targets as input tokens, at least one")
        with torch.set_grad_enabled(grad):
            ids, valid = left_pad(inputs, pad, fast.device)
            hidden = fast.forward(ids, valid, fast.new_cache(len(inputs), inplace=False))
            targets = torch.tensor([t for _, row in rows for t in row], dtype=torch.long, device=fast.device)
            values = selected_logprobs(hidden[valid], fast.lm_head, targets).float()
        pieces = values.split([len(row) for row in inputs])
        return list(pieces) if grad else [p.detach().cpu() for p in pieces]

    def adapter_state(self) -> list[torch.Tensor]:
        """A copy of the adapter's parameters (CPU, in :meth:`parameters` order)."""
        return [p.detach().to("cpu", copy=True) for p in self.parameters()]

    def load_adapter_state(self, state: Sequence[torch.Tensor]) -> None:
        """Overwrite the adapter's parameters in place with ``state`` (from :meth:`adapter_state`)."""
        params = self.parameters()
        if len(state) != len(params) or any(s.shape != p.shape for s, p in zip(state, params)):
            raise ValueError("the adapter state does not fit this model's adapter (rank or projections differ)")
        with torch.no_grad():
            for param, value in zip(params, state):
                param.copy_(value)

    def reset_adapter(self, seed: int) -> None:
        """A fresh adapter as ``peft`` initialises one (A Kaiming-uniform from ``seed``, B zero)."""
        device = self._policy.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for module in self._policy.model.modules():
                if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                    for name in module.lora_A:
                        module.reset_lora_parameters(name, True)

    @property
    def tokenizer(self):
        return self._policy.tokenizer

    @property
    def device(self) -> torch.device:
        return self._policy.device

    @staticmethod
    def tokenizer_dir() -> Path:
        """The local folder holding the base model's tokenizer (``AutoTokenizer.from_pretrained`` reads it)."""
        from aitrainsai_trainer_local.model import converted_checkpoint

        return converted_checkpoint()

    @staticmethod
    def max_context_length() -> int:
        return _max_positions()

    def sampler(self, *, merge: bool = True) -> LocalSampler:
        """A sampler over the current weights; it keeps them when the adapter trains on. ``merge``: LoRA folded
        into the weights (fastest); else a copy of the adapter applied as :meth:`token_logprobs` applies it, so its
        log-probs match training's also in bf16, where merging rounds small LoRA updates away."""
        policy = self._policy
        model = policy.inference_model() if merge else policy.fast.frozen()
        return LocalSampler(model, policy.stop_ids, policy.pad_id)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the forward (the adapter's parameters stay float32)."""
        return self._policy.dtype


class LocalSampler:
    """Generation and log-probabilities over frozen merged weights (one policy version)."""

    def __init__(self, model: FastLlama, stop_ids: Sequence[int], pad_id: int):
        self._model, self.stop_ids, self._pad = model, list(stop_ids), pad_id

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], *, num_samples: int, max_new_tokens: int, temperature: float,
                 stop_ids: Sequence[int], generator: torch.Generator,
                 stop_check=None) -> list[tuple[list[int], list[float], bool]]:
        """``num_samples`` continuations of ``prompt``: per sample the tokens, the log-probability of each under
        the distribution it was drawn from (softmax of logits / ``temperature``; temperature 0 is greedy and
        reports temperature-1 log-probs), and whether it stopped (a token of ``stop_ids``, or
        ``stop_check(tokens)`` true; the stopping token is kept). Draws come from ``generator`` (CPU), so a seed
        fixes them."""
        model, device = self._model, self._model.device
        # bf16 (measured on CPU): a batch of one row runs other matmul kernels than the batched forward of training,
        # whose roundings put its log-probs up to ~0.1 off training's; a spare copy of row 0 keeps the batch at two
        spare = 1 if num_samples == 1 and model.dtype == torch.bfloat16 else 0
        cache, hidden = model.prefill([list(prompt)], self._pad, inplace=True)
        rows = torch.zeros(num_samples + spare, dtype=torch.long, device=device)
        cache.select(rows)
        hidden = hidden.index_select(0, rows)
        cache.reserve(max_new_tokens)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        logprobs: list[list[float]] = [[] for _ in range(num_samples)]
        stopped = [False] * num_samples
        for step in range(max_new_tokens):
            logits = model.logits(hidden)
            scaled = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
            if temperature > 0:
                cdf = scaled.exp().cumsum(-1)
                uniform = torch.rand(num_samples, 1, generator=generator).to(device)
                uniform = torch.cat([uniform, uniform[:spare]])
                token = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
            else:
                token = logits.argmax(-1)
            chosen = scaled.gather(1, token[:, None])[:, 0].cpu().tolist()
            ids = token.cpu().tolist()
            is_stop = torch.isin(token, stops).cpu().tolist() if len(stops) else [False] * num_samples
            for i in range(num_samples):
                if stopped[i]:
                    continue
                tokens[i].append(ids[i])
                logprobs[i].append(chosen[i])
                if is_stop[i] or (stop_check is not None and stop_check(tokens[i])):
                    stopped[i] = True
            if all(stopped) or step + 1 == max_new_tokens:
                break
            done = torch.tensor(stopped + stopped[:spare], device=device)
            token = torch.where(done, self._pad, token)
            hidden = model.forward(token[:, None], ~done[:, None], cache)[:, -1]
        return [(t, lp, s) for t, lp, s in zip(tokens, logprobs, stopped)]

    @torch.no_grad()
    def prompt_logprobs(self, tokens: Sequence[int]) -> list[float]:
        """The log-probability of each token after the ones before it (``len(tokens) - 1`` values)."""
        model = self._model
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
        hidden = model.forward(ids, torch.ones_like(ids, dtype=torch.bool), model.new_cache(1, inplace=True))
        if ids.shape[1] < 2:
            return []
        return selected_logprobs(hidden[0, :-1], model.lm_head, ids[0, 1:]).float().cpu().tolist()


def _max_positions() -> int:
    import json

    from aitrainsai_trainer_local.model import converted_checkpoint

    config = json.loads((converted_checkpoint() / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def load_chat() -> ChatTokens:
    """The base model's tokenizer with its chat format (``LocalModel.chat``), without loading the weights."""
    from transformers import AutoTokenizer

    from aitrainsai_trainer_local.model import converted_checkpoint

    return ChatTokens(AutoTokenizer.from_pretrained(converted_checkpoint()), CHAT)
