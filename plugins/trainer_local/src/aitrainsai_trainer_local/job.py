"""The trusted driver of a local training or evaluation payload: ``python -m aitrainsai_trainer_local.job job.json``.

It works in the folder of ``job.json`` (the payload's workdir, wherever the worker put it): every path in
``job.json`` is relative to it, and its outputs are written there.

``train``: checks that the frozen job is the one accepted (its content hash) and re-checks its ``trainer.toml`` against
the schema and the budget; then trains here, in this trusted process, while the job's environment (agent code) answers
from a sandbox (:class:`aitrainsai.RemoteEnvironment`): tool results and rewards are data to this trainer, never code.
The training prompts are the rows the probe froze (:func:`aitrainsai.frozen_rows`), never what the environment serves:
it must serve exactly those, or the job dies naming the first row that differs. Once the sandbox is gone it checks the
hash again and writes the adapter it saved itself (``adapter/``) and ``train.json`` (training time, per-step metrics). A
job that cannot be trained exits 1 after one line in its log, ``training failed: ...``: a sandbox that could not start,
or that ended or hung before it answered, ends that line with the sandbox's own last error line (its stderr's tail
follows).

``eval``: the core's hidden eval (:mod:`aitrainsai.evaluation`) of the untrained base or of ``checkpoint/`` through
:class:`LocalChatEngine`; writes ``scores.json`` (an :class:`aitrainsai.evaluation.EvalResult`). It loads the one task
family ``job.json`` names, from the distribution it names (:func:`aitrainsai.load_family`), and runs no job code: a
checkpoint is data, checked (rank, size) before it is loaded.

``job.json`` is a :class:`aitrainsai_trainer_local.jobspec.JobSpec`; one that cannot be read as one is exit 2 after
one line saying why. A family that cannot be loaded as the run recorded it is exit 1 after one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from aitrainsai import SpecError
from aitrainsai_trainer_local.config import LocalJobConfig
from aitrainsai_trainer_local.inner import ADAPTER_DIR, EXIT_INFRA, HARD_WALL, SCORES_FILE, TRAIN_FILE
from aitrainsai_trainer_local.jobspec import EvalSpec, TrainSpec, read_spec

if TYPE_CHECKING:
    from aitrainsai import EvalResult, TaskFamily
    from aitrainsai_trainer_local.model import DType

METRICS_FILE = "metrics.json"
CALL_BUDGET_S = 120.0  # one call into the job's code (a tool, the rubric), at most
WALL_MARGIN = 1.5  # the most budgets of work (the reference machine's seconds of the trainer's compute) a job may use
SLOW_NET = 6  # budgets of wall time after which work within its budget stops, as this machine's (before HARD_WALL)
MEASURE_TRIES = 3  # measures of the load after a step, at most, until one runs with the job's sandbox idle
QUIET_SANDBOX_CPU_S = 0.01  # the CPU time the job's sandbox may use during a measure that is kept


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
        trained = _train(job_dir, config, spec)
        verify_job(job_dir, spec.digest)
    except (TrainingFailed, JobChanged) as exc:
        print(f"training failed: {exc}", flush=True)
        return 1
    except MachineTooSlow as exc:
        print(f"training stopped (infrastructure): {exc}", flush=True)
        return EXIT_INFRA
    train_seconds = time.monotonic() - started
    Path(TRAIN_FILE).write_text(json.dumps({"train_seconds": train_seconds, **trained}))
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
    config = trainer.job_config(job_dir)
    assert isinstance(config, LocalJobConfig)  # LocalTrainer's JobConfig
    return config


def _train(job_dir: Path, config: LocalJobConfig, spec: TrainSpec) -> dict:
    """GRPO on the job's environment; the adapter goes to ``adapter/``, per-step metrics to ``metrics.json``. Returns
    ``train.json``'s fields but the training time: the metrics, and whether the job's code is reproducible."""
    from aitrainsai import JobEnvironmentError, RemoteEnvironment, frozen_rows
    from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer
    from aitrainsai_trainer_local.llama import TooLarge
    from aitrainsai_trainer_local.load import stretch
    from aitrainsai_trainer_local.rollout import Conversation
    from aitrainsai_trainer_local.work import rates_for, step_work

    history: list[dict] = []
    frozen = frozen_rows(job_dir)  # what the probe checked: the prompts, answers and worlds training reads
    if not frozen.rows:
        raise TrainingFailed("the job has no training rows")
    dtype, device = _compute_of(spec)
    rates = rates_for(config.base_model, str(dtype))  # what each count of the trainer's work costs the reference
    clock = Clock(float(spec.wall_s), load=lambda: stretch(dtype, device))
    clock.calibrate()  # before the job's sandbox starts: nothing of the job's runs beside it
    calls: list[Call] = []  # every call into the job's code while it trained, in order: replayed after
    try:
        with contextlib.ExitStack() as stack:
            # starting the sandbox and loading the job's environment run the job's code: its time, its budget
            env = clock.job_code(stack.enter_context, RemoteEnvironment(job_dir, limits=clock.limits(spec),
                                                                        call_timeout_s=clock.call_budget_s))
            clock.watch(env.cpu_seconds)
            info = clock.job_code(env.load)
            clock.job_code(env.checked_rows, info, frozen)  # pages of rows the sandbox serves: the job's time
            clock.job_code(env.checked_samples, frozen)  # the rubric scores the probe's samples as it did
            schemas = frozen.tool_schemas or [s.model_dump() for s in info.tool_schemas]  # checked equal
            turns = min(info.max_turns, config.max_turns)
            left = f" ({len(frozen.left_out)} hidden-eval items among them, rewarded 0)" if frozen.left_out else ""
            print(f"{len(frozen.rows)} rows{left}, tools {', '.join(info.tool_names)}, {turns} of {info.max_turns} "
                  f"turns in training; {config}", flush=True)

            def start_for(index: int):
                prompt = frozen.prompt(index)

                def start():
                    state = clock.job_code(env.start, row_data=frozen.row_data(index))
                    calls.append(Call("start", state, index, (), state))

                    def run_tool(name, arguments):
                        result = clock.job_code(env.tool, state, name, arguments)
                        calls.append(Call("tool", state, index, (name, arguments), result))
                        return result

                    conversation = Conversation(prompt, {}, schemas, turns, run_tool=run_tool)

                    def reward(transcript: list[dict]) -> float:
                        completion = transcript[len(prompt):]
                        score = clock.job_code(env.score, state, completion).reward
                        calls.append(Call("score", state, index, (completion,), score))
                        # a hidden-eval item: rolled out like any row (the job's code cannot tell), rewarded 0, so
                        # that its group has no advantage and trains nothing
                        return score if frozen.trained(index) else 0.0
                    return conversation, reward
                return start

            grpo = GRPOConfig(steps=config.steps, learning_rate=config.learning_rate,
                              prompts_per_step=config.prompts_per_step, group_size=config.group_size,
                              max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, seed=config.seed,
                              dtype=spec.trainer.dtype)
            grpo_trainer = GRPOTrainer(grpo, [Example(start_for(i)) for i in range(len(frozen.rows))])

            def record(step) -> None:
                history.append(step.to_dict())
                print(f"step {step.step}: reward {step.reward_mean:.3f} +- {step.reward_std:.3f}, loss "
                      f"{step.loss:.4f}, {step.seconds_total:.1f} s", flush=True)
                Path(METRICS_FILE).write_text(json.dumps({"steps": history}))
                clock.after_step(step.step, config.steps, seconds=step.seconds_total, work=step_work(step, rates))

            clock.mark()  # from here the trainer's own time is its steps' time less the job's code's in them
            try:
                grpo_trainer.train(on_step=record)
            except TooLarge as exc:  # decided by the job's rows and settings, before the memory is taken
                raise TrainingFailed(f"training stopped at step {grpo_trainer.step_index + 1} of {config.steps}: "
                                     f"{exc}: the job's doing (its prompts, tool results and settings)") from None
            errors = clock.job_code(env.reward_errors)
            if errors:
                print(f"rubric errors (scored 0): {errors[:5]}", flush=True)
        # the replay's time is its own, never the training's: a job's code that used most of its budget in training
        # would otherwise die after it (review ten); a replay over the same budget is not reproducible
        try:
            reproducible = _replayed(job_dir, frozen, calls, clock.fresh(), spec)
        except TrainingFailed as exc:
            reproducible = Reproducible(False, f"the replay ran over the job's code budget: {exc}")
    except JobEnvironmentError as exc:
        where = f" ({exc.file}{f':{exc.line}' if exc.line else ''})" if exc.file else ""
        raise TrainingFailed(f"{exc.message}{where}") from None
    grpo_trainer.save(ADAPTER_DIR)
    print(f"work: {clock.work_s():.0f} s of the reference machine's compute, of a budget of {clock.budget_s:g} s (this "
          f"machine ran it at {clock.speed or 0.0:.2f} times its speed)", flush=True)
    print(f"the job's code {'is' if reproducible.same else 'is not'} reproducible: {reproducible.detail}", flush=True)
    return {"metrics": {"steps": history}, "job_code_seconds": round(clock.job_s, 3),
            "sandbox_idle_cpu_seconds": round(clock.idle_cpu_s, 3), "measures_not_kept": clock.busy_measures,
            "work_seconds": round(clock.work_s(), 3), "machine_speed": round(clock.speed or 0.0, 4),
            "reproducible": reproducible.same, "reproducible_detail": reproducible.detail}


def _compute_of(spec: TrainSpec):
    """The compute dtype and device of ``spec``'s training."""
    from aitrainsai_trainer_local.model import default_device, resolve_dtype

    device = default_device()
    return resolve_dtype(cast("DType", spec.trainer.dtype), device), device


class MachineTooSlow(RuntimeError):
    """The job's work was within its budget but this machine could not run it within the wall-clock net: the
    machine's (infrastructure), not the job's."""


class Clock:
    """Where a job's training time goes, and the budgets that bound it.

    The trainer's own work is counted, never timed: each step's counts (positions, vocabulary rows, attention pairs,
    forward calls) priced at the reference machine's seconds (:mod:`aitrainsai_trainer_local.work`). The trainer is
    deterministic, so a job's work is the same on a fast machine, a slow one or one a neighbour loads; whatever the
    job's prompts and tool results make the trainer do is counted at its cost (a long context's attention, a thousand
    tiny decode steps): past ``WALL_MARGIN`` budgets of it, the job dies, its doing.

    The job's own code (starting its sandbox, loading its environment, rollout starts, tools, rubric) can only be
    timed, call by call: each call has ``call_budget_s``, all of them together the job's wall budget (``spec.wall_s``),
    both stretched by how much the machine's load slows the trainer's kind of work (wall over CPU time of a measure,
    :func:`aitrainsai_trainer_local.load.stretch`: only what takes the CPU counts, never a crowd of waiting processes a
    job can start); either one over is the job's fault (the job dies). The CPU time its sandbox uses between calls (a
    process left running: it can only slow the trainer) counts toward that budget too, where the sandbox's cgroup
    counts it.

    Nets on the wall clock, the machine's and never a verdict on the job: the trainer's own wall time in its steps
    past ``SLOW_NET`` budgets, for work within its budget, is a machine too slow (:class:`MachineTooSlow`, exit
    ``EXIT_INFRA``: infrastructure); past ``HARD_WALL`` budgets of wall time whatever the cause, the sandbox and the
    payload are stopped (a hang)."""

    def __init__(self, budget_s: float, *, wall=time.monotonic, stretch=None, load=None):
        self.budget_s = budget_s
        self.call_s = min(CALL_BUDGET_S, budget_s)
        self.wall = wall  # the clock (a test gives its own)
        self.given_stretch = stretch  # a test's; else the measured one
        if load is None:
            import torch

            from aitrainsai_trainer_local.load import stretch as measured

            def load() -> float:
                return measured(torch.float32, torch.device("cpu"))
        self.measure = load  # the load's stretch now
        self.measures: list[float] = []
        self.job_s = 0.0  # wall seconds in the job's code (and in starting its sandbox)
        self.idle_cpu_s = 0.0  # CPU seconds the job's sandbox used between calls into its code
        self.trainer_s = 0.0  # wall seconds of the trainer's own in its steps (their time less the job's code's)
        self.work = 0.0  # the reference machine's seconds of the trainer's counted work
        self.job_s_marked = 0.0  # job_s when the current step began
        self._sandbox_cpu = None  # the CPU seconds the watched sandbox has used (None where they are not counted)
        self.busy_measures = 0  # measures not kept: the job's sandbox used the CPU while they ran
        self._sandbox_seen = 0.0

    @property
    def call_budget_s(self) -> float:
        """One call's wall-clock budget now: its budget on a quiet machine, stretched by the load (as the probe's)."""
        return float(round(self.call_s * self.stretch()))

    @property
    def speed(self) -> float | None:
        """How fast this machine ran the trainer's work: the reference's seconds of it per wall second here (None
        before any)."""
        return self.work / self.trainer_s if self.trainer_s > 0 else None

    def stretch(self) -> float:
        """How much the machine's load stretches wall time: the median measured so far."""
        if self.given_stretch is not None:
            return float(self.given_stretch())
        if not self.measures:
            self.calibrate()
        return statistics.median(self.measures)

    def calibrate(self) -> None:
        """Measure the load once more. A measure during which the job's sandbox used the CPU is not kept (it is taken
        again, at most ``MEASURE_TRIES`` times): the job's code could otherwise stretch its own budgets by spinning
        beside the measure (review eight)."""
        for _ in range(MEASURE_TRIES):
            before = self._sandbox_now()
            measure = self.measure()
            after = self._sandbox_now()
            if before is None or after is None or after - before <= QUIET_SANDBOX_CPU_S:
                self.measures.append(measure)
                return
            self.busy_measures += 1
        if not self.measures:  # none yet to fall back on (a test's clock without one before the sandbox)
            self.measures.append(measure)

    def limits(self, spec: TrainSpec):
        from aitrainsai import Limits

        # as the probe's sandboxes (each process's CPU time the task's max_wall_seconds, 4 GB by default, /tmp and the
        # output's sizes): nothing there tells training from the probe
        return Limits(wall_s=self.budget_s * HARD_WALL, cpu_s=int(self.budget_s),
                      memory_mb=spec.trainer.memory_gb * 1024)

    def fresh(self) -> Clock:
        """A clock of the same budget on the same machine (its load's stretch), with nothing spent yet."""
        clock = Clock(self.budget_s, wall=self.wall, stretch=self.given_stretch, load=self.measure)
        clock.measures = list(self.measures)
        return clock

    def watch(self, sandbox_cpu) -> None:
        """Count the CPU time ``sandbox_cpu()`` reports (the job's sandbox's, all its processes; None where it is not
        counted) between calls into the job's code as the job's, from now on."""
        self._sandbox_cpu = sandbox_cpu
        self._sandbox_seen = sandbox_cpu() or 0.0

    def _sandbox_now(self) -> float | None:
        return self._sandbox_cpu() if self._sandbox_cpu is not None else None

    def _between_calls(self) -> None:
        """What the sandbox used since the last call ended: outside any call, the job's."""
        now = self._sandbox_now()
        if now is not None:
            self.idle_cpu_s += max(0.0, now - self._sandbox_seen)
            self._sandbox_seen = now

    def job_code(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``, one call into the job's code, timed against the job's budget."""
        self._between_calls()
        began = self.wall()
        try:
            return call(*args, **kwargs)
        finally:  # a call that failed (its own budget ran out) says so itself; one that answered late, here
            self.job_s += self.wall() - began
            self._sandbox_seen = self._sandbox_now() or self._sandbox_seen  # in the call: its wall time counts
            if sys.exc_info()[0] is None:
                self._check_job()

    def _check_job(self) -> None:
        allowed = self.budget_s * self.stretch()  # a loaded machine's wall time is not the job's doing
        spent = self.job_s + self.idle_cpu_s
        if spent > allowed:
            idle = (f" ({self.idle_cpu_s:.0f} s of it its sandbox's CPU time between calls)"
                    if self.idle_cpu_s >= 0.5 else "")
            raise TrainingFailed(f"the job's code (its sandbox's start, its environment's load and rows, its tools, "
                                 f"rubric and rollout starts) took {spent:.0f} s in all{idle}, over its budget of "
                                 f"{allowed:.0f} s")

    def work_s(self) -> float:
        """The trainer's work so far, in the reference machine's seconds."""
        return self.work

    def mark(self) -> None:
        """A step begins: the job's code's time from here on is taken out of the step's."""
        self.job_s_marked = self.job_s

    def after_step(self, step: int, steps: int, *, seconds: float, work: float) -> None:
        """The nets, checked after each step (``seconds``: its wall time; ``work``: its counted work, the reference
        machine's seconds): the job's own time (its sandbox's CPU between calls included), the job's work against
        ``WALL_MARGIN`` budgets (the job's doing), then the trainer's own wall time in its steps (their time less
        the job's code's in them: no wait on the sandbox can count as the machine's) against ``SLOW_NET`` budgets
        (this machine's)."""
        self.trainer_s += max(0.0, seconds - (self.job_s - self.job_s_marked))
        self.work += work
        self._between_calls()
        self._check_job()
        self.calibrate()
        if self.work > self.budget_s * WALL_MARGIN:
            raise TrainingFailed(
                f"training stopped at step {step} of {steps}: its work came to {self.work:.0f} s of the reference "
                f"machine's compute, over {WALL_MARGIN:g} times the budget of {self.budget_s:g} s: the job's doing "
                "(its prompts, tool results and settings decide how much the trainer computes)")
        if self.trainer_s > self.budget_s * SLOW_NET:
            raise MachineTooSlow(
                f"training stopped at step {step} of {steps}: the trainer took {self.trainer_s:.0f} s of wall time, "
                f"over {SLOW_NET:g} times the budget of {self.budget_s:g} s, for work within it ({self.work:.0f} s "
                f"of the reference machine's compute; besides, {self.job_s:.0f} s in the job's code): the machine, "
                "not the job")
        self.mark()


class Call(NamedTuple):
    """One call into the job's code while it trained, and its answer."""

    method: Literal["start", "tool", "score"]
    state: int  # the rollout's state in training's sandbox
    row: int
    args: tuple  # tool: (name, arguments); score: (completion,)
    answer: Any  # start: the state; tool: the result; score: the reward


class Reproducible(NamedTuple):
    same: bool
    detail: str


def _replayed(job_dir: Path, frozen, calls: list[Call], clock: Clock, spec: TrainSpec) -> Reproducible:
    """Whether the job's code gives the same tool results and rewards again: every call training made (``calls``),
    in its order, after the same load, rows and probe samples, in a second, fresh sandbox, later, in another process;
    identical jobs share an outcome only where this holds (a job that reads the time, the process id or
    ``os.urandom``, on any call, would replay one lucky draw: review nine's rubric drew noise on its 32nd to 35th
    calls alone, and a replay of the first and last steps never reached them)."""
    from aitrainsai import RemoteEnvironment, RubricChanged

    with contextlib.ExitStack() as stack:
        env = clock.job_code(stack.enter_context, RemoteEnvironment(job_dir, limits=clock.limits(spec),
                                                                    call_timeout_s=clock.call_budget_s))
        clock.watch(env.cpu_seconds)
        info = clock.job_code(env.load)
        clock.job_code(env.checked_rows, info, frozen)
        try:
            clock.job_code(env.checked_samples, frozen)
        except RubricChanged as exc:
            return Reproducible(False, f"replayed, {exc.message}")
        return replay_calls(env, frozen, calls, clock)


def replay_calls(env, frozen, calls: list[Call], clock: Clock) -> Reproducible:
    """Make ``calls`` again in ``env`` (a :class:`aitrainsai.RemoteEnvironment`, or anything with its ``start``,
    ``tool`` and ``score``), in their order, and compare the answers with the first time's, bit for bit."""
    states: dict[int, int] = {}
    for call in calls:
        if call.method == "start":
            states[call.state] = clock.job_code(env.start, row_data=frozen.row_data(call.row))
        elif call.method == "tool":
            again = clock.job_code(env.tool, states[call.state], *call.args)
            if again != call.answer:
                return Reproducible(False, f"tool {call.args[0]!r} answered a rollout of row {call.row} differently "
                                           "when replayed")
        else:
            score = clock.job_code(env.score, states[call.state], call.args[0]).reward
            if score != call.answer:
                return Reproducible(False, f"the rubric scored a rollout of row {call.row} {call.answer:g}, then "
                                           f"{score:g} when replayed")
    return Reproducible(True, f"{len(calls)} calls into the job's code ({len(states)} rollouts) replayed in their "
                              "order in a fresh sandbox gave the same tool results and rewards")


def _evaluate(family: TaskFamily, spec: EvalSpec, adapter: Path | None) -> EvalResult:
    """The core's hidden eval (:func:`aitrainsai.evaluation.evaluate_family`) of the base model or ``adapter`` through
    this trainer's engine: one code path for pre and post, with the same settings."""
    from aitrainsai import evaluate_family
    from aitrainsai_trainer_local.engine import LocalChatEngine
    from aitrainsai_trainer_local.lora import LoraModel

    trainer = spec.trainer
    policy = LoraModel.load(adapter=adapter, dtype=cast("DType", trainer.dtype))  # the config's pattern: a DType
    engine = LocalChatEngine(policy, max_new_tokens=trainer.eval_max_new_tokens, batch_size=trainer.eval_batch_size)
    return evaluate_family(family, spec.level, engine, eval_size=spec.eval_size)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if len(sys.argv) != 2:
        print("usage: python -m aitrainsai_trainer_local.job job.json", flush=True)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
