"""A job's ``rl.toml`` for prime-rl v0.6.0, generated from its ``trainer.toml``, and this plugin's own model of the
part of prime-rl's config schema it writes.

The model mirrors ``prime_rl.configs`` at the pinned tag (``packages/prime-rl-configs``): the same names, types,
bounds and the cross-field rules that touch what we set (every prime-rl config forbids unknown keys; batch size a
multiple of group size; the trainer's sequence length at least the orchestrator's; LoRA only with filesystem
broadcast; vLLM's LoRA rank one of its valid values). A test validates every generated file against prime-rl's own
schema when a checkout is at hand, so a drift between this model and prime-rl shows there.

What the job decides (``trainer.toml``) and what the run decides (GPU layout, memory share, output folder) stay
apart: :func:`render` takes both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from aitrainsai_trainer_prime_rl.config import PrimeRlJobConfig
from aitrainsai_trainer_prime_rl.pins import VLLM_LORA_RANKS

OUTPUT_DIR = "outputs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Model(_Strict):
    name: str


class LoRA(_Strict):
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, ge=0)
    dropout: float = Field(0.0, ge=0, le=1)


class TrainerModel(_Strict):
    lora: LoRA | None = None
    attn: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "fa4"] = "flash_attention_2"


class AdamW(_Strict):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-6, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    max_norm: float | None = Field(1.0, ge=0)


class WeightCheckpoint(_Strict):
    save_adapter_separately: bool = False


class TrainerCheckpoint(_Strict):
    weights: WeightCheckpoint = WeightCheckpoint()


class Trainer(_Strict):
    model: TrainerModel = TrainerModel()
    optim: AdamW = AdamW()
    ckpt: TrainerCheckpoint | None = None

    @model_validator(mode="after")
    def _adapter_needs_lora(self) -> Trainer:
        if self.ckpt and self.ckpt.weights.save_adapter_separately and self.model.lora is None:
            raise ValueError("save_adapter_separately=True requires LoRA to be enabled")
        return self


class Sampling(_Strict):
    temperature: float = Field(1.0, ge=0)
    max_completion_tokens: int | None = None


class Env(_Strict):
    id: str
    name: str | None = None
    args: dict = Field(default_factory=dict)


class Train(_Strict):
    sampling: Sampling = Sampling()
    env: list[Env]


class Renderer(_Strict):
    name: Literal["qwen3"] = "qwen3"
    enable_thinking: bool = True


class Orchestrator(_Strict):
    batch_size: int | None = Field(None, ge=1)
    group_size: int = Field(1, ge=1)
    train: Train
    renderer: Renderer = Renderer()

    @model_validator(mode="after")
    def _batching(self) -> Orchestrator:
        if self.batch_size is not None and self.batch_size % self.group_size:
            raise ValueError("Batch size must be divisible by the number of samples per problem")
        return self


class InferenceModel(_Strict):
    max_model_len: int | None = None


class Inference(_Strict):
    gpu_memory_utilization: float = 0.9
    model: InferenceModel = InferenceModel()


class Deployment(_Strict):
    type: Literal["single_node"] = "single_node"
    gpus_per_node: int = 8
    num_train_gpus: int = 1
    num_infer_gpus: int = 1

    @model_validator(mode="after")
    def _fits(self) -> Deployment:
        total = self.num_train_gpus + self.num_infer_gpus
        if total > self.gpus_per_node:
            raise ValueError(f"Total GPU count ({total}) exceeds gpus_per_node ({self.gpus_per_node})")
        return self


class Checkpoint(_Strict):
    interval: int | None = Field(None, ge=1)


class RLConfig(_Strict):
    """``rl.toml``: the part of ``prime_rl.configs.rl.RLConfig`` (v0.6.0) this plugin writes."""

    max_steps: int | None = None
    seq_len: int | None = None
    output_dir: str = OUTPUT_DIR
    model: Model
    ckpt: Checkpoint | None = None
    deployment: Deployment = Deployment()
    trainer: Trainer
    orchestrator: Orchestrator
    inference: Inference | None = None

    @model_validator(mode="after")
    def _lora(self) -> RLConfig:
        lora = self.trainer.model.lora
        if lora is not None and self.inference is not None and lora.rank not in VLLM_LORA_RANKS:
            raise ValueError(f"LoRA rank {lora.rank} is not one of vLLM's max_lora_rank values {VLLM_LORA_RANKS}")
        if self.ckpt is None:
            raise ValueError("[ckpt] is needed: without it prime-rl writes no weights")
        return self


Layout = Literal["one-gpu", "two-gpu"]


def render(job: PrimeRlJobConfig, env_id: str, *, layout: Layout, infer_memory_fraction: float,
           env_args: dict | None = None) -> str:
    """The ``rl.toml`` of a job: its choices from ``trainer.toml``, the run's GPU layout. On one GPU the trainer and
    vLLM share it (vLLM takes ``infer_memory_fraction`` of its memory); prime-rl's launcher cannot place both on one
    GPU, so the driver starts the three processes itself from the configs this file resolves to. ``env_args`` go to
    the environment package's ``load_environment`` (the sandbox's limits)."""
    import tomli_w

    config = RLConfig(
        max_steps=job.steps, seq_len=job.seq_len, model=Model(name=job.base_model), ckpt=Checkpoint(),
        deployment=Deployment(num_train_gpus=1, num_infer_gpus=1),
        trainer=Trainer(model=TrainerModel(lora=LoRA(rank=job.lora_rank, alpha=job.lora_alpha)),
                        optim=AdamW(lr=job.learning_rate),
                        ckpt=TrainerCheckpoint(weights=WeightCheckpoint(save_adapter_separately=True))),
        orchestrator=Orchestrator(
            batch_size=job.rollouts_per_step, group_size=job.group_size,
            train=Train(sampling=Sampling(temperature=job.temperature, max_completion_tokens=job.max_tokens),
                        env=[Env(id=env_id, name="job", args=env_args or {})]),
            renderer=Renderer(enable_thinking=False)),
        inference=Inference(gpu_memory_utilization=infer_memory_fraction if layout == "one-gpu" else 0.9,
                            model=InferenceModel(max_model_len=job.seq_len)),
    )
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def final_step_dir(workdir: Path, steps: int) -> Path:
    """Where prime-rl v0.6.0 writes the last step's weights (``[ckpt]`` on): ``<output_dir>/weights/step_<N>``."""
    return Path(workdir) / OUTPUT_DIR / "weights" / f"step_{steps}"


ADAPTER_SUBDIR = "lora_adapters"  # inside a step's weights folder, with save_adapter_separately = true
