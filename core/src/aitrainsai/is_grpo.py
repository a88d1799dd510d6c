"""Group-relative advantages and importance-sampling datums, shared by every outer trainer that learns from tokens.

The datum layout and the loss are Tinker's ``importance_sampling`` definitions: for a sequence ``tokens`` (prompt then
completion), ``model_input = tokens[:-1]`` and ``target_tokens = tokens[1:]``; ``logprobs`` holds the sampler's
log-probability of each target token and ``advantages`` the advantage, both 0 where the target is a prompt token
(zero advantage is the mask). The loss is a sum, not a mean::

    loss = -sum_i exp(trainer_logprob_i - sampler_logprob_i) * advantage_i
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Each reward minus its group's mean, divided by the group's standard deviation (population) + ``eps``."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def has_signal(rewards: Sequence[float], tolerance: float = 1e-9) -> bool:
    """False for a group whose rewards are all equal: its advantages are all zero and it teaches nothing."""
    return bool(rewards) and max(rewards) - min(rewards) > tolerance


@dataclass(frozen=True)
class Datum:
    model_input: list[int]
    target_tokens: list[int]
    logprobs: list[float]
    advantages: list[float]

    def __post_init__(self) -> None:
        n = len(self.model_input)
        if not (len(self.target_tokens) == len(self.logprobs) == len(self.advantages) == n):
            raise ValueError("model_input, target_tokens, logprobs and advantages must have the same length")


def build_datum(prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
                completion_logprobs: Sequence[float], advantage: float) -> Datum:
    """The datum for one sampled completion: prompt positions carry logprob 0 and advantage 0."""
    if len(completion_tokens) != len(completion_logprobs):
        raise ValueError(f"{len(completion_tokens)} completion tokens but {len(completion_logprobs)} log-probs")
    if not prompt_tokens:
        raise ValueError("a datum needs at least one prompt token")
    tokens = list(prompt_tokens) + list(completion_tokens)
    masked = len(prompt_tokens) - 1  # targets 0..masked-1 are prompt tokens
    return Datum(model_input=tokens[:-1], target_tokens=tokens[1:],
                 logprobs=[0.0] * masked + [float(x) for x in completion_logprobs],
                 advantages=[0.0] * masked + [float(advantage)] * len(completion_tokens))


def importance_sampling_loss(datums: Sequence[Datum], trainer_logprobs: Sequence[Sequence[float]]) -> float:
    """The loss of a batch given the trainer's log-probs of each datum's targets (reference implementation)."""
    total = 0.0
    for datum, current in zip(datums, trainer_logprobs, strict=True):
        if len(current) != len(datum.target_tokens):
            raise ValueError("trainer log-probs must align with target_tokens")
        for new, old, advantage in zip(current, datum.logprobs, datum.advantages):
            if advantage:
                total -= math.exp(new - old) * advantage
    return total


def staleness(current_version: int, sampled_version: int) -> int:
    """How many policy updates happened since a sample was drawn."""
    return current_version - sampled_version


class TokenTurn(Protocol):
    """What :func:`episode_datums` reads of a turn (an :class:`aitrainsai.trainers.AgentTurn` has it)."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]


def episode_datums(turns: Sequence[TokenTurn], advantage: float) -> list[Datum]:
    """One episode as the fewest sequences: each turn's prompt that extends the sequence so far (the previous prompt
    and reply as a token prefix) continues it, its new tokens (what the environment said) masked with advantage 0;
    a prompt that does not extend it (the conversation was re-rendered differently, or cut) starts a new sequence.
    Every reply token carries ``advantage`` and its sampler log-prob. Turns without tokens are skipped. This is the
    Tinker cookbook's layout for multi-turn episodes: no datum repeats a whole earlier prompt."""
    datums: list[Datum] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    advantages: list[float] = []

    def flush() -> None:
        if len(tokens) > 1:
            datums.append(Datum(model_input=tokens[:-1], target_tokens=tokens[1:], logprobs=logprobs[1:],
                                advantages=advantages[1:]))

    for turn in turns:
        prompt, completion = list(turn.prompt_tokens), list(turn.completion_tokens)
        if len(completion) != len(turn.logprobs):
            raise ValueError(f"{len(completion)} completion tokens but {len(turn.logprobs)} log-probs")
        if not prompt or not completion:
            continue
        if tokens and prompt[:len(tokens)] == tokens:
            new = prompt[len(tokens):]
        else:
            flush()
            tokens, logprobs, advantages = [], [], []
            new = prompt
        tokens += new + completion
        logprobs += [0.0] * len(new) + [float(x) for x in turn.logprobs]
        advantages += [0.0] * len(new) + [float(advantage)] * len(completion)
    flush()
    return datums
