"""Batched token generation with a KV cache kept across the turns of multi-turn conversations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aitrainsai_trainer_local.llama import FastLlama, KVCache, left_pad


class Sampler:
    """Generates for a batch of rows, turn after turn, feeding each turn only the tokens the cache lacks.

    Rows are the conversations still running; :meth:`generate` takes, per row, the tokens to append before sampling
    (the prompt on the first turn; afterwards the last sampled token and what the chat template puts between turns)
    and which of the previous rows they continue. Identical first-turn prompts (a GRPO group) are prefilled once.
    ``temperature == 0`` is greedy. Sampling uses ``generator`` (CPU), so a seed fixes every draw.
    """

    def __init__(self, model: FastLlama, stop_ids: Sequence[int], pad_id: int):
        self.model = model
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=model.device)
        self.pad_id = pad_id
        self.cache: KVCache | None = None
        self.generated_tokens = 0  # sampled tokens, all rows and turns

    @torch.no_grad()
    def generate(self, pending: Sequence[Sequence[int]], rows: Sequence[int] | None, max_new_tokens: int,
                 temperature: float, generator: torch.Generator) -> list[list[int]]:
        """Append ``pending[i]`` to previous row ``rows[i]`` (``rows`` is None on the first turn) and sample up to
        ``max_new_tokens`` for each row; a row stops after a stop token. Returns the sampled tokens per row (the stop
        token included when one was sampled)."""
        model, device = self.model, self.model.device
        if any(not tokens for tokens in pending):
            raise ValueError("every row needs at least one new token")
        if rows is None or self.cache is None:
            unique: dict[tuple[int, ...], int] = {}
            inverse = [unique.setdefault(tuple(tokens), len(unique)) for tokens in pending]
            self.cache, hidden = model.prefill(list(unique), self.pad_id, inplace=True)
            index = torch.tensor(inverse, device=device)
            self.cache.select(index)
            hidden = hidden.index_select(0, index)
        else:
            self.cache.select(torch.tensor(list(rows), device=device))
            ids, valid = left_pad(pending, self.pad_id, device)
            hidden = model.forward(ids, valid, self.cache)[:, -1]
        self.cache.reserve(max_new_tokens)
        n = len(pending)
        out = torch.full((n, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        lengths = torch.zeros(n, dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            token = self._pick(model.logits(hidden), temperature, generator)
            token = torch.where(finished, self.pad_id, token)
            out[:, step] = token
            lengths += (~finished).long()
            finished |= torch.isin(token, self.stop_ids)
            if step + 1 == max_new_tokens or bool(finished.all()):
                break
            hidden = model.forward(token[:, None], ~finished[:, None], self.cache)[:, -1]
        self.generated_tokens += int(lengths.sum())
        return [row[:length].tolist() for row, length in zip(out.cpu(), lengths.cpu().tolist())]

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        # Inverse-CDF sampling: one uniform per row (torch.multinomial draws one per vocabulary entry, ~50 ms a
        # step for 32 x 49k on two cores).
        cdf = torch.softmax(logits if temperature == 1.0 else logits / temperature, -1).cumsum(-1)  # x / 1 is x
        uniform = torch.rand(logits.shape[0], 1, generator=generator).to(logits.device)
        token = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0]
        return token.clamp_max(logits.shape[-1] - 1)
