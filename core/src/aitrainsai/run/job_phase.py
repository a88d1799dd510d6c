"""An accepted job's second half: train it into a checkpoint through the run's backend, score the checkpoint on the
family's hidden eval, and compare with the untrained base. The job's ledger row follows each step, so a killed run
reattaches to a running payload, skips a finished phase, and reruns one its backend lost.

Identical jobs train once (``loop.share_identical_jobs``), where the inner trainer declares its training
deterministic on the run's backend (:meth:`~aitrainsai.trainers.InnerTrainer.deterministic`) and the job's own code
proved reproducible in training (:attr:`~aitrainsai.trainers.TrainOutcome.reproducible`: the trainer replayed
rollouts in a fresh sandbox and got the same tool results and rewards): a job whose :func:`share_key` is that of a
job of the run that is done or in flight waits for it and takes its outcome (its row ``done`` with ``shared_with``, a
``job_shared`` event, no cost). If that job dies, or its code was not reproducible (a rubric that reads the time, the
process id or ``os.urandom`` would replay one lucky draw), the jobs waiting for it train themselves, as if nothing had
been shared, and so does every later job with its key.

A job whose payload died of the infrastructure (:meth:`~aitrainsai.trainers.InnerTrainer.classify`: reason
``infra``, e.g. a machine too slow for the budget) ends with its episode's status ``infra``: no reward the agent
earned, so the loop leaves it out of its group's signal."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.backends import JobHandle
from aitrainsai.jobs.job import job_digest, verify_job
from aitrainsai.parsing import check_value
from aitrainsai.plugins import with_env
from aitrainsai.run.baseline import EngineMismatch, compare
from aitrainsai.run.ledger import LedgerError
from aitrainsai.run.record import EpisodeError, JobProgress, JobRerun, JobShared, JobState
from aitrainsai.trainers import EvalComparison

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aitrainsai.backends import GpuBackend, JobPayload, JobResult
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.run.ledger import Run
    from aitrainsai.run.record import Job
    from aitrainsai.trainers import Baseline, InnerTrainer

MAX_LOST_RERUNS = 2  # a payload whose worker vanished (a node died, a head restarted) is run again this often
LOG_TAIL_CHARS = 4_000  # of a payload's log, kept in the job's row


@dataclass(frozen=True)
class AcceptedJob:
    """A job the probe accepted and froze: where it lies, its digest, and what it was written for."""

    id: str
    episode_id: str
    dir: Path
    digest: str | None
    family: TaskFamily
    level: int
    spec: TaskSpec
    workdir: Path  # the episode's folder: the evaluation's outputs go in its eval/


def share_key(job: AcceptedJob, trainer: InnerTrainer, base: str) -> str | None:
    """What makes two accepted jobs of a run the same job, as a sha256 (hex): the frozen job's digest (its every
    file), the trainer and its run settings as it dumps them with its evaluation settings for ``base``, the base
    model, the training seed (the job's ``trainer.toml`` ``seed``, where its schema has one), the family (name and
    version), the level and the task spec the payload is given. None for a job frozen without a digest."""
    from aitrainsai.evaluation import family_version

    if job.digest is None:
        return None
    parts = {"digest": job.digest, "trainer": trainer.name, "settings": trainer.config.model_dump(mode="json"),
             "eval_settings": trainer.eval_settings(base), "base_model": base,
             "seed": getattr(trainer.job_config(job.dir), "seed", None), "family": job.family.name,
             "family_version": family_version(job.family), "level": job.level,
             "spec": job.spec.model_dump(mode="json")}
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class SharedJobs:
    """The run's jobs that train for identical ones, by share key, in this process (one per :class:`EpisodeContext`).

    A key's outcome is shared only on evidence: two jobs with it trained apart (the *leader*, the first, and the
    *confirmer*, the second, which trains beside it rather than waiting) and came out the same (the same checkpoint,
    byte for byte, and the same hidden-eval scores), each with its job's code found reproducible by the trainer. Until
    then every job with the key trains; once confirmed, the jobs that come take the leader's outcome; two that differ
    refuse the key (every job trains). The ledger's done rows say where a resumed run stands; jobs in flight count
    once their phase has claimed the key (a resumed job whose payload was submitted claims it first thing)."""

    def __init__(self) -> None:
        self._leaders: dict[str, str] = {}  # share key -> the first job that trains it
        self._confirmers: dict[str, str] = {}  # share key -> the second, whose outcome must equal the first's
        self._waits: dict[str, asyncio.Future[None]] = {}  # job id -> done when its phase ends in this process
        self._ended: set[str] = set()  # jobs whose phase ended in this process
        self._unshared: set[str] = set()  # keys that are not shared: every job with one trains itself
        self._loaded = False

    def claim(self, run: Run, key: str, job_id: str) -> str | None:
        """The job whose outcome ``job_id`` takes, once the key is confirmed (:meth:`verdict`), or None: it trains
        (the key's leader or confirmer, or a key that is not shared)."""
        if not self._loaded:  # the run's earlier trained jobs, once (a resumed run)
            self._loaded = True
            for row in sorted(run.jobs(), key=lambda r: r.created_at):
                progress = row.progress
                if row.state is JobState.DONE and progress.share_key and not progress.shared_with:
                    self._join(progress.share_key, row.id)
        if key in self._unshared:
            return None
        leader = self._join(key, job_id)
        return None if job_id in (leader, self._confirmers.get(key)) else leader

    def _join(self, key: str, job_id: str) -> str:
        """``key``'s leader, making ``job_id`` the leader or the confirmer where there is none."""
        leader = self._leaders.setdefault(key, job_id)
        if leader != job_id:
            self._confirmers.setdefault(key, job_id)
        return leader

    def trainers(self, key: str) -> list[str]:
        """The jobs that train ``key`` for the others: its leader, and its confirmer once there is one."""
        return [job for job in (self._leaders.get(key), self._confirmers.get(key)) if job is not None]

    def verdict(self, run: Run, key: str) -> bool | None:
        """Whether ``key``'s outcome may be shared: True once its leader and confirmer are done with the same
        outcome, each reproducible; False when either is done otherwise (the key is refused); None while one is still
        to come or in flight."""
        rows = [run.job(job) for job in self.trainers(key)]
        if len(rows) < 2 or any(row is None or row.state is not JobState.DONE for row in rows):
            return False if any(row is not None and row.state is JobState.DONE and not row.progress.shareable()
                                for row in rows) else None
        first, second = (row.progress for row in rows if row is not None)
        return first.shareable() and second.shareable() and first.same_outcome(second)

    def refuse(self, key: str) -> None:
        """``key``'s outcome is not to be shared (its job's code was not reproducible, or two trainings of it
        differed): every job with it trains itself."""
        self._unshared.add(key)
        self._leaders.pop(key, None)
        self._confirmers.pop(key, None)

    async def ended(self, run: Run, job_id: str) -> None:
        """Return once ``job_id`` has ended (done or dead in the ledger, or its phase over in this process). A job in
        flight in the ledger is waited for: a resumed run resumes it (the loop resumes every episode in training of
        a group it still needs, and a waiting job's group is one)."""
        row = run.job(job_id)
        if job_id in self._ended or (row is not None and row.state in (JobState.DONE, JobState.DEAD)):
            return
        loop = asyncio.get_running_loop()
        wait = self._waits.get(job_id)
        if wait is None or wait.get_loop() is not loop:
            wait = self._waits[job_id] = loop.create_future()
        await asyncio.shield(wait)  # a cancelled waiter leaves the others waiting

    def end(self, job_id: str, *, done: bool) -> None:
        """``job_id``'s phase is over; not ``done``: the keys it trained for are free (the next job trains them)."""
        self._ended.add(job_id)
        wait = self._waits.pop(job_id, None)
        if wait is not None and not wait.done():
            wait.set_result(None)
        if not done:
            for role in (self._leaders, self._confirmers):
                for key in [k for k, job in role.items() if job == job_id]:
                    del role[key]
            for key in [k for k in self._confirmers if k not in self._leaders]:  # a confirmer leads a freed key
                self._leaders[key] = self._confirmers.pop(key)


@dataclass
class _Spent:
    cost_usd: float = 0.0
    wall_s: float = 0.0

    def add(self, outcome: JobResult) -> None:
        self.cost_usd += outcome.cost_usd
        self.wall_s += outcome.wall_s


class JobContext(Protocol):
    """What a job phase uses of the run's parts (the episode's :class:`~aitrainsai.run.episode.EpisodeContext`)."""

    @property
    def run(self) -> Run: ...

    @property
    def trainer(self) -> InnerTrainer: ...

    @property
    def backend(self) -> GpuBackend: ...

    @property
    def payload_env(self) -> dict[str, str]: ...

    @property
    def shared(self) -> SharedJobs: ...

    def shares_jobs(self) -> bool: ...


class JobOutcome(BaseModel):
    """How a job phase ended: ``status``; the base it trained and the untrained scores of every allowed base (once
    they were known); ``result``, the hidden-eval comparison of a done job. The episode turns it into its
    :class:`aitrainsai.rewards.EpisodeOutcome`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Literal["done", "dead", "infra"]
    base_model: str | None = None
    baseline_scores: dict[str, float] = Field(default_factory=dict)
    result: EvalComparison | None = None

    def episode_fields(self) -> dict[str, Any]:
        """The fields of :class:`aitrainsai.rewards.EpisodeOutcome` this outcome decides."""
        result = self.result
        return {"job_status": self.status, "base_model": self.base_model, "baseline_scores": dict(self.baseline_scores),
                "pre": self.baseline_scores.get(self.base_model) if self.base_model is not None else None,
                "post": result.post if result else None, "train_seconds": result.train_seconds if result else None,
                "train_work": result.train_work if result else None}


class JobPhase:
    """Train an accepted job (one payload), then score its checkpoint on the hidden eval (a second payload, which
    starts only once every process of the first has ended and never sees the job's code). The job's row goes queued,
    running, evaluating, done or dead; resumed from that row (``stored``), a finished phase is not run again and a
    running one is reattached (rerun only if the backend lost it)."""

    def __init__(self, context: JobContext, job: AcceptedJob, *, on_queued: Callable[[], None]):
        self.context = context
        self.run = context.run
        self.job = job
        self.on_queued = on_queued  # the episode records that it is training, with what it froze
        self.key: str | None = None  # its share key, where identical jobs train once
        self.base: str | None = None  # the base it trains, once read
        self.scores: dict[str, float] = {}  # the allowed bases' untrained scores, once known

    async def play(self, baselines: Callable[[], Awaitable[dict[str, Baseline]]], stored: Job | None = None
                   ) -> JobOutcome:
        """How the job ended (:class:`JobOutcome`). ``baselines`` gives the untrained scores of the allowed bases. A
        job that cannot be run (a changed file, a baseline or a trainer that raised) is dead with the reason; only the
        ledger's own failure raises."""
        result: EvalComparison | None = None
        try:
            outcome = await self._play(baselines, stored)
            result = outcome.result
            return outcome
        except LedgerError:
            raise  # the run's own records failed: not this job's doing
        except Exception as exc:  # noqa: BLE001 - a crash on the agent's job is that job's death, not the run's
            reason = f"the job could not be run: {error_text(exc)}"
            self.run.upsert_job(self.job.id, status="dead", episode_id=self.job.episode_id,
                                progress=JobProgress(reason=reason))
            self.run.record(EpisodeError(episode=self.job.episode_id, phase="job", error=reason))
            return JobOutcome(status="dead")
        finally:  # the jobs waiting for this one read its row (stopped, it leaves them to train themselves)
            self.context.shared.end(self.job.id, done=result is not None)

    async def _play(self, scores: Callable[[], Awaitable[dict[str, Baseline]]], stored: Job | None) -> JobOutcome:
        context, job = self.context, self.job
        verify_job(job.dir, job.digest)  # before anything reads the job (it is read again below)
        baselines = await scores()
        base = self.base = context.trainer.job_base_model(job.dir)
        self.scores = {b: v.score for b, v in baselines.items()}
        if stored is not None and stored.state is JobState.DONE and stored.progress.outcome() is not None:
            return self._done(stored.progress)  # done before the run stopped (trained or shared): it stands
        self.key = share_key(job, context.trainer, base) if context.shares_jobs() else None
        if self.key is not None:
            if stored is None or not _submitted(stored):
                leader = await self._follow(self.key, stored)
                if leader is not None:
                    return self._take(leader)
            else:  # resumed with its own payload: it trains for the identical jobs that come
                context.shared.claim(self.run, self.key, job.id)
        progress = stored.progress if stored is not None else JobProgress()
        spent = _Spent(stored.cost_usd or 0.0, stored.wall_s or 0.0) if stored is not None else _Spent()
        train = progress.train
        if train is None:
            handle = JobHandle.model_validate(stored.handle) if stored is not None and stored.handle else None
            outcome = context.trainer.classify(
                await self._run_payload(handle, self._training_payload, self._queued, self._started))
            spent.add(outcome)
            if outcome.status == "done":
                try:
                    train = context.trainer.result(outcome)
                    train = train.model_copy(update={"checkpoint_digest": content_digest(train.checkpoint)})
                except Exception as exc:  # noqa: BLE001 - outputs missing or malformed: the job is dead, not the run
                    outcome = outcome.model_copy(update={"status": "dead", "reason": "artifact",
                                                         "detail": f"unreadable result: {exc}"})
            if train is None:
                return self._dead(outcome, spent)
            self.run.upsert_job(job.id, status="evaluating", cost_usd=spent.cost_usd, wall_s=spent.wall_s,
                                progress=JobProgress(train=train, log_tail=outcome.log_tail[-LOG_TAIL_CHARS:]))
        checkpoint = train.checkpoint

        def evaluation_payload() -> JobPayload:
            return context.trainer.eval_payload(job.family, job.level, base, checkpoint, job.workdir / "eval",
                                                f"{job.id}-eval")

        def eval_queued(payload: JobPayload) -> None:
            self.run.upsert_job(job.id, status="evaluating", progress=JobProgress(eval_payload=payload))

        def eval_started(handle: JobHandle) -> None:
            self.run.upsert_job(job.id, status="evaluating", progress=JobProgress(eval_handle=handle))

        outcome = context.trainer.classify(
            await self._run_payload(progress.eval_handle, evaluation_payload, eval_queued, eval_started))
        spent.add(outcome)
        result: EvalComparison | None = None
        if outcome.status == "done":
            try:
                post = await asyncio.to_thread(context.trainer.eval_result, outcome, family=job.family,
                                               level=job.level, base_model=base)  # off the loop: it may be slow
                check_value(post.item_scores, what="item scores")
                result = compare(baselines[base], post, train)
            except EngineMismatch as exc:
                outcome = outcome.model_copy(update={"status": "dead", "reason": "infra", "detail": str(exc)})
            except Exception as exc:  # noqa: BLE001 - unreadable scores: the job is dead, not the run
                outcome = outcome.model_copy(update={"status": "dead", "reason": "artifact",
                                                     "detail": f"unreadable evaluation: {exc}"})
        if result is None:
            return self._dead(outcome, spent, phase="evaluation")
        self.run.upsert_job(job.id, status="done", cost_usd=spent.cost_usd, wall_s=spent.wall_s, progress=JobProgress(
            reason="", eval_log_tail=outcome.log_tail[-LOG_TAIL_CHARS:], **result.model_dump()))
        if self.key is not None and (train.reproducible is not True or context.shared.verdict(self.run, self.key)
                                     is False):
            context.shared.refuse(self.key)  # the jobs waiting for it, and those to come, train themselves
        return self._done(JobProgress(train=train, **result.model_dump()))

    async def _follow(self, key: str, stored: Job | None) -> Job | None:
        """The done row of the identical job whose outcome this one takes, once two trainings of the key agreed
        (:meth:`SharedJobs.verdict`), waiting for them where they are in flight; None: this job trains (it leads or
        confirms the key, the key is not shared, or the trainings it waited for died or differed)."""
        context, job = self.context, self.job
        # resumed while waiting: the same job again (a resumed run resumes it too, or finds it ended)
        leader = stored.progress.shared_with if stored is not None else None
        if leader is None:
            leader = context.shared.claim(self.run, key, job.id)
            if leader is None:
                return None
            self.on_queued()
            self.run.upsert_job(job.id, status="queued", episode_id=job.episode_id,
                                progress=JobProgress(share_key=key, shared_with=leader))
        waited: list[str] = []
        while True:
            trainers = context.shared.trainers(key) or [leader]
            for trainer in trainers:
                await context.shared.ended(self.run, trainer)
            verdict = context.shared.verdict(self.run, key)
            if verdict is not None or trainers == waited:
                break
            waited = trainers  # one died and another took its place, or the confirmer came: wait for it too
        row = self.run.job(leader)
        if verdict and row is not None and row.state is JobState.DONE:
            return row
        if verdict is False:
            context.shared.refuse(key)  # two trainings differed, or one was not reproducible: no job takes them
        context.shared.claim(self.run, key, job.id)  # it trains, for those that come after it too
        return None

    def _take(self, leader: Job) -> JobOutcome:
        """Take ``leader``'s outcome as this job's: done, at no cost, shared with it."""
        done = leader.progress
        result = done.outcome()
        assert result is not None  # _follow returns a done row with its outcome
        progress = JobProgress(reason="", train=done.train, share_key=self.key, shared_with=leader.id,
                               **result.model_dump())
        with self.run.transaction():  # the row and its event together
            self.run.upsert_job(self.job.id, status="done", cost_usd=0.0, wall_s=0.0, progress=progress)
            self.run.record(JobShared(job=self.job.id, shares=leader.id))
        return self._done(progress)

    def _done(self, progress: JobProgress) -> JobOutcome:
        """The outcome a done job's row holds (a shared job's: its leader's). A resumed run takes it as it stands: its
        payloads are not waited for again, nor their cost and time counted twice."""
        result = progress.outcome()
        if result is None:
            raise ValueError(f"the outcome of a done job ({progress.shared_with or 'trained here'}) is incomplete")
        return JobOutcome(status="done", base_model=self.base, baseline_scores=self.scores, result=result)

    def _training_payload(self) -> JobPayload:
        verify_job(self.job.dir, self.job.digest)
        return self.context.trainer.payload(self.job.dir, self.job.spec, self.job.id, family=self.job.family)

    def _queued(self, payload: JobPayload) -> None:
        self.on_queued()
        self.run.upsert_job(self.job.id, status="queued", episode_id=self.job.episode_id,
                            backend=self.context.backend.name,  # it trains: it shares no other job's outcome
                            progress=JobProgress(payload=payload, share_key=self.key, shared_with=None))

    def _started(self, handle: JobHandle) -> None:
        self.run.upsert_job(self.job.id, status="running", handle=handle.model_dump(mode="json"))

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

    def _dead(self, outcome: JobResult, spent: _Spent, phase: str = "training") -> JobOutcome:
        why = outcome.why if phase == "training" else f"{phase}: {outcome.why}"
        tail = outcome.log_tail[-LOG_TAIL_CHARS:]  # the training log stays where it was
        progress = (JobProgress(reason=why, dead_reason=outcome.reason, log_tail=tail) if phase == "training"
                    else JobProgress(reason=why, dead_reason=outcome.reason, eval_log_tail=tail))
        self.run.upsert_job(self.job.id, status="dead", cost_usd=spent.cost_usd, wall_s=spent.wall_s,
                            progress=progress)
        return JobOutcome(status="infra" if outcome.reason == "infra" else "dead", base_model=self.base,
                          baseline_scores=self.scores)


def content_digest(path: Path) -> str:
    """A checkpoint's content hash: its folder's files (:func:`aitrainsai.jobs.job.job_digest`), or the file's bytes."""
    if Path(path).is_dir():
        return job_digest(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _submitted(job: Job) -> bool:
    """The job submitted its own training payload (or went further)."""
    progress = job.progress
    return bool(job.handle or progress.payload or progress.train or progress.eval_payload or progress.eval_handle)


def error_text(exc: BaseException) -> str:
    """An exception in one line of at most 2,000 characters, its type first."""
    return f"{type(exc).__name__}: {exc}"[:2000]
