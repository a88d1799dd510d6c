"""Greedy evaluation of a local policy with a family's own prompts, tools, turn limit and scorer: the core's hidden
eval (:mod:`aitrainsai.evaluation`) through this trainer's engine (:class:`LocalChatEngine`)."""

from __future__ import annotations

from collections.abc import Sequence

from aitrainsai import Item, Message, TaskFamily, evaluate_items, paired_bootstrap
from aitrainsai_trainer_local.engine import LocalChatEngine
from aitrainsai_trainer_local.lora import LoraModel

__all__ = ["evaluate", "evaluate_with_transcripts", "paired_bootstrap"]


def evaluate(policy: LoraModel, family: TaskFamily, items: Sequence[Item], *, max_new_tokens: int = 128,
             batch_size: int = 32, turn_limit: int | None = None) -> list[float]:
    """``family.score(item, transcript)`` for each item, after a greedy conversation with the family's system prompt,
    tools and turn limit (or ``turn_limit``). Items run in fixed batches, so the same weights score the same."""
    scores, _ = evaluate_with_transcripts(policy, family, items, max_new_tokens=max_new_tokens,
                                          batch_size=batch_size, turn_limit=turn_limit)
    return scores


def evaluate_with_transcripts(policy: LoraModel, family: TaskFamily, items: Sequence[Item], *,
                              max_new_tokens: int = 128, batch_size: int = 32, turn_limit: int | None = None
                              ) -> tuple[list[float], list[list[Message]]]:
    """As :func:`evaluate`, also returning each item's transcript."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    engine = LocalChatEngine(policy, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return evaluate_items(family, items, engine, turn_limit=turn_limit)
