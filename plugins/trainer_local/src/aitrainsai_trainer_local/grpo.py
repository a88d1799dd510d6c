"""GRPO with LoRA: group-relative advantages, one on-policy policy-gradient step per batch, AdamW.

Each step samples ``group_size`` rollouts for each of ``prompts_per_step`` prompts, scores them with the prompt's
reward callable, and takes one gradient step on ``-advantage · log p(sampled tokens)`` over model-generated tokens
only (``loss_normalization="sequence"``: mean over a rollout's tokens, then over rollouts, as TRL's ``grpo`` loss;
``"token"``: over all tokens of the batch). Being on-policy with one step per batch, the importance ratio is 1 and no
clipping or reference model is needed (TRL with ``beta=0`` and ``num_iterations=1`` computes the same gradient).

Rollouts with zero advantage (every rollout of a group with zero reward spread) add nothing to the gradient, so the
forward/backward pass skips them; the normalisers still count them, so the update is the one an unskipped pass gives.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal
from collections.abc import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from aitrainsai import Item, Message, TaskFamily
from aitrainsai_trainer_local.llama import PROJECTIONS, logit_passes, selected_logprobs
from aitrainsai_trainer_local.lora import LoraSettings, LoraModel
from aitrainsai_trainer_local.rollout import Conversation, Rollout, family_conversation, rollout
from aitrainsai_trainer_local.sampling import Sampler


class GRPOConfig(BaseModel):
    """The trainer's knobs."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(25, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    prompts_per_step: int = Field(4, ge=1)
    group_size: int = Field(8, ge=2, description="samples per prompt")
    max_new_tokens: int = Field(16, ge=1, description="per turn")
    temperature: float = Field(1.0, gt=0)
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_target_modules: list[str] = Field(default_factory=lambda: list(PROJECTIONS))
    seed: int = 0
    max_grad_norm: float | None = Field(1.0, description="clip the gradient's global norm; None: no clipping")
    weight_decay: float = Field(0.0, ge=0)
    advantage_eps: float = Field(1e-4, gt=0)
    loss_normalization: Literal["sequence", "token"] = "sequence"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


Reward = Callable[[list[Message]], float]


@dataclass
class Example:
    """A training prompt. Each call of ``start`` gives one rollout's conversation, with tools holding state of its
    own, and the reward of that rollout's finished transcript."""

    start: Callable[[], tuple[Conversation, Reward]]

    @classmethod
    def fixed(cls, conversation: Conversation, reward: Reward) -> Example:
        """An example whose tools keep no state, so every rollout may share one conversation."""
        return cls(lambda: (conversation, reward))


@dataclass
class StepMetrics:
    step: int
    reward_mean: float
    reward_std: float
    loss: float
    grad_norm: float
    tokens_generated: int
    zero_spread_groups: int
    trained_rollouts: int
    seconds_generation: float
    seconds_scoring: float
    seconds_forward_backward: float  # the three below together
    seconds_total: float
    seconds_logprobs: float = 0.0  # the training forward: log-probs of the sampled tokens, with the graph
    seconds_backward: float = 0.0
    seconds_optimizer: float = 0.0  # clipping and the AdamW step
    # the work each phase did, for a FLOP count: token positions through the blocks, rows through the vocabulary
    positions_generation: int = 0
    logit_rows_generation: int = 0
    positions_training: int = 0
    logit_rows_training: int = 0
    attended_generation: int = 0  # (query, cache slot) pairs through attention: a long context's cost
    attended_training: int = 0
    forwards_generation: int = 0  # forward calls (a decode step is one)
    decode_attended_generation: int = 0  # attended_generation's pairs in decode steps (one query a row)
    decode_far_generation: int = 0  # of those, the pairs past a row's first llama.FAR_SLOTS cache slots
    copied_generation: int = 0  # bytes of key/value cache copied (rows repeated for a group, room made for a turn)
    copied_training: int = 0
    forwards_training: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainOutput:
    steps: list[StepMetrics] = field(default_factory=list)
    adapter: Path | None = None
    seconds: float = 0.0


def family_examples(family: TaskFamily, items: Sequence[Item]) -> list[Example]:
    """Examples from family items: the family's starting messages, tools and turn limit, rewarded by its scorer."""
    def start_for(item: Item) -> Callable[[], tuple[Conversation, Reward]]:
        return lambda: (family_conversation(family, item), lambda transcript: family.score(item, transcript))

    return [Example(start_for(item)) for item in items]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> tuple[torch.Tensor, int]:
    """``(r - group mean) / (group std + eps)`` for rewards ``[groups, group_size]`` (std with Bessel's correction,
    as TRL); groups whose rewards are all equal get exactly zero. Returns the advantages and how many such groups."""
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True)
    flat = (rewards == rewards[:, :1]).all(1, keepdim=True)
    advantages = torch.where(flat, torch.zeros_like(rewards), (rewards - mean) / (std + eps))
    return advantages, int(flat.sum())


class GRPOTrainer:
    """Trains a LoRA adapter on ``examples``; :meth:`step` runs one step, :meth:`train` all of them.

    Without ``policy`` it loads the base model with a fresh adapter from the config's LoRA knobs and dtype; a given
    policy (with a trainable adapter) is trained as it is, and those knobs are not used.
    """

    def __init__(self, config: GRPOConfig, examples: Sequence[Example], policy: LoraModel | None = None):
        if not examples:
            raise ValueError("no training examples")
        self.config = config
        self.examples = list(examples)
        self.policy = policy or LoraModel.load(
            lora=LoraSettings(config.lora_rank, config.lora_alpha, tuple(config.lora_target_modules)),
            dtype=config.dtype, seed=config.seed)
        self.parameters = self.policy.trainable_parameters()
        if not self.parameters:
            raise ValueError("the policy has no trainable parameters (load it with LoRA settings)")
        for parameter in self.parameters:  # zero, not None: a step with no loss still steps every parameter
            parameter.grad = torch.zeros_like(parameter)
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=config.weight_decay)
        self.step_index = 0
        self._order: list[int] = []
        self._rng = random.Random(config.seed)
        self.history: list[StepMetrics] = []

    def _next_examples(self) -> list[Example]:
        chosen: list[Example] = []
        while len(chosen) < self.config.prompts_per_step:
            if not self._order:
                self._order = list(range(len(self.examples)))
                self._rng.shuffle(self._order)
            chosen.append(self.examples[self._order.pop()])
        return chosen

    def step(self) -> StepMetrics:
        config, policy = self.config, self.policy
        started = time.perf_counter()
        batch = self._next_examples()
        starts = [example.start() for example in batch for _ in range(config.group_size)]
        conversations = [conversation for conversation, _ in starts]
        sampler = Sampler(policy.inference_model(), policy.stop_ids, policy.pad_id)
        rollouts = rollout(policy, conversations, max_new_tokens=config.max_new_tokens,
                           temperature=config.temperature, seed=config.seed * 1_000_003 + self.step_index,
                           sampler=sampler)
        generated = time.perf_counter()
        sampling = sampler.model
        rewards = torch.tensor([float(reward(r.transcript)) for (_, reward), r in zip(starts, rollouts)],
                               dtype=torch.float32)
        scored = time.perf_counter()
        advantages, flat_groups = group_advantages(rewards.view(len(batch), config.group_size), config.advantage_eps)
        advantages = advantages.flatten()
        self.optimizer.zero_grad(set_to_none=False)
        positions, attended, forwards, copied = (policy.fast.positions, policy.fast.attended, policy.fast.forwards,
                                                 policy.fast.copied)
        loss = policy_gradient_loss(policy, rollouts, advantages.tolist(), config.temperature,
                                    config.loss_normalization)
        forward = time.perf_counter()
        if loss is not None:
            loss.backward()
        backward = time.perf_counter()
        # Zero-advantage batches still step: AdamW moves on its moments, as in an unskipped pass.
        grad_norm = _clip(self.parameters, config.max_grad_norm)
        self.optimizer.step()
        finished = time.perf_counter()
        trained = [r for r, a in zip(rollouts, advantages.tolist()) if a != 0.0]
        sampled = sum(sum(r.completion_mask) for r in trained)
        metrics = StepMetrics(
            step=self.step_index + 1,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if rewards.numel() > 1 else 0.0,
            loss=float(loss.detach()) if loss is not None else 0.0,
            grad_norm=grad_norm,
            tokens_generated=sampler.generated_tokens,
            zero_spread_groups=flat_groups,
            trained_rollouts=int((advantages != 0).sum()),
            seconds_generation=generated - started,
            seconds_scoring=scored - generated,
            seconds_forward_backward=finished - scored,
            seconds_total=finished - started,
            seconds_logprobs=forward - scored,
            seconds_backward=backward - forward,
            seconds_optimizer=finished - backward,
            positions_generation=sampling.positions,
            logit_rows_generation=sampling.logit_rows,
            positions_training=policy.fast.positions - positions,
            logit_rows_training=sampled * logit_passes(sampled, policy.fast.lm_head.shape[0]),
            attended_generation=sampling.attended,
            attended_training=policy.fast.attended - attended,
            forwards_generation=sampling.forwards,
            decode_attended_generation=sampling.decode_attended,
            decode_far_generation=sampling.decode_far,
            copied_generation=sampling.copied,
            copied_training=policy.fast.copied - copied,
            forwards_training=policy.fast.forwards - forwards,
        )
        self.step_index += 1
        self.history.append(metrics)
        return metrics

    def train(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        while self.step_index < self.config.steps:
            metrics = self.step()
            if on_step is not None:
                on_step(metrics)
        return self.history

    def save(self, path: Path | str) -> Path:
        """The LoRA adapter, as ``peft``'s ``save_pretrained`` writes it."""
        return self.policy.save_adapter(path)


def train(examples: Sequence[Example], config: GRPOConfig, output_dir: Path | str | None = None,
          on_step: Callable[[StepMetrics], None] | None = None) -> TrainOutput:
    """Train a fresh adapter for ``config.steps`` steps; save it under ``output_dir/adapter`` if given."""
    started = time.perf_counter()
    trainer = GRPOTrainer(config, examples)
    steps = trainer.train(on_step)
    adapter = trainer.save(Path(output_dir) / "adapter") if output_dir is not None else None
    return TrainOutput(steps, adapter, time.perf_counter() - started)


def policy_gradient_loss(policy: LoraModel, rollouts: Sequence[Rollout], advantages: Sequence[float],
                         temperature: float = 1.0,
                         normalization: Literal["sequence", "token"] = "sequence") -> torch.Tensor | None:
    """``-Σ advantage · log p(token)`` over sampled tokens, normalised as :class:`GRPOConfig` says; ``None`` if every
    advantage is zero. Rollouts sharing a prompt run the prompt once (its keys/values are shared, gradients add up)."""
    chosen = [(r, a) for r, a in zip(rollouts, advantages) if a != 0.0]
    if not chosen:
        return None
    fast, device = policy.fast, policy.device
    total_tokens = sum(sum(r.completion_mask) for r in rollouts)
    prompts: dict[tuple[int, ...], int] = {}
    group = [prompts.setdefault(tuple(r.prompt_ids), len(prompts)) for r, _ in chosen]
    width = max(len(r.completion_ids) for r, _ in chosen)
    ids = torch.full((len(chosen), width), policy.pad_id, dtype=torch.long)
    valid = torch.zeros(len(chosen), width, dtype=torch.bool)
    sampled = torch.zeros(len(chosen), width, dtype=torch.bool)
    weights = torch.zeros(len(chosen), width, dtype=torch.float32)
    for i, (r, advantage) in enumerate(chosen):
        n = len(r.completion_ids)
        ids[i, :n] = torch.tensor(r.completion_ids)
        valid[i, :n] = True
        mask = torch.tensor(r.completion_mask, dtype=torch.bool)
        sampled[i, :n] = mask
        if normalization == "sequence":
            weights[i, :n] = -advantage / (int(mask.sum()) * len(rollouts))
        else:
            weights[i, :n] = -advantage / total_tokens
    cache, prompt_last = fast.prefill(list(prompts), policy.pad_id, inplace=False)
    index = torch.tensor(group, device=device)
    cache.select(index)
    hidden = fast.forward(ids.to(device), valid.to(device), cache)
    # The hidden state before each token predicts it: the prompt's last one for the first completion token.
    before = torch.cat([prompt_last.index_select(0, index)[:, None], hidden[:, :-1]], 1)
    sampled = sampled.to(device)
    logprobs = selected_logprobs(before[sampled], fast.lm_head, ids.to(device)[sampled], temperature)
    return (logprobs * weights.to(device)[sampled]).sum()


def _clip(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (None: no clipping); returns the norm before clipping."""
    limit = math.inf if max_norm is None else max_norm
    return float(torch.nn.utils.clip_grad_norm_(parameters, limit))
