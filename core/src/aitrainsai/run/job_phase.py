"""An accepted job's second half: train it into a checkpoint through the run's backend, score the checkpoint on the
family's hidden eval, and compare with the untrained base. The job's ledger row follows each step, so a killed run
reattaches to a running payload, skips a finished phase, and reruns one its backend lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aitrainsai.backends import JobHandle
from aitrainsai.jobs.job import verify_job
from aitrainsai.parsing import check_value
from aitrainsai.plugins import with_env
from aitrainsai.run.baseline import EngineMismatch, compare
from aitrainsai.run.ledger import LedgerError
from aitrainsai.run.record import EpisodeError, JobProgress, JobRerun

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aitrainsai.backends import JobPayload, JobResult
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.rewards import EpisodeRecord
    from aitrainsai.run.episode import EpisodeContext
    from aitrainsai.run.record import Job
    from aitrainsai.trainers import Baseline, TrainResult

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


@dataclass
class _Spent:
    cost_usd: float = 0.0
    wall_s: float = 0.0

    def add(self, outcome: JobResult) -> None:
        self.cost_usd += outcome.cost_usd
        self.wall_s += outcome.wall_s


class JobPhase:
    """Train an accepted job (one payload), then score its checkpoint on the hidden eval (a second payload, which
    starts only once every process of the first has ended and never sees the job's code). The job's row goes queued,
    running, evaluating, done or dead; resumed from that row (``stored``), a finished phase is not run again and a
    running one is reattached (rerun only if the backend lost it)."""

    def __init__(self, context: EpisodeContext, job: AcceptedJob, *, on_queued: Callable[[], None]):
        self.context = context
        self.run = context.run
        self.job = job
        self.on_queued = on_queued  # the episode records that it is training, with what it froze

    async def play(self, record: EpisodeRecord, baselines: Callable[[], Awaitable[dict[str, Baseline]]],
                   stored: Job | None = None) -> tuple[EpisodeRecord, TrainResult | None]:
        """The episode's record with the job's outcome, and the outcome when the job finished. ``baselines`` gives the
        untrained scores of the allowed bases. A job that cannot be run (a changed file, a baseline or a trainer that
        raised) is dead with the reason; only the ledger's own failure raises."""
        try:
            return await self._play(record, baselines, stored)
        except LedgerError:
            raise  # the run's own records failed: not this job's doing
        except Exception as exc:  # noqa: BLE001 - a crash on the agent's job is that job's death, not the run's
            reason = f"the job could not be run: {error_text(exc)}"
            self.run.upsert_job(self.job.id, status="dead", episode_id=self.job.episode_id,
                                result=JobProgress(reason=reason))
            self.run.record(EpisodeError(episode=self.job.episode_id, phase="job", error=reason))
            return record.model_copy(update={"job_status": "dead"}), None

    async def _play(self, record: EpisodeRecord, scores: Callable[[], Awaitable[dict[str, Baseline]]],
                    stored: Job | None) -> tuple[EpisodeRecord, TrainResult | None]:
        context, job = self.context, self.job
        verify_job(job.dir, job.digest)  # before anything reads the job (it is read again below)
        baselines = await scores()
        base = context.trainer.job_base_model(job.dir)
        record = record.model_copy(update={"base_model": base, "pre": baselines[base].score,
                                           "baseline_scores": {b: v.score for b, v in baselines.items()}})
        progress = stored.result if stored is not None else JobProgress()
        spent = _Spent(stored.cost_usd or 0.0, stored.wall_s or 0.0) if stored is not None else _Spent()
        train = progress.train
        if train is None:
            handle = JobHandle.model_validate(stored.handle) if stored is not None and stored.handle else None
            outcome = await self._run_payload(handle, self._training_payload, self._queued, self._started)
            spent.add(outcome)
            if outcome.status == "done":
                try:
                    train = context.trainer.result(outcome)
                except Exception as exc:  # noqa: BLE001 - outputs missing or malformed: the job is dead, not the run
                    outcome = outcome.model_copy(update={"status": "dead", "reason": "artifact",
                                                         "detail": f"unreadable result: {exc}"})
            if train is None:
                return self._dead(record, outcome, spent), None
            self.run.upsert_job(job.id, status="evaluating", cost_usd=spent.cost_usd, wall_s=spent.wall_s,
                                result=JobProgress(train=train, log_tail=outcome.log_tail[-LOG_TAIL_CHARS:]))
        checkpoint = train.checkpoint

        def evaluation_payload() -> JobPayload:
            return context.trainer.eval_payload(job.family, job.level, base, checkpoint, job.workdir / "eval",
                                                f"{job.id}-eval")

        def eval_queued(payload: JobPayload) -> None:
            self.run.upsert_job(job.id, status="evaluating", result=JobProgress(eval_payload=payload))

        def eval_started(handle: JobHandle) -> None:
            self.run.upsert_job(job.id, status="evaluating", result=JobProgress(eval_handle=handle))

        outcome = await self._run_payload(progress.eval_handle, evaluation_payload, eval_queued, eval_started)
        spent.add(outcome)
        result: TrainResult | None = None
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
            return self._dead(record, outcome, spent, phase="evaluation"), None
        self.run.upsert_job(job.id, status="done", cost_usd=spent.cost_usd, wall_s=spent.wall_s, result=JobProgress(
            reason="", eval_log_tail=outcome.log_tail[-LOG_TAIL_CHARS:], **result.model_dump()))
        record = record.model_copy(update={"job_status": "done", "post": result.post,
                                           "train_seconds": result.train_seconds})
        return record, result

    def _training_payload(self) -> JobPayload:
        verify_job(self.job.dir, self.job.digest)
        return self.context.trainer.payload(self.job.dir, self.job.spec, self.job.id, family=self.job.family)

    def _queued(self, payload: JobPayload) -> None:
        self.on_queued()
        self.run.upsert_job(self.job.id, status="queued", episode_id=self.job.episode_id,
                            backend=self.context.backend.name, result=JobProgress(payload=payload))

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

    def _dead(self, record: EpisodeRecord, outcome: JobResult, spent: _Spent, phase: str = "training"
              ) -> EpisodeRecord:
        why = outcome.why if phase == "training" else f"{phase}: {outcome.why}"
        tail = outcome.log_tail[-LOG_TAIL_CHARS:]  # the training log stays where it was
        progress = (JobProgress(reason=why, dead_reason=outcome.reason, log_tail=tail) if phase == "training"
                    else JobProgress(reason=why, dead_reason=outcome.reason, eval_log_tail=tail))
        self.run.upsert_job(self.job.id, status="dead", cost_usd=spent.cost_usd, wall_s=spent.wall_s,
                            result=progress)
        return record.model_copy(update={"job_status": "dead"})


def error_text(exc: BaseException) -> str:
    """An exception in one line of at most 2,000 characters, its type first."""
    return f"{type(exc).__name__}: {exc}"[:2000]
