"""One outer episode: the agent writes a job in its workspace, the probe checks it, the job trains through a GPU
backend (:mod:`~aitrainsai.run.job_phase`), and the reward spec turns the outcome into the episode's reward. Every step
goes into the run ledger."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitrainsai.chat import Message
from aitrainsai.families import Constraints
from aitrainsai.jobs.job import job_design, job_template
from aitrainsai.jobs.probe import SharedVerdicts, probe_job
from aitrainsai.jobs.workspace import Workspace
from aitrainsai.rewards import EpisodeOutcome, ProbeAttempt
from aitrainsai.run.job_phase import AcceptedJob, JobOutcome, JobPhase, SharedJobs, error_text
from aitrainsai.run.ledger import LedgerError
from aitrainsai.run.prompt import TaskView, compact_opening, opening
from aitrainsai.run.record import EpisodeData, EpisodeError, ProbeShared, Reward
from aitrainsai.run.transcript import call_agent_tool, is_object, stored, turn_results
from aitrainsai.tools import tool_schema
from aitrainsai.trainers import (AgentOutcome, AgentTask, AgentTurn, Baseline, EvalComparison, SampleMode,
                                 StopRun)

if TYPE_CHECKING:
    from aitrainsai.backends import GpuBackend
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.jobs.format import JobFormat
    from aitrainsai.reward_spec import RewardSpec
    from aitrainsai.run.baseline import Baselines
    from aitrainsai.run.ledger import Run
    from aitrainsai.run.policy import Policy
    from aitrainsai.run.record import Job
    from aitrainsai.trainers import InnerTrainer


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
    job_format: JobFormat = "verifiers"  # what the agent writes (families.job_format) ...
    job_formats: dict[str, JobFormat] = field(default_factory=dict)  # ... unless its family has its own
    share_identical_jobs: bool = True  # loop.share_identical_jobs: see shares_jobs
    shared: SharedJobs = field(default_factory=SharedJobs)  # the run's jobs that train for identical ones
    probes: SharedVerdicts | None = field(default_factory=SharedVerdicts)  # loop.share_identical_probes (None: off)
    _deterministic: bool | None = field(default=None, init=False, repr=False)

    def shares_jobs(self) -> bool:
        """Identical jobs train once (:mod:`aitrainsai.run.job_phase`): the run's setting, where the trainer declares
        its training deterministic on this backend (asked once)."""
        if not self.share_identical_jobs:
            return False
        if self._deterministic is None:
            self._deterministic = bool(self.trainer.deterministic(self.backend))
        return self._deterministic


@dataclass
class EpisodeResult:
    id: str
    family: str
    reward: float
    components: dict[str, float]
    outcome: EpisodeOutcome
    turns: list[AgentTurn]
    train: EvalComparison | None = None
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
        job_format = context.job_formats.get(family.name, context.job_format)
        self.spec: TaskSpec = family.task_spec(level, trainer.constraints(Constraints(), job_format)).model_copy(
            update={"job_format": job_format})
        self.messages: list[Message] = []
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
        return job_template(self.spec, self.context.trainer.config_template(self.spec), self.spec.job_format)

    def task(self) -> AgentTask:
        c = self.spec.constraints
        return AgentTask(family=self.family.name, level=self.level, levels=list(self.family.levels),
                         held_out=self.family.held_out,
                         template=self.template(), family_module=self.spec.public_modules[0],
                         allowed_bases=list(c.allowed_bases),
                         max_train_steps=c.max_train_steps, max_dataset_size=c.max_dataset_size)

    def opening_messages(self) -> list[Message]:
        """The system and user messages the agent starts from, in the run's view (``loop.task_view``; see
        :mod:`aitrainsai.run.prompt`)."""
        context = self.context
        return opening(context.task_view, self.spec, self.template(), context.trainer, context.reward_spec)

    def compact_opening(self) -> list[Message]:
        """The opening in the compact view, whatever the run's (:func:`aitrainsai.run.prompt.compact_opening`)."""
        return compact_opening(self.spec, self.template(), self.context.trainer, self.context.reward_spec)

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
            self.run.record(EpisodeError(episode=self.id, phase="agent", error=error_text(exc)))
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
        outcome = EpisodeOutcome(family=self.family.name, level=self.level, parsed_submission=self.parsed_submission,
                                 attempts=self.attempts, max_attempts=self.context.reward_spec.max_attempts,
                                 train_budget_seconds=self.spec.constraints.max_wall_seconds,
                                 train_work_budget=self.spec.constraints.max_train_tokens)
        reward, _ = self.context.reward_spec.reward(outcome)
        results = turn_results(self.messages)
        return AgentOutcome(family=self.family.name, episode=self.id, turns=len(self.turns),
                            failed_turns=results.count("failed"),
                            recovered=sum(a == "failed" and b == "ok" for a, b in zip(results, results[1:])),
                            parsed_turns=sum(t.parse_error is None for t in self.turns),
                            call_turns=sum(bool(t.message.get("tool_calls")) for t in self.turns),
                            submitted=self.parsed_submission,
                            first_accepted=bool(self.attempts) and self.attempts[0].ok,
                            accepted=self.accepted_job is not None, reward=reward,
                            seconds=round(time.monotonic() - began, 1))

    def _record_prompt(self, opening: list[Message]) -> None:
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
        row = self.run.episode(self.id)
        assert row is not None  # resumed: the episode's row exists
        data = row.data
        if data.frozen_job is None:
            raise LedgerError(f"episode {self.id} is in training but its row names no frozen job: cannot resume it")
        self.turns = list(data.turns)
        self.attempts = [ProbeAttempt(attempt=p.attempt, ok=p.ok, problems=p.problems)
                         for p in self.run.probes(self.id)]
        self.parsed_submission = True
        self.accepted_job = Path(data.frozen_job)
        self.accepted_digest = data.frozen_digest
        self.accepted_design = data.design or {}
        return await self._finish(self.run.job(self.job_id))

    @property
    def job_id(self) -> str:
        return f"{self.id}-job"

    async def _finish(self, job: Job | None = None) -> EpisodeResult:
        played: JobOutcome | None = None
        if self.accepted_job is not None and self.context.train_jobs:
            accepted = AcceptedJob(id=self.job_id, episode_id=self.id, dir=self.accepted_job,
                                   digest=self.accepted_digest, family=self.family, level=self.level, spec=self.spec,
                                   workdir=self.dir)
            played = await JobPhase(self.context, accepted, on_queued=self._training).play(self._baseline_scores, job)
        train: EvalComparison | None = played.result if played is not None else None
        outcome = EpisodeOutcome(family=self.family.name, level=self.level, parsed_submission=self.parsed_submission,
                                 attempts=self.attempts, max_attempts=self.context.reward_spec.max_attempts,
                                 train_budget_seconds=self.spec.constraints.max_wall_seconds,
                                 train_work_budget=self.spec.constraints.max_train_tokens,
                                 **(played.episode_fields() if played is not None else {}))
        reward, components = self.context.reward_spec.reward(outcome)
        status = ("no_submission" if not self.parsed_submission else "invalid" if self.accepted_job is None
                  else "validated" if not self.context.train_jobs else outcome.job_status)
        with self.run.transaction():  # the reward and its event together: a kill between them loses or doubles it
            self.run.upsert_episode(self.id, status=status, reward=reward, data=EpisodeData(
                components=components, outcome=outcome, turns=self.turns, train=train,
                **(self._frozen_fields() if self.accepted_job is not None else {})))
            self.run.record(Reward(episode=self.id, family=self.family.name, step=self.step, total=reward,
                                   components=components))
        return EpisodeResult(self.id, self.family.name, reward, components, outcome, self.turns, train, status)

    async def _agent_phase(self, policy: Policy, mode: SampleMode = "train", eval_seed: int | None = None) -> None:
        tools = self.agent_tools()
        schemas = self.tool_schemas()
        task = self.task()
        if mode == "eval":  # sampled with the caller's seed (the loop's: its group's eval key), never the id's
            if eval_seed is None:
                raise ValueError(f"episode {self.id}: an evaluation episode is sampled with an eval_seed; none given")
            task = task.model_copy(update={"eval_seed": eval_seed})
        for _ in range(self.context.max_agent_turns):
            turn = await policy.sample(list(self.messages), schemas, task, mode=mode)
            message = stored(turn.message)
            if message is not turn.message:  # cut to the ledger's bound
                turn = turn.model_copy(update={"message": message})
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
                if name == "submit_job" and is_object(function.get("arguments")):
                    self.parsed_submission = True
                result = await call_agent_tool(tools, name, function.get("arguments"))
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
                                          wall_s=self.context.probe_wall_s, verdicts=self.context.probes)
        problems = [str(p) for p in report.problems]
        self.attempts.append(ProbeAttempt(attempt=attempt, ok=report.ok, problems=problems))
        self.run.add_probe(self.id, attempt, report.ok, problems, report.seconds)
        if report.shared_from is not None:
            self.run.record(ProbeShared(episode=self.id, attempt=attempt, shares=self._run_path(report.shared_from)))
        if report.ok:
            assert report.job_dir is not None  # an accepted probe froze the job
            self.accepted_job = report.job_dir
            self.accepted_digest = report.digest
            self.accepted_design = job_design(report.job_dir, report.details)
            return f"{report.text()}; job id {self.job_id}"
        left = self.context.reward_spec.max_attempts - attempt
        attempts = f"\n({left} attempt{'s' if left != 1 else ''} left)" if left else "\n(no attempts left)"
        return report.text() + attempts

    def _run_path(self, path: Path) -> str:
        """``path`` relative to the run's folder where it lies there."""
        return str(path.relative_to(self.run.dir)) if path.is_relative_to(self.run.dir) else str(path)

    def _frozen_fields(self) -> dict[str, Any]:
        return {"frozen_job": str(self.accepted_job), "frozen_digest": self.accepted_digest,
                "design": self.accepted_design}

    async def _baseline_scores(self) -> dict[str, Baseline]:
        if self._baselines is None:
            self._baselines = await self.context.baselines.all(self.family, self.level,
                                                               self.spec.constraints.allowed_bases)
        return self._baselines

    def _training(self) -> None:
        """The episode's row while its job trains: what it froze, and the turns that wrote it (for resume)."""
        self.run.upsert_episode(self.id, status="training", data=EpisodeData(turns=self.turns,
                                                                             **self._frozen_fields()))

    def _say(self, message: Message) -> None:
        message = stored(message)
        self.messages.append(message)
        self.run.add_message(self.id, message)
