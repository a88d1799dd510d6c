"""A job's ``rl.toml`` for prime-rl main at the pinned commit (:data:`~.pins.MAIN_V1`, verifiers v1 tasksets only),
generated from its ``trainer.toml``, and this plugin's own model of the part of that prime-rl's config schema it
writes.

The model mirrors ``prime_rl.configs`` at that commit (``packages/prime-rl-configs``): the same names, types, bounds
and the cross-field rules that touch what we set (unknown keys refused; batch size a multiple of group size; LoRA
only with filesystem weight broadcast; vLLM's LoRA rank at most 512; the renderer a model's own, since ``auto``
refuses a model outside ``renderers``' map). A test validates every generated file against prime-rl's own schema
when a checkout is at hand.

What changed since v0.6.0 (:mod:`.rltoml`): environments are ``[[orchestrator.train.source]]`` entries whose ``env``
names a v1 taskset (``env.taskset.id``) played by verifiers' ``null`` harness in a ``subprocess`` runtime; monitors
are ``[monitors.*]`` (a file monitor writes ``<run>/metrics.jsonl``; no W&B); steps count from 1; the staleness bound
is ``orchestrator.max_off_policy_steps``; vLLM's options are ``[inference.vllm]``; the run writes under
``<output_dir>/<run.name>/`` and a LoRA run's adapter of step N is ``broadcasts/step_N`` (full weight checkpoints
are gone, so no ``[ckpt]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from aitrainsai_trainer_prime_rl.config import PrimeRlJobConfig
from aitrainsai_trainer_prime_rl.pins import VLLM_LORA_RANKS
from aitrainsai_trainer_prime_rl.rltoml import AdamW, Deployment, LoRA, Model, _Strict  # unchanged since v0.6.0

OUTPUT_DIR = "outputs"
RUN_NAME = "job"  # a fixed run name, so the run's folder is known: outputs/job
SOURCE_NAME = "job"  # the one training source's name (metrics are keyed by it)
MAX_OFF_POLICY_STEPS = 8  # prime-rl's default, and the bound v0.6.0 used: rollouts at most 8 policies old
METRICS_FILE = "metrics.jsonl"
RENDERERS = {"Qwen/Qwen3-0.6B": "qwen3", "Qwen/Qwen3-1.7B": "qwen3",  # renderers.base.MODEL_RENDERER_MAP's names
             "Qwen/Qwen3.5-0.8B": "qwen3.5", "Qwen/Qwen3.5-2B": "qwen3.5"}


class Run(_Strict):
    name: str | None = None


class TrainerModel(_Strict):
    lora: LoRA | None = None


class Trainer(_Strict):
    model: TrainerModel = TrainerModel()
    optim: AdamW = AdamW()


class TrainSampling(_Strict):
    temperature: float = Field(1.0, ge=0, le=2.0)
    max_completion_tokens: int | None = None


class Taskset(_Strict):
    """``env.taskset``: the id verifiers imports, and the fields of the job package's ``TasksetConfig`` (the
    sandbox's limits, :mod:`.envpkg`)."""

    id: str = Field(min_length=1)
    memory_mb: int = Field(4096, ge=1)
    wall_s: float = Field(3600.0, gt=0)


class Harness(_Strict):
    id: Literal["null"] = "null"  # a plain chat loop: the model's replies and the taskset's tools, no code execution


class Runtime(_Strict):
    type: Literal["subprocess"] = "subprocess"  # the default, "prime", is a remote sandbox that needs an API key


class Agent(_Strict):
    harness: Harness = Harness()
    runtime: Runtime = Runtime()


class EnvBlock(_Strict):
    taskset: Taskset
    agent: Agent = Agent()


class TrainSource(_Strict):
    name: str | None = None
    env: EnvBlock

    @model_validator(mode="after")
    def _name(self) -> TrainSource:
        if (self.name or self.env.taskset.id) == "agg":
            raise ValueError('Environment name "agg" is reserved for cross-env metric aggregation')
        return self


class Train(_Strict):
    sampling: TrainSampling = TrainSampling()
    source: list[TrainSource] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> Train:
        names = [s.name or s.env.taskset.id for s in self.source]
        if len(set(names)) != len(names):
            raise ValueError(f"Duplicate training environment names: {names}")
        return self


class Renderer(_Strict):
    name: Literal["qwen3", "qwen3.5"]
    enable_thinking: bool = True


class Orchestrator(_Strict):
    batch_size: int | None = Field(None, ge=1)
    group_size: int = Field(1, ge=1)
    max_off_policy_steps: int = Field(8, ge=0)
    train: Train
    renderer: Renderer

    @model_validator(mode="after")
    def _batching(self) -> Orchestrator:
        if self.batch_size is not None and self.batch_size % self.group_size:
            raise ValueError("Batch size must be divisible by the number of samples per problem")
        if not self.train.source:
            raise ValueError("no training source: [[orchestrator.train.source]] names the job's taskset")
        return self


class Vllm(_Strict):
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None


class Inference(_Strict):
    vllm: Vllm = Vllm()


class WeightBroadcast(_Strict):
    type: Literal["filesystem"] = "filesystem"  # LoRA runs need it (in-memory broadcast does not carry adapters)


class FileMonitor(_Strict):
    path: str = METRICS_FILE


class Monitors(_Strict):
    """``[monitors]``: the file monitor only; W&B is not modelled, so a config that sets it is refused."""

    file: FileMonitor | None = None


class RLConfig(_Strict):
    """``rl.toml``: the part of ``prime_rl.configs.rl.RLConfig`` (main at the pinned commit) this plugin writes."""

    max_steps: int | None = None
    seq_len: int | None = None
    output_dir: str = OUTPUT_DIR
    run: Run = Run()
    model: Model
    deployment: Deployment = Deployment()
    weight_broadcast: WeightBroadcast | None = None
    monitors: Monitors = Monitors()
    trainer: Trainer
    orchestrator: Orchestrator
    inference: Inference | None = None

    @model_validator(mode="after")
    def _rules(self) -> RLConfig:
        lora = self.trainer.model.lora
        if lora is not None and self.inference is not None and lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank={lora.rank} exceeds vLLM maximum of {VLLM_LORA_RANKS[-1]}")
        expected = RENDERERS.get(self.model.name)
        if expected is not None and self.orchestrator.renderer.name != expected:
            raise ValueError(f"{self.model.name} is rendered by {expected!r}, not {self.orchestrator.renderer.name!r}")
        if self.monitors.file is None:
            raise ValueError("[monitors.file] is needed: the driver reads each step's reward from metrics.jsonl")
        if self.run.name is None:
            raise ValueError("run.name is needed: without it the run's folder has a random name")
        return self


Layout = Literal["one-gpu", "two-gpu"]


def render(job: PrimeRlJobConfig, env_id: str, *, layout: Layout, infer_memory_fraction: float,
           memory_mb: int = 4096, wall_s: float = 3600.0) -> str:
    """The ``rl.toml`` of a job for prime-rl main: its choices from ``trainer.toml``, the run's GPU layout. On one GPU
    the trainer and vLLM share it (vLLM takes ``infer_memory_fraction``; prime-rl's launcher hands out disjoint GPUs,
    so the driver starts the processes itself from the configs ``rl --dry-run`` resolves). ``memory_mb`` and
    ``wall_s`` are the sandbox's limits, fields of the job package's taskset config."""
    import tomli_w

    config = RLConfig(
        max_steps=job.steps, seq_len=job.seq_len, run=Run(name=RUN_NAME), model=Model(name=job.base_model),
        deployment=Deployment(num_train_gpus=1, num_infer_gpus=1), weight_broadcast=WeightBroadcast(),
        monitors=Monitors(file=FileMonitor()),
        trainer=Trainer(model=TrainerModel(lora=LoRA(rank=job.lora_rank, alpha=job.lora_alpha)),
                        optim=AdamW(lr=job.learning_rate)),
        orchestrator=Orchestrator(
            batch_size=job.rollouts_per_step, group_size=job.group_size, max_off_policy_steps=MAX_OFF_POLICY_STEPS,
            train=Train(sampling=TrainSampling(temperature=job.temperature, max_completion_tokens=job.max_tokens),
                        source=[TrainSource(name=SOURCE_NAME, env=EnvBlock(
                            taskset=Taskset(id=env_id, memory_mb=memory_mb, wall_s=wall_s)))]),
            renderer=Renderer(name=RENDERERS[job.base_model], enable_thinking=False)),
        inference=Inference(vllm=Vllm(gpu_memory_utilization=infer_memory_fraction if layout == "one-gpu" else 0.9,
                                      max_model_len=job.seq_len)),
    )
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def driver_flags(port: int, backend_port: int, env_port: int) -> list[str]:
    """The flags the driver adds to ``rl @ rl.toml``: ports of this job's own, so that jobs sharing a machine do not
    collide on prime-rl's defaults (router 8000, vLLM behind it 8100, env servers from 5000)."""
    return ["--inference.server.port", str(port), "--inference.backend-port", str(backend_port),
            "--orchestrator.model.client.base-url", f"http://localhost:{port}/v1",
            "--orchestrator.env-server-base-port", str(env_port)]


def run_dir(workdir: Path) -> Path:
    """The run's folder: ``<output_dir>/<run.name>``."""
    return Path(workdir) / OUTPUT_DIR / RUN_NAME


def final_adapter_dir(workdir: Path, steps: int) -> Path:
    """Where prime-rl main leaves the LoRA adapter of the last step (steps count from 1): the filesystem broadcast
    ``<run>/broadcasts/step_<N>`` (``adapter_model.safetensors``, ``adapter_config.json``, ``STABLE``)."""
    return run_dir(workdir) / "broadcasts" / f"step_{steps}"
