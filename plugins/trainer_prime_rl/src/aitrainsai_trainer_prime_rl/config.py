"""The two configs of the prime-rl trainer: a job's ``trainer.toml`` (the agent's choices, checked by the probe) and
the run's options (the user's)."""

from __future__ import annotations

from typing import Literal, get_args

from aitrainsai import InnerTrainerConfig, JobConfigBase
from pydantic import Field, model_validator

from aitrainsai_trainer_prime_rl.pins import ALL_BASES, BASES, StackOption

Base = Literal["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"]
assert set(get_args(Base)) == set(BASES)
BaseV1 = Literal["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-2B"]
assert set(get_args(BaseV1)) == set(ALL_BASES)
MAX_LORA_RANK = 128
MAX_LORA_ALPHA = 1024.0


class PrimeRlJobConfig(JobConfigBase):
    """A job's ``trainer.toml`` for the prime-rl trainer: GRPO with LoRA on one of two Qwen3 bases."""

    base_model: Base = Field("Qwen/Qwen3-0.6B", description="the small model the job trains")
    steps: int = Field(20, ge=1, description="GRPO steps (prime-rl max_steps)")
    learning_rate: float = Field(1e-5, gt=0, le=1e-3, allow_inf_nan=False,
                                 description="AdamW learning rate of the LoRA weights")
    rollouts_per_step: int = Field(64, ge=2, le=1024,
                                   description="rollouts per step (prime-rl orchestrator.batch_size)")
    group_size: int = Field(8, ge=2, le=64, description="rollouts per dataset row (a GRPO group)")
    lora_rank: int = Field(16, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = Field(32.0, gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False)
    max_tokens: int = Field(512, ge=16, le=8192, description="tokens per reply (max_completion_tokens)")
    seq_len: int = Field(4096, ge=512, le=32768, description="tokens per rollout: prompt, replies, tool results")
    temperature: float = Field(1.0, gt=0, le=2.0, allow_inf_nan=False,
                               description="sampling temperature of training rollouts")

    @model_validator(mode="after")
    def _shapes(self) -> PrimeRlJobConfig:
        if self.rollouts_per_step % self.group_size:
            raise ValueError(f"rollouts_per_step ({self.rollouts_per_step}) must be a multiple of group_size "
                             f"({self.group_size}): each step trains whole groups")
        if self.max_tokens >= self.seq_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be below seq_len ({self.seq_len}): the prompt "
                             "needs room too")
        return self


class PrimeRlJobConfigV1(PrimeRlJobConfig):
    """``trainer.toml`` where the run trains on prime-rl main (``prime_rl.stack``): the same keys, and the two dense
    Qwen3.5 bases beside the Qwen3 ones."""

    # a wider Literal than the parent's, on purpose (pydantic replaces the field; mypy sees a narrowed attribute)
    base_model: BaseV1 = Field("Qwen/Qwen3-0.6B", description="the small model the job trains")  # type: ignore[assignment]


class PrimeRlTrainerConfig(InnerTrainerConfig):
    """Run options of the prime-rl trainer (not the agent's choices)."""

    eval_size: int = Field(200, ge=1, le=1_000, description="hidden-eval items scored pre and post (200: the full set)")
    eval_max_tokens: int = Field(1024, ge=16, le=8192, description="tokens per reply in the hidden eval")
    eval_concurrency: int = Field(64, ge=1, le=1024, description="eval conversations in flight against vLLM")
    max_train_steps: int = Field(100, ge=1, description="the training budget a job may use")
    max_dataset_size: int = Field(5_000, ge=1)
    max_wall_seconds: int = Field(3_600, ge=60, description="a job's training wall-clock limit")
    stack: StackOption = Field("auto", description=(
        "the prime-rl a job trains on: 'auto' by the job's format (classic verifiers -> v0.6.0, verifiers-v1 -> main "
        "at 559b447); a named one refuses jobs of the other format. Qwen3.5 bases are offered only where it names "
        "main-559b447"))
    gpus: int = Field(1, ge=0, le=2, description="GPUs per job: 1 (trainer and vLLM share it) or 2 (one each); 0 "
                                                 "asks the backend for none (a stand-in prime-rl in tests)")
    gpu_type: str | None = Field(None, description="a GPU model a job's worker must have, e.g. 'H100'")
    infer_memory_fraction: float = Field(0.3, gt=0.05, lt=0.95, description="vLLM's share of the GPU when it shares "
                                                                              "one with the trainer")
    prime_rl_source: str = Field("https://github.com/PrimeIntellect-ai/prime-rl.git",
                                 description="where a worker gets prime-rl: a git URL (checked out at the pinned tag "
                                             "or commit) or a folder holding a checkout")
    uv: str = Field("uv", description="the uv executable on workers (installed with pip when missing)")
    launcher: list[str] = Field(default_factory=list, description="the command that runs prime-rl's rl (default: "
                                                                  "'uv run rl' in the checkout); tests use a stand-in")
    eval_server: list[str] = Field(default_factory=list, description="the command that serves the model for the "
                                   "eval (default: 'vllm serve' in prime-rl's environment); tests use a stand-in")
    eval_max_model_len: int = Field(16_384, ge=1_024, description="vLLM's context length in the eval")
    sandbox_memory_mb: int = Field(4096, ge=256, description="memory limit of the sandbox that serves the job's "
                                                               "environment (its tools and rubric) to prime-rl")
    memory_gb: float = Field(48.0, gt=0, description="host memory a job needs")
    disk_gb: float = Field(40.0, gt=0, description="free disk a job needs: the checkout's venv, the bases, checkpoints")
