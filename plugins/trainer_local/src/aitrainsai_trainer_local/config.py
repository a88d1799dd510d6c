"""The local trainer's two schemas: a job's ``trainer.toml`` (:class:`LocalJobConfig`, the agent's choices) and the
run's options (:class:`LocalTrainerConfig`), which the trainer (:mod:`aitrainsai_trainer_local.inner`) and its
payloads' ``job.json`` (:mod:`aitrainsai_trainer_local.jobspec`) share."""

from __future__ import annotations

from aitrainsai import InnerTrainerConfig, JobConfigBase
from pydantic import Field, model_validator

from aitrainsai_trainer_local.model import BASE_MODEL

MAX_LORA_RANK = 128
MAX_LORA_ALPHA = 1024.0
TOKENS_PER_STEP = 8_192  # the default work budget per allowed step: 4 prompts x 8 rollouts x 4 turns x 64 tokens


class LocalJobConfig(JobConfigBase):
    """A job's ``trainer.toml`` for the local trainer."""

    base_model: str = BASE_MODEL
    steps: int = Field(12, ge=1, description="GRPO steps")
    learning_rate: float = Field(2e-4, gt=0, le=1e-2, allow_inf_nan=False)
    prompts_per_step: int = Field(4, ge=1, le=32, description="dataset rows per step")
    group_size: int = Field(8, ge=2, le=32, description="rollouts per row (a GRPO group)")
    max_new_tokens: int = Field(48, ge=4, le=512, description="per turn")
    temperature: float = Field(1.0, gt=0, le=2, allow_inf_nan=False)
    lora_rank: int = Field(16, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = Field(32.0, gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False)
    max_turns: int = Field(2, ge=1, description="training rollouts end after this many replies or at the "
                                                "environment's turn limit; the hidden eval always runs to that limit")
    seed: int = Field(0, ge=0, le=2**32 - 1)


class LocalTrainerConfig(InnerTrainerConfig):
    """Run options of the local trainer (not the agent's choices)."""

    eval_size: int = Field(16, ge=1, le=1_000, description="hidden-eval items scored pre and post (the full set: 200; "
                                                              "16 keeps the default CPU run short)")
    eval_max_new_tokens: int = Field(48, ge=4, le=512)
    eval_batch_size: int = Field(48, ge=1)
    max_train_steps: int = Field(4, ge=1, description="the training budget a job may use (4: the default CPU run)")
    max_dataset_size: int = Field(2_000, ge=1)
    max_wall_seconds: int = Field(1_200, ge=10, description=(
        "a job's budget of wall-clock time in its own code (tools, rubric), all calls together; the trainer's "
        "compute is bounded by max_train_steps and max_train_tokens, with a wall-clock net scaled to the machine "
        "(aitrainsai_trainer_local.job.Clock)"))
    max_train_tokens: int | None = Field(None, ge=1, description=(
        "the most tokens a job may sample in training: steps x prompts_per_step x group_size x max_turns x "
        "max_new_tokens (its work budget, the same on any machine); unset: TOKENS_PER_STEP per step of "
        "max_train_steps"))
    memory_gb: int = Field(4, ge=1, description=(
        "memory limit of the job's sandboxed environment (the probe's sandboxes have 4: another value is a difference "
        "a job can see between the probe and training)"))
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16)$")


    @model_validator(mode="after")
    def _token_budget(self) -> LocalTrainerConfig:
        if self.max_train_tokens is None:
            self.max_train_tokens = TOKENS_PER_STEP * self.max_train_steps
        return self
