"""One outer episode: the agent writes a job in its workspace, the probe checks it, the job trains through a GPU
backend, and the reward spec turns the outcome into the episode's reward. Every step goes into the run ledger."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from collections.abc import Callable

from aitrainsai.families import Constraints
from aitrainsai.jobs.job import job_design, job_template, verify_job
from aitrainsai.jobs.probe import probe_job
from aitrainsai.run.ledger import LedgerError
from aitrainsai.run.record import EpisodeError, JobRerun, Reward
from aitrainsai.parsing import UntrustedInputError, check_value, load_json
from aitrainsai.rewards import EpisodeRecord, ProbeAttempt
from aitrainsai.tools import call_tool, tool_schema
from aitrainsai.trainers import (
    AgentOutcome,
    AgentTask,
    AgentTurn,
    Baseline,
    SampleMode,
    StopRun,
    TrainOutcome,
    TrainResult,
)
from aitrainsai.jobs.workspace import Workspace

from aitrainsai.backends import JobHandle

if TYPE_CHECKING:
    from aitrainsai.backends import GpuBackend, JobPayload, JobResult
    from aitrainsai.evaluation import EvalResult
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.run.ledger import Ledger, Run
    from aitrainsai.reward_spec import RewardSpec
    from aitrainsai.trainers import InnerTrainer

AGENT_ROLE = """You are an ML engineer. You write training jobs that teach a small language model a task with
reinforcement learning (GRPO). A job is four files in your workspace: environment.py (a verifiers environment with the
task's eval interface), rubric.py (the reward functions GRPO maximises), dataset.py (the training rows) and
trainer.toml (the trainer config). Your workspace starts with a working job; use the tools to improve it, then call
submit_job: a probe validates the job and tells you what to fix; an accepted job trains the model, which is then
scored on a hidden eval you never see."""

AGENT_ROLE_COMPACT = """You are an ML engineer. Your workspace holds a working job that trains a small model on a task
with GRPO. Improve it, then call submit_job: a probe checks the job; an accepted job trains the model, then a hidden
eval scores it."""

TaskView = Literal["full", "compact"]


AGENT_ARGUMENT_CHARS = 2_000_000  # write_file carries whole files; the workspace enforces its own caps
AGENT_RESULT_CHARS = 100_000
MAX_STORED_MESSAGE = 2 * AGENT_ARGUMENT_CHARS + 100_000  # what one message may add to the ledger
MAX_STORED_TEXT = AGENT_ARGUMENT_CHARS + 1_000
MAX_LOST_RERUNS = 2  # a payload whose worker vanished (a node died, a head restarted) is run again this often


class Policy(Protocol):
    async def sample(self, messages: list[dict[str, Any]], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn: ...


class SubmitFiles:
    """A scripted agent: writes the given files (the task's template where none is given) and submits once."""

    def __init__(self, files: dict[str, str] | None = None):
        self.files = dict(files or {})

    async def sample(self, messages: list[dict[str, Any]], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        if any(m.get("role") == "tool" for m in messages):
            return AgentTurn(message={"role": "assistant", "content": "Submitted."})
        files = {**task.template, **self.files}
        calls = [{"id": f"w{i}", "type": "function",
                  "function": {"name": "write_file", "arguments": json.dumps({"path": name, "content": text})}}
                 for i, (name, text) in enumerate(files.items())]
        calls.append({"id": "submit", "type": "function", "function": {"name": "submit_job", "arguments": "{}"}})
        return AgentTurn(message={"role": "assistant", "content": "Writing the job.", "tool_calls": calls})


class Baselines:
    """Untrained hidden-eval scores, computed once per key and cached in the ledger; concurrent requests for the same
    key share one computation. The key holds every setting that changes a score: the trainer and its evaluation
    settings (:meth:`InnerTrainer.eval_settings`), the family's version, level, eval seed and size, the base model."""

    def __init__(self, ledger: Ledger, trainer: InnerTrainer, backend: GpuBackend, workdir: Path, *,
                 payload_env: dict[str, str] | None = None):
        self.ledger = ledger
        self.trainer = trainer
        self.backend = backend
        self.workdir = Path(workdir)
        self.payload_env = dict(payload_env or {})
        self._pending: dict[str, asyncio.Future] = {}

    def key(self, family: TaskFamily, level: int, base: str) -> str:
        from aitrainsai.evaluation import family_version

        settings = json.dumps(self.trainer.eval_settings(base), sort_keys=True, separators=(",", ":"))
        return (f"{self.trainer.name}|{family.name}|{level}|{base}|{family.eval_seed}|{self.trainer.eval_size}|"
                f"family={family_version(family)}|{settings}")

    async def get(self, family: TaskFamily, level: int, base: str) -> Baseline:
        key = self.key(family, level, base)
        cached = self.ledger.baseline(key)
        if cached is not None:
            return Baseline(family=family.name, level=level, base_model=base, eval_seed=family.eval_seed,
                            eval_size=self.trainer.eval_size, score=cached["score"], item_scores=cached["item_scores"],
                            engine=cached["engine"])
        if key not in self._pending:
            self._pending[key] = asyncio.ensure_future(self._compute(family, level, base, key))
        try:
            return await asyncio.shield(self._pending[key])
        finally:
            if self._pending.get(key) is not None and self._pending[key].done():
                self._pending.pop(key, None)

    async def _compute(self, family: TaskFamily, level: int, base: str, key: str) -> Baseline:
        import hashlib

        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        job_id = f"baseline-{family.name}-{level}-{base.replace('/', '_')}-{digest}"
        workdir = self.workdir / job_id
        if workdir.exists():
            shutil.rmtree(workdir)
        payload = with_env(self.trainer.eval_payload(family, level, base, None, workdir, job_id), self.payload_env)
        outcome = await self.backend.run(payload)
        if outcome.status != "done":
            raise RuntimeError(f"baseline of {base} on {family.name} died: {outcome.why}\n{outcome.log_tail[-1500:]}")
        try:  # off the event loop: a trainer may score many transcripts here
            scores = await asyncio.to_thread(self.trainer.eval_result, outcome, family=family, level=level,
                                             base_model=base)
            check_value(scores.item_scores, what="item scores")  # finite: a NaN would become every episode's reward
        except Exception as exc:  # noqa: BLE001 - unreadable scores fail this baseline with the reason, one line
            raise RuntimeError(f"baseline of {base} on {family.name}: unreadable evaluation: {exc}") from None
        baseline = Baseline(family=family.name, level=level, base_model=base, eval_seed=scores.eval_seed,
                            eval_size=scores.eval_size, score=scores.score, item_scores=scores.item_scores,
                            engine=scores.engine)
        self.ledger.save_baseline(key, family=family.name, level=level, base_model=base, eval_seed=family.eval_seed,
                                  eval_size=baseline.eval_size, score=baseline.score, item_scores=baseline.item_scores,
                                  engine=baseline.engine.model_dump(mode="json") if baseline.engine else None)
        return baseline

    async def all(self, family: TaskFamily, level: int, bases: list[str]) -> dict[str, Baseline]:
        values = await asyncio.gather(*(self.get(family, level, base) for base in bases))
        return dict(zip(bases, values))


@dataclass
class EpisodeContext:
    """What every episode of a run shares."""

    run: Run
    trainer: InnerTrainer
    backend: GpuBackend
    reward_spec: RewardSpec
    baselines: Baselines
    hide: list[Path]
    payload_env: dict[str, str] = field(default_factory=dict)  # added to every payload (the plugin selection)
    max_agent_turns: int = 16
    task_view: TaskView = "full"  # the opening the agent reads (Episode.opening_messages)
    probe_wall_s: float = 90.0
    train_jobs: bool = True  # False: an accepted job is frozen and recorded, not trained (status "validated")


@dataclass
class EpisodeResult:
    id: str
    family: str
    reward: float
    components: dict[str, float]
    record: EpisodeRecord
    turns: list[AgentTurn]
    train: TrainResult | None = None
    status: str = ""


class Episode:
    def __init__(self, context: EpisodeContext, family: TaskFamily, level: int, episode_id: str,
                 step: int | None = None, group_id: str | None = None):
        self.context = context
        self.family = family
        self.level = level
        self.id = episode_id
        self.step = step
        self.group_id = group_id
        self.run = context.run
        self.dir = self.run.dir / "episodes" / episode_id
        self.workspace = Workspace(self.dir / "workspace")
        trainer = context.trainer
        self.spec: TaskSpec = family.task_spec(level, trainer.constraints(Constraints()))
        self.messages: list[dict[str, Any]] = []
        self.turns: list[AgentTurn] = []
        self.attempts: list[ProbeAttempt] = []
        self.parsed_submission = False
        self.accepted_job: Path | None = None
        self.accepted_digest: str | None = None
        self.accepted_design: dict[str, Any] = {}  # what the accepted job chose (jobs.job_design): for the report
        self._baselines: dict[str, Baseline] | None = None

    # -- the agent's tools -----------------------------------------------------------------------------------------
    def agent_tools(self) -> dict[str, Any]:
        ws = self.workspace

        async def get_baseline_scores() -> str:
            """Untrained hidden-eval score of each allowed base model on this task (numbers only)."""
            scores = await self._baseline_scores()
            return json.dumps({base: round(b.score, 4) for base, b in scores.items()})

        async def submit_job() -> str:
            """Validate the job in the workspace; an accepted job goes to training and ends the episode."""
            return await self._submit()

        return {"read_file": ws.read_file, "write_file": ws.write_file, "edit_file": ws.edit_file,
                "list_files": ws.list_files, "get_baseline_scores": get_baseline_scores, "submit_job": submit_job}

    def tool_schemas(self) -> list[dict]:
        return [tool_schema(fn) for fn in self.agent_tools().values()]

    def template(self) -> dict[str, str]:
        return job_template(self.spec, self.context.trainer.config_template(self.spec))

    def task(self) -> AgentTask:
        c = self.spec.constraints
        return AgentTask(family=self.family.name, level=self.level, levels=list(self.family.levels),
                         held_out=self.family.held_out,
                         template=self.template(), family_module=self.spec.public_modules[0],
                         allowed_bases=list(c.allowed_bases),
                         max_train_steps=c.max_train_steps, max_dataset_size=c.max_dataset_size)

    def opening_messages(self) -> list[dict[str, Any]]:
        """The system and user messages the agent starts from, in the run's view (``loop.task_view``): ``full``, the
        whole spec, the template's files and the trainer.toml schema; ``compact``, :meth:`compact_opening`."""
        if self.context.task_view == "compact":
            return self.compact_opening()
        template = self.template()
        files = "\n\n".join(f"### {name}\n```\n{text}```" for name, text in template.items())
        system = f"{AGENT_ROLE}\n\n{self.context.reward_spec.agent_text()}"
        user = (f"{self.spec.render()}\n## Job template (a working job; improve it)\n\n{files}\n\n"
                f"The trainer config schema (trainer.toml): {json.dumps(_schema_summary(self.context.trainer))}\n\n"
                "Your workspace already holds these four files. Improve them with edit_file or write_file, "
                "then call submit_job.")
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def compact_opening(self) -> list[dict[str, Any]]:
        """The opening in about a quarter of the full view's size, from the same spec and template: the spec in brief
        (:meth:`TaskSpec.render_compact`), the workspace's files by name with their purpose and the names they
        define (``read_file`` gives the text), and trainer.toml's keys, each with its value and what it may be."""
        template = self.template()
        files = "\n".join(f"- {name}: {_file_summary(name, text)}" for name, text in template.items())
        keys = "\n".join(_config_lines(self.context.trainer, template.get("trainer.toml", "")))
        system = f"{AGENT_ROLE_COMPACT}\n\n{_compact_reward_text(self.context.reward_spec)}"
        user = (f"{self.spec.render_compact()}\nYour workspace holds a working job (read_file gives a file's text):\n"
                f"{files}\n\ntrainer.toml now (allowed; meaning):\n{keys}\n\n"
                "Improve the job with edit_file (write_file for a whole file), then call submit_job.")
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    # -- the episode -----------------------------------------------------------------------------------------------
    async def play(self, policy: Policy, *, mode: SampleMode = "train", eval_seed: int | None = None) -> EpisodeResult:
        """The whole episode: the agent writes and submits a job, the job trains, the reward is recorded. ``mode`` is
        the policy's sampling mode (``"eval"``: an evaluation episode no update sees, sampled with ``eval_seed``)."""
        self.run.reset_episode(self.id)
        self.run.upsert_episode(self.id, status="agent", step=self.step, family=self.family.name, level=self.level,
                                group_id=self.group_id)
        self._start_workspace()
        opening = self.opening_messages()
        for message in opening:
            self._say(message)
        self._record_prompt(opening)
        try:
            await self._agent_phase(policy, mode, eval_seed)
        except (LedgerError, StopRun):  # the run stops; this episode is replayed when it resumes
            raise
        except Exception as exc:  # noqa: BLE001 - one episode's failure stays in that episode
            self.run.record(EpisodeError(episode=self.id, phase="agent", error=_error_text(exc)))
        return await self._finish()

    async def play_agent(self, policy: Policy, *, mode: SampleMode = "eval",
                         eval_seed: int | None = None) -> AgentOutcome:
        """The agent side alone, to measure an agent: the workspace, the opening, the turns until a submission is
        accepted, the attempts run out or a turn makes no call; an accepted job is not trained, and nothing goes to
        the run's episode table."""
        began = time.monotonic()
        self._start_workspace()
        for message in self.opening_messages():
            self._say(message)
        await self._agent_phase(policy, mode, eval_seed)
        record = EpisodeRecord(family=self.family.name, level=self.level, parsed_submission=self.parsed_submission,
                               attempts=self.attempts, max_attempts=self.context.reward_spec.max_attempts,
                               train_budget_seconds=self.spec.constraints.max_wall_seconds)
        reward, _ = self.context.reward_spec.reward(record)
        results = _turn_results(self.messages)
        return AgentOutcome(family=self.family.name, episode=self.id, turns=len(self.turns),
                            failed_turns=results.count("failed"),
                            recovered=sum(a == "failed" and b == "ok" for a, b in zip(results, results[1:])),
                            parsed_turns=sum(t.parse_error is None for t in self.turns),
                            call_turns=sum(bool(t.message.get("tool_calls")) for t in self.turns),
                            submitted=self.parsed_submission,
                            first_accepted=bool(self.attempts) and self.attempts[0].ok,
                            accepted=self.accepted_job is not None, reward=reward,
                            seconds=round(time.monotonic() - began, 1))

    def _record_prompt(self, opening: list[dict[str, Any]]) -> None:
        """The exact prompt the agent sees, once per family and run (:meth:`Run.record_agent_prompt`): the report
        publishes it beside the trained policy, which never travels without the view it was trained on."""
        self.run.record_agent_prompt(self.family.name, {
            "family": self.family.name, "level": self.level, "episode": self.id, "messages": opening,
            "tools": self.tool_schemas()})

    def _start_workspace(self) -> None:
        """The workspace starts as the task spec describes it: the template's files, a working job to improve."""
        if self.workspace.root.exists():
            shutil.rmtree(self.workspace.root)
        self.workspace = Workspace(self.workspace.root)
        for name, text in self.template().items():
            self.workspace.write_file(name, text)

    async def resume(self) -> EpisodeResult:
        """Finish an episode a killed run left in training: reattach to its job (or rerun it if lost)."""
        row = next(e for e in self.run.episodes() if e["id"] == self.id)
        data = row["data"]
        self.turns = [AgentTurn.model_validate(t) for t in data.get("turns", [])]
        self.attempts = [ProbeAttempt(attempt=p["attempt"], ok=bool(p["ok"]), problems=p["problems"])
                         for p in self.run.probes(self.id)]
        self.parsed_submission = True
        self.accepted_job = Path(data["frozen_job"])
        self.accepted_digest = data.get("frozen_digest")
        self.accepted_design = data.get("design") or {}
        job = next((j for j in self.run.jobs() if j["id"] == self.job_id), None)
        return await self._finish(job)

    @property
    def job_id(self) -> str:
        return f"{self.id}-job"

    async def _finish(self, job: dict[str, Any] | None = None) -> EpisodeResult:
        record = EpisodeRecord(family=self.family.name, level=self.level, parsed_submission=self.parsed_submission,
                               attempts=self.attempts, max_attempts=self.context.reward_spec.max_attempts,
                               train_budget_seconds=self.spec.constraints.max_wall_seconds)
        train: TrainResult | None = None
        if self.accepted_job is not None and self.context.train_jobs:
            try:
                record, train = await self._job_phase(record, job)
            except LedgerError:
                raise  # the run's own records failed: not this episode's doing
            except Exception as exc:  # noqa: BLE001 - a crash on the agent's job is that job's death, not the run's
                reason = f"the job could not be run: {_error_text(exc)}"
                self.run.upsert_job(self.job_id, status="dead", episode_id=self.id, result={"reason": reason})
                self.run.record(EpisodeError(episode=self.id, phase="job", error=reason))
                record = record.model_copy(update={"job_status": "dead"})
        reward, components = self.context.reward_spec.reward(record)
        status = ("no_submission" if not self.parsed_submission else "invalid" if self.accepted_job is None
                  else "validated" if not self.context.train_jobs else record.job_status)
        with self.run.transaction():  # the reward and its event together: a kill between them loses or doubles it
            self.run.upsert_episode(self.id, status=status, reward=reward, data={
                "components": components, "record": record.model_dump(mode="json"),
                "turns": [t.model_dump(mode="json") for t in self.turns],
                "train": train.model_dump(mode="json") if train else None,
                **(self._frozen_fields() if self.accepted_job is not None else {})})
            self.run.record(Reward(episode=self.id, family=self.family.name, step=self.step, total=reward,
                                   components=components))
        return EpisodeResult(self.id, self.family.name, reward, components, record, self.turns, train, status)

    async def _agent_phase(self, policy: Policy, mode: SampleMode = "train", eval_seed: int | None = None) -> None:
        tools = self.agent_tools()
        schemas = self.tool_schemas()
        task = self.task()
        if mode == "eval":  # the loop gives the seed; other callers: the id's part after its prefix ("check-")
            seed = eval_seed if eval_seed is not None else zlib.crc32(self.id.partition("-")[2].encode())
            task = task.model_copy(update={"eval_seed": seed})
        for _ in range(self.context.max_agent_turns):
            # train is every policy's default: scripted test policies that take no mode still play training episodes
            turn = await (policy.sample(list(self.messages), schemas, task) if mode == "train"
                          else policy.sample(list(self.messages), schemas, task, mode=mode))
            if _size(turn.message) > MAX_STORED_MESSAGE:
                turn = turn.model_copy(update={"message": _capped(turn.message)})
            self.turns.append(turn)
            self._say(turn.message)
            if turn.parse_error:
                self._say({"role": "user", "content": f"error: your reply could not be parsed: {turn.parse_error}"})
            if turn.end:
                return
            if turn.parse_error:
                continue
            calls = turn.message.get("tool_calls") or []
            if not calls:
                return
            for call in calls:
                function = call.get("function") or {}
                name = function.get("name")
                if name == "submit_job" and isinstance(_arguments(function.get("arguments")), dict):
                    self.parsed_submission = True
                result = await _call(tools, name, function.get("arguments"))
                self._say({"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": result})
                if self.accepted_job is not None or len(self.attempts) >= self.context.reward_spec.max_attempts:
                    return

    async def _submit(self) -> str:
        attempt = len(self.attempts) + 1
        out_dir = self.dir / f"probe-{attempt}"
        if out_dir.exists():
            shutil.rmtree(out_dir)
        report = await asyncio.to_thread(probe_job, self.workspace.root, out_dir, self.spec, self.family,
                                          self.context.trainer, hide=self.context.hide,
                                          wall_s=self.context.probe_wall_s)
        problems = [str(p) for p in report.problems]
        self.attempts.append(ProbeAttempt(attempt=attempt, ok=report.ok, problems=problems))
        self.run.add_probe(self.id, attempt, report.ok, problems, report.seconds)
        if report.ok:
            assert report.job_dir is not None  # an accepted probe froze the job
            self.accepted_job = report.job_dir
            self.accepted_digest = report.digest
            self.accepted_design = job_design(report.job_dir, report.details)
            return f"{report.text()}; job id {self.job_id}"
        left = self.context.reward_spec.max_attempts - attempt
        attempts = f"\n({left} attempt{'s' if left != 1 else ''} left)" if left else "\n(no attempts left)"
        return report.text() + attempts

    def _frozen_fields(self) -> dict[str, Any]:
        return {"frozen_job": str(self.accepted_job), "frozen_digest": self.accepted_digest,
                "design": self.accepted_design}

    async def _baseline_scores(self) -> dict[str, Baseline]:
        if self._baselines is None:
            self._baselines = await self.context.baselines.all(self.family, self.level,
                                                               self.spec.constraints.allowed_bases)
        return self._baselines

    async def _job_phase(self, record: EpisodeRecord, job: dict[str, Any] | None = None
                         ) -> tuple[EpisodeRecord, TrainResult | None]:
        """Train the accepted job into a checkpoint (one payload), then score the checkpoint on the hidden eval (a
        second payload, which starts only once every process of the first has ended and never sees the job's code).
        The job's ledger row follows it: queued, running, evaluating, done or dead; on resume (``job``: that row) a
        finished phase is not run again and a running one is reattached (rerun only if the backend lost it)."""
        context = self.context
        job_id = self.job_id
        job_dir = self.accepted_job
        assert job_dir is not None  # only an accepted job is trained
        verify_job(job_dir, self.accepted_digest)  # before anything reads the job (it is read again below)
        baselines = await self._baseline_scores()
        base = context.trainer.job_base_model(job_dir)
        stored = (job or {}).get("result") or {}
        baseline_scores = {b: v.score for b, v in baselines.items()}
        record = record.model_copy(update={"base_model": base, "baseline_scores": baseline_scores,
                                           "pre": baselines[base].score})
        spent = {"cost_usd": float((job or {}).get("cost_usd") or 0.0),
                 "wall_s": float((job or {}).get("wall_s") or 0.0)}
        train = TrainOutcome.model_validate(stored["train"]) if stored.get("train") else None
        if train is None:
            def training_payload() -> JobPayload:
                verify_job(job_dir, self.accepted_digest)
                return context.trainer.payload(job_dir, self.spec, job_id, family=self.family)

            def queued(payload: JobPayload) -> None:
                self.run.upsert_episode(self.id, status="training", data={
                    "turns": [t.model_dump(mode="json") for t in self.turns], **self._frozen_fields()})
                self.run.upsert_job(job_id, status="queued", episode_id=self.id, backend=context.backend.name,
                                    result={"payload": payload.model_dump(mode="json")})

            def started(handle: JobHandle) -> None:
                self.run.upsert_job(job_id, status="running", handle=handle.model_dump(mode="json"))

            handle = JobHandle.model_validate(job["handle"]) if job and job.get("handle") else None
            outcome = await self._run_payload(handle, training_payload, queued, started)
            spent = _add(spent, outcome)
            if outcome.status == "done":
                try:
                    train = context.trainer.result(outcome)
                except Exception as exc:  # outputs missing or malformed: the job is dead, not the run
                    outcome = outcome.model_copy(update={"status": "dead", "reason": "artifact",
                                                         "detail": f"unreadable result: {exc}"})
            if train is None:
                return self._dead(record, outcome, spent), None
            self.run.upsert_job(job_id, status="evaluating", cost_usd=spent["cost_usd"], wall_s=spent["wall_s"],
                                result={"train": train.model_dump(mode="json"), "log_tail": outcome.log_tail[-4000:]})

        eval_id = f"{job_id}-eval"

        def evaluation_payload() -> JobPayload:
            return context.trainer.eval_payload(self.family, self.level, base, train.checkpoint,
                                                self.dir / "eval", eval_id)

        def eval_queued(payload: JobPayload) -> None:
            self.run.upsert_job(job_id, status="evaluating", result={"eval_payload": payload.model_dump(mode="json")})

        def eval_started(handle: JobHandle) -> None:
            self.run.upsert_job(job_id, status="evaluating", result={"eval_handle": handle.model_dump(mode="json")})

        handle = JobHandle.model_validate(stored["eval_handle"]) if stored.get("eval_handle") else None
        outcome = await self._run_payload(handle, evaluation_payload, eval_queued, eval_started)
        spent = _add(spent, outcome)
        result: TrainResult | None = None
        if outcome.status == "done":
            try:
                post = await asyncio.to_thread(context.trainer.eval_result, outcome, family=self.family,
                                                 level=self.level, base_model=base)  # off the loop: it may be slow
                check_value(post.item_scores, what="item scores")
                result = compare(baselines[base], post, train)
            except EngineMismatch as exc:
                outcome = outcome.model_copy(update={"status": "dead", "reason": "infra", "detail": str(exc)})
            except Exception as exc:  # noqa: BLE001 - unreadable scores: the job is dead, not the run
                outcome = outcome.model_copy(update={"status": "dead", "reason": "artifact",
                                                     "detail": f"unreadable evaluation: {exc}"})
        if result is None:
            return self._dead(record, outcome, spent, phase="evaluation"), None
        self.run.upsert_job(job_id, status="done", cost_usd=spent["cost_usd"], wall_s=spent["wall_s"], result={
            "reason": "", "eval_log_tail": outcome.log_tail[-4000:], **result.model_dump(mode="json")})
        record = record.model_copy(update={"job_status": "done", "post": result.post,
                                           "train_seconds": result.train_seconds})
        return record, result

    async def _run_payload(self, handle: JobHandle | None, make: Callable[[], JobPayload],
                           queued: Callable[[JobPayload], None], started: Callable[[JobHandle], None]
                           ) -> JobResult:
        """Wait for a payload submitted earlier (``handle``), or submit a new one. A lost one (its worker vanished,
        or the backend no longer knows it) is submitted again, at most ``MAX_LOST_RERUNS`` times."""
        backend = self.context.backend
        outcome = await backend.wait(handle) if handle is not None else None
        reruns = 0
        while outcome is None or (outcome.status == "dead" and outcome.reason == "lost" and reruns < MAX_LOST_RERUNS):
            if outcome is not None:
                reruns += 1
                self.run.record(JobRerun(job=outcome.job_id, reason=f"lost: {outcome.detail}"[:500], rerun=reruns))
            payload = with_env(make(), self.context.payload_env)
            queued(payload)
            handle = await backend.submit(payload)
            started(handle)
            outcome = await backend.wait(handle)
        return outcome

    def _dead(self, record: EpisodeRecord, outcome: JobResult, spent: dict[str, float], phase: str = "training"
              ) -> EpisodeRecord:
        why = outcome.why if phase == "training" else f"{phase}: {outcome.why}"
        log = "log_tail" if phase == "training" else "eval_log_tail"  # the training log stays where it was
        self.run.upsert_job(self.job_id, status="dead", cost_usd=spent["cost_usd"], wall_s=spent["wall_s"], result={
            "reason": why, "dead_reason": outcome.reason, log: outcome.log_tail[-4000:]})
        return record.model_copy(update={"job_status": "dead"})

    def _say(self, message: dict[str, Any]) -> None:
        if _size(message) > MAX_STORED_MESSAGE:
            message = _capped(message)
        self.messages.append(message)
        self.run.add_message(self.id, message)


class EngineMismatch(ValueError):
    """Pre and post were scored with different evaluation settings: they cannot be compared."""


def compare(baseline: Baseline, post: EvalResult, train: TrainOutcome) -> TrainResult:
    """The trained job's outcome: the untrained base's scores (pre) against the checkpoint's (post), item by item,
    when both came from the same evaluation settings."""
    from aitrainsai.evaluation import paired_bootstrap

    if baseline.engine is not None and post.engine != baseline.engine:
        raise EngineMismatch(f"pre was scored with {baseline.engine.key()}, post with {post.engine.key()}")
    if len(post.item_scores) != len(baseline.item_scores):
        raise ValueError(f"post has {len(post.item_scores)} item scores, pre {len(baseline.item_scores)}")
    low, high = paired_bootstrap(baseline.item_scores, post.item_scores)
    return TrainResult(base_model=baseline.base_model, pre=baseline.score, post=post.score,
                       uplift=post.score - baseline.score, uplift_ci=(low, high), eval_size=post.eval_size,
                       train_seconds=train.train_seconds,
                       metrics={**train.metrics, "post_item_scores": post.item_scores,
                                "engine": post.engine.model_dump(mode="json")})


def _add(spent: dict[str, float], outcome: JobResult) -> dict[str, float]:
    return {"cost_usd": spent["cost_usd"] + outcome.cost_usd, "wall_s": spent["wall_s"] + outcome.wall_s}


def with_env(payload: JobPayload, env: dict[str, str]) -> JobPayload:
    """``payload`` with ``env`` added to its environment (what the run applies in every payload process); the run's
    plugin selection and versions narrowed to the distributions its runtime names, where it names any."""
    if not env:
        return payload
    if payload.runtime.distributions:
        from aitrainsai.plugins import narrow_plugin_env

        env = narrow_plugin_env(env, payload.runtime.distributions)
    return payload.model_copy(update={"env": {**payload.env, **env}})


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _size(message: dict[str, Any]) -> int:
    """An upper bound of the message's stored size, computed without serialising it."""
    total = len(str(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        total += len(str(function.get("arguments") or "")) if isinstance(function, dict) else len(str(call))
    return total + 1_000 * len(message)


def _capped(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its texts cut to a total of ``MAX_STORED_MESSAGE`` characters, so that one huge reply cannot
    grow the ledger past a bound. A cut tool call's arguments are no longer JSON: the call is answered with an error,
    as an oversized one would be; calls past the budget are dropped (and so never run)."""
    budget = [MAX_STORED_MESSAGE]

    def cut(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        keep = max(0, min(len(value), MAX_STORED_TEXT, budget[0]))
        budget[0] -= keep
        return value if keep == len(value) else value[:keep] + f"...[{len(value)} characters cut]"

    capped = {k: cut(v) for k, v in message.items() if k != "tool_calls"}
    if "tool_calls" in message:
        calls = []
        for call in message.get("tool_calls") or []:
            if budget[0] <= 0:
                break
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                calls.append({**{k: cut(v) for k, v in call.items() if k != "function"},
                              "function": {k: cut(v) for k, v in call["function"].items()}})
        capped["tool_calls"] = calls
    return capped


def _turn_results(messages: list[dict[str, Any]]) -> list[str]:
    """Per assistant turn: "failed" (it did not parse, or a call of it was answered "error: ..."), "ok" (calls that
    all succeeded) or "none" (no call)."""
    out: list[str] = []
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            answers = []
            for reply in messages[index + 1:]:
                if reply.get("role") not in ("tool", "user"):
                    break
                answers.append(str(reply.get("content", "")))
            out.append("failed" if any(a.startswith("error: ") for a in answers)
                       else "ok" if message.get("tool_calls") else "none")
    return out


async def _call(tools: dict[str, Any], name: Any, arguments: Any) -> str:
    fn = tools.get(name) if isinstance(name, str) else None
    if fn is not None and asyncio.iscoroutinefunction(fn):
        parsed = _arguments(arguments)
        if not isinstance(parsed, dict):
            return "error: arguments must be a JSON object"
        if parsed:
            return f"error: {name} takes no arguments"
        try:
            return await fn()
        except Exception as exc:  # a failing baseline or probe is reported to the agent, not raised
            return f"error: {name} failed: {exc}"
    return call_tool(tools, name, arguments, max_argument_chars=AGENT_ARGUMENT_CHARS,
                     max_result_chars=AGENT_RESULT_CHARS)


def _arguments(arguments: Any) -> Any:
    if arguments in (None, ""):
        return {}
    if isinstance(arguments, str):
        try:
            return load_json(arguments, what="arguments", max_bytes=AGENT_ARGUMENT_CHARS)
        except UntrustedInputError:
            return None
    return arguments


def _schema_summary(trainer: InnerTrainer) -> dict[str, Any]:
    schema = trainer.JobConfig.model_json_schema()
    return {name: {k: v for k, v in prop.items() if k in ("type", "default", "minimum", "maximum", "description")}
            for name, prop in schema.get("properties", {}).items()}


_SHOWN_VALUE_CHARS = 40  # a template constant whose value is longer is named without it
_KINDS = {"integer": "int", "number": "float", "string": "str", "boolean": "bool"}


def _file_summary(name: str, text: str) -> str:
    """One line on a template file: its purpose (its docstring's first line, to the first colon) and what it sets:
    its constants (the short ones with their values), else its functions. trainer.toml: a pointer to its keys."""
    import ast

    if name.endswith(".toml"):
        return "the trainer config; its keys are below."
    try:
        tree = ast.parse(text) if name.endswith(".py") else None
    except SyntaxError:
        tree = None
    if tree is None:
        return f"{len(text.splitlines())} lines."
    constants, functions = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(f"{node.name}()")
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id.isupper()
              and isinstance(node.value, (ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Set))):
            value = ast.get_source_segment(text, node.value) or ""
            short = len(value) <= _SHOWN_VALUE_CHARS and "\n" not in value
            constants.append(f"{node.targets[0].id} = {value}" if short else node.targets[0].id)
    docstring = (ast.get_docstring(tree) or "").strip().splitlines()
    purpose = docstring[0].split(": ")[0].rstrip(".") + "." if docstring else ""  # "Training rows: build() ..."
    sets = f"Sets {', '.join(constants)}." if constants else f"Defines {', '.join(functions)}." if functions else ""
    return " ".join(part for part in (purpose, sets) if part)


def _config_lines(trainer: InnerTrainer, toml_text: str) -> list[str]:
    """trainer.toml's keys, one line each: the template's value, then what the trainer's schema allows (base_model:
    a base the hard constraints list) and what the key means."""
    import tomllib

    try:
        values = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError:
        values = {}
    lines = []
    for name, prop in trainer.JobConfig.model_json_schema().get("properties", {}).items():
        value = values.get(name, prop.get("default"))
        allowed = "an allowed base model" if name == "base_model" else _allowed(prop)
        about = str(prop.get("description") or "").split(";")[0].strip()
        lines.append(f"{name} = {json.dumps(value)} ({allowed}{'; ' + about if about else ''})")
    return lines


def _allowed(prop: dict[str, Any]) -> str:
    """What a JSON schema property allows, in a few words: the choices, or the type and its bounds."""
    if "enum" in prop:
        return "one of " + ", ".join(json.dumps(v) for v in prop["enum"])
    kinds = [prop["type"]] if "type" in prop else [p.get("type", "?") for p in prop.get("anyOf", [])]
    kind = "/".join(_KINDS.get(str(k), str(k)) for k in kinds) or "any"
    if "minimum" in prop and "maximum" in prop:
        return f"{kind} {_number(prop['minimum'])}..{_number(prop['maximum'])}"
    bounds = [f"{sign}{_number(prop[key])}" for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                             ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in prop]
    return " ".join([kind, *bounds])


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _compact_reward_text(spec: RewardSpec) -> str:
    """The reward in brief: the formula, a component's ``description`` where it has one, the rule for no submission
    and the attempts allowed (:meth:`RewardSpec.agent_text` explains every component in full)."""
    lines = [f"How you are rewarded: {spec.formula()}."]
    lines += [f"{term.component}: {type(component).description}" for term, component in spec.components
              if type(component).description]
    lines.append(f"With no submit_job call that parses, the reward is {spec.data.no_submission:g}. You have "
                 f"{spec.max_attempts} submit_job attempts; the first accepted one ends the episode.")
    return "\n".join(lines)
