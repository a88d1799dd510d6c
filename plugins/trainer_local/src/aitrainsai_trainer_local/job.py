"""The trusted driver of a local training or evaluation payload: ``python -m aitrainsai_trainer_local.job job.json``.

It works in the folder of ``job.json`` (the payload's workdir, wherever the worker put it): every path in
``job.json`` is relative to it, and its outputs are written there.

``train``: checks that the frozen job is the one accepted (its content hash) and re-checks its ``trainer.toml``
against the schema and the budget; then trains here, in this trusted process, while the job's environment (agent
code) answers from a sandbox (:class:`aitrainsai.RemoteEnvironment`): training rows, tool results and
rewards are data to this trainer, never code. Once the sandbox is gone it checks the hash again and writes the adapter
it saved itself (``adapter/``) and ``train.json`` (training time, per-step metrics). A job that cannot be trained
exits 1 after one line in its log, ``training failed: ...``: a sandbox that could not start, or that ended or hung
before it answered, ends that line with the sandbox's own last error line (its stderr's tail follows).

``eval``: the core's hidden eval (:mod:`aitrainsai.evaluation`) of the untrained base or of ``checkpoint/`` through
:class:`LocalChatEngine`; writes ``scores.json`` (an :class:`aitrainsai.evaluation.EvalResult`). It loads the one task
family ``job.json`` names, from the distribution it names (:func:`aitrainsai.load_family`), and runs no job code: a
checkpoint is data, checked (rank, size) before it is loaded.

``job.json`` is a :class:`aitrainsai_trainer_local.jobspec.JobSpec`; one that cannot be read as one is exit 2 after
one line saying why. A family that cannot be loaded as the run recorded it is exit 1 after one line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aitrainsai import SpecError
from aitrainsai_trainer_local.inner import ADAPTER_DIR, SCORES_FILE, TRAIN_FILE, LocalJobConfig
from aitrainsai_trainer_local.jobspec import EvalSpec, TrainSpec, read_spec

if TYPE_CHECKING:
    from aitrainsai import EvalResult, TaskFamily

METRICS_FILE = "metrics.json"


class TrainingFailed(RuntimeError):
    """The job could not be trained; the message says why."""


def main(spec_path: str) -> int:
    spec_file = Path(spec_path).resolve()
    try:
        spec = read_spec(spec_file)
    except SpecError as exc:
        print(f"the payload cannot start: {exc}", flush=True)
        return 2
    os.chdir(spec_file.parent)  # the workdir: relative paths below (and the outputs) are inside it
    if isinstance(spec, EvalSpec):
        return _run_eval(spec, spec_file.parent)
    from aitrainsai import JobChanged, verify_job

    job_dir = spec_file.parent / spec.job_dir  # the copy of the frozen job that travelled with the payload
    started = time.monotonic()
    try:
        verify_job(job_dir, spec.digest)
        config = _checked_config(job_dir, spec)
        metrics = _train(job_dir, config, spec)
        verify_job(job_dir, spec.digest)
    except (TrainingFailed, JobChanged) as exc:
        print(f"training failed: {exc}", flush=True)
        return 1
    train_seconds = time.monotonic() - started
    Path(TRAIN_FILE).write_text(json.dumps({"train_seconds": train_seconds, "metrics": metrics}))
    print(f"trained in {train_seconds:.0f} s; adapter in {ADAPTER_DIR}/", flush=True)
    return 0


def _run_eval(spec: EvalSpec, workdir: Path) -> int:
    """The hidden eval ``spec`` asks for; ``scores.json`` in ``workdir``."""
    from aitrainsai import PluginError, load_family

    try:
        family = load_family(spec.family, spec.distribution)
    except PluginError as exc:  # the run's plugins are not what is installed here: one line in the job's log
        print(f"the payload cannot load the run's plugins: {exc}", flush=True)
        return 1
    checkpoint = workdir / spec.checkpoint if spec.checkpoint else None
    result = _evaluate(family, spec, adapter=checkpoint)
    Path(SCORES_FILE).write_text(result.model_dump_json())
    what = "checkpoint" if checkpoint else f"untrained {spec.base_model}"
    print(f"{what} on {family.name} level {spec.level}: {result.score:.3f} ({result.engine.key()})")
    return 0


def _checked_config(job_dir: Path, spec: TrainSpec) -> LocalJobConfig:
    """The job's ``trainer.toml``, checked again here against the schema, the allowed bases and the budget."""
    from aitrainsai_trainer_local.inner import LocalTrainer

    trainer = LocalTrainer(spec.trainer)
    problems = trainer.check_config(job_dir, spec.constraints)
    if problems:
        raise TrainingFailed("trainer.toml does not pass the trainer's checks: " + "; ".join(map(str, problems)))
    return trainer.job_config(job_dir)


def _train(job_dir: Path, config: LocalJobConfig, spec: TrainSpec) -> dict:
    """GRPO on the job's environment; the adapter goes to ``adapter/``, per-step metrics to ``metrics.json``."""
    from aitrainsai import JobEnvironmentError, Limits, RemoteEnvironment
    from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer
    from aitrainsai_trainer_local.rollout import Conversation

    trainer = spec.trainer
    wall = float(spec.wall_s)
    limits = Limits(wall_s=wall, cpu_s=int(wall), memory_mb=trainer.memory_gb * 1024, tmp_mb=256, out_mb=16)
    history: list[dict] = []
    try:
        with RemoteEnvironment(job_dir, limits=limits, env={"AITRAINSAI_PHASE": "train"}) as env:
            info = env.load()
            rows = env.rows(info.rows)
            if not rows:
                raise TrainingFailed("the environment has no training rows")
            schemas = [s.model_dump() for s in info.tool_schemas]
            turns = min(info.max_turns, config.max_turns)
            print(f"{len(rows)} rows, tools {', '.join(info.tool_names)}, {turns} of {info.max_turns} turns in "
                  f"training; {config}", flush=True)

            def start_for(index: int):
                prompt = rows[index].messages()

                def start():
                    state = env.start(row=index)
                    conversation = Conversation(prompt, {}, schemas, turns,
                                                run_tool=lambda name, arguments: env.tool(state, name, arguments))
                    return conversation, lambda transcript: env.score(state, transcript[len(prompt):]).reward
                return start

            grpo = GRPOConfig(steps=config.steps, learning_rate=config.learning_rate,
                              prompts_per_step=config.prompts_per_step, group_size=config.group_size,
                              max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, seed=config.seed,
                              dtype=trainer.dtype)
            grpo_trainer = GRPOTrainer(grpo, [Example(start_for(i)) for i in range(len(rows))])

            def record(step) -> None:
                history.append(step.to_dict())
                print(f"step {step.step}: reward {step.reward_mean:.3f} +- {step.reward_std:.3f}, loss "
                      f"{step.loss:.4f}, {step.seconds_total:.1f} s", flush=True)
                Path(METRICS_FILE).write_text(json.dumps({"steps": history}))

            grpo_trainer.train(on_step=record)
            errors = env.reward_errors()
            if errors:
                print(f"rubric errors (scored 0): {errors[:5]}", flush=True)
    except JobEnvironmentError as exc:
        where = f" ({exc.file}{f':{exc.line}' if exc.line else ''})" if exc.file else ""
        raise TrainingFailed(f"{exc.message}{where}") from None
    grpo_trainer.save(ADAPTER_DIR)
    return {"steps": history}


def _evaluate(family: TaskFamily, spec: EvalSpec, adapter: Path | None) -> EvalResult:
    """The core's hidden eval (:func:`aitrainsai.evaluation.evaluate_family`) of the base model or ``adapter`` through
    this trainer's engine: one code path for pre and post, with the same settings."""
    from aitrainsai import evaluate_family
    from aitrainsai_trainer_local.engine import LocalChatEngine
    from aitrainsai_trainer_local.lora import LoraModel

    trainer = spec.trainer
    policy = LoraModel.load(adapter=adapter, dtype=trainer.dtype)
    engine = LocalChatEngine(policy, max_new_tokens=trainer.eval_max_new_tokens, batch_size=trainer.eval_batch_size)
    return evaluate_family(family, spec.level, engine, eval_size=spec.eval_size)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if len(sys.argv) != 2:
        print("usage: python -m aitrainsai_trainer_local.job job.json", flush=True)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
