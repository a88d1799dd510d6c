"""Greedy, batched evaluation with a family's own scorer, and a paired bootstrap interval for the uplift."""

from __future__ import annotations

from typing import Sequence

import torch

from aitrainsai.families import Item, TaskFamily
from aitrainsai_trainer_local.policy import Policy
from aitrainsai_trainer_local.rollout import Rollout, family_conversation, rollout
from aitrainsai_trainer_local.sampling import Sampler


def evaluate(policy: Policy, family: TaskFamily, items: Sequence[Item], *, max_new_tokens: int = 128,
             batch_size: int = 32, turn_limit: int | None = None) -> list[float]:
    """``family.score(item, transcript)`` for each item, after a greedy rollout with the family's system prompt,
    tools and turn limit (or ``turn_limit``). Items run in fixed batches, so the same weights score the same."""
    scores, _ = evaluate_with_transcripts(policy, family, items, max_new_tokens=max_new_tokens,
                                          batch_size=batch_size, turn_limit=turn_limit)
    return scores


def evaluate_with_transcripts(policy: Policy, family: TaskFamily, items: Sequence[Item], *, max_new_tokens: int = 128,
                              batch_size: int = 32, turn_limit: int | None = None
                              ) -> tuple[list[float], list[Rollout]]:
    """As :func:`evaluate`, also returning each item's rollout."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    model = policy.inference_model()
    scores: list[float] = []
    rollouts: list[Rollout] = []
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        conversations = [family_conversation(family, item, turn_limit) for item in batch]
        sampler = Sampler(model, policy.stop_ids, policy.pad_id)
        done = rollout(policy, conversations, max_new_tokens=max_new_tokens, temperature=0.0, sampler=sampler)
        rollouts += done
        scores += [float(family.score(item, r.transcript)) for item, r in zip(batch, done)]
    return scores, rollouts


def paired_bootstrap(pre_scores: Sequence[float], post_scores: Sequence[float], n: int = 10_000, seed: int = 0,
                     confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(post − pre), resampling items (pairs) with replacement."""
    if len(pre_scores) != len(post_scores):
        raise ValueError("pre and post scores must be paired: the same items in the same order")
    if not pre_scores:
        raise ValueError("no scores")
    diff = torch.tensor(post_scores, dtype=torch.float64) - torch.tensor(pre_scores, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, diff.numel(), (n, diff.numel()), generator=generator)
    means = diff[index].mean(1)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return float(low), float(high)
