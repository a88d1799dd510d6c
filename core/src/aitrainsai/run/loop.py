"""The nested loop: groups of episodes stream through the GPU backend, and the outer trainer learns from them.

Each group is ``group_size`` episodes of one task (a training family at its level). Groups are launched with no
barrier per outer step: while the policy trains on finished groups, the backend's workers keep running jobs (with
``max_steps_off_policy = 0`` there is one: each step's groups are sampled by the policy the last update left). A group
sampled more than ``max_steps_off_policy`` updates ago is dropped; a group whose rewards are all equal carries no
signal and is skipped; both are counted. Every ``eval_every`` steps (and at the end) the current policy plays the
held-out family and the training families with no update. ``resume`` continues a killed run from its ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aitrainsai.run.episode import EpisodeResult
from aitrainsai.is_grpo import staleness
from aitrainsai.run.ledger import LedgerError
from aitrainsai.run.record import (BaseChoice, EpisodeRow, Eval, Finished, GroupDropped, GroupLaunched, GroupRef,
                                   GroupSkipped, LeftOut, OuterStep, PolicyExport, Resumed, RewardSpecCopy, StopSignal,
                                   Stopped)
from aitrainsai.stopping import STOP_TIMEOUT_S, Interrupted  # noqa: F401 - the loop's callers catch it here
from aitrainsai.trainers import ScoredEpisode, StopRun

if TYPE_CHECKING:
    from aitrainsai.run.ledger import Run
    from aitrainsai.run.session import Session


FINISHED = ("done", "dead", "infra", "invalid", "no_submission", "validated")


def groups_in_flight(capacity: int, group_size: int, groups_per_step: int) -> int:
    """How many groups the loop keeps launched: enough to fill every worker, plus one outer step queued behind them,
    so that the pool never waits for a step boundary and the backend sees a whole step to order by length."""
    return max(capacity // group_size, 1) + groups_per_step


@dataclass
class Group:
    ref: GroupRef
    level: int
    results: list[EpisodeResult] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def family(self) -> str:
        return self.ref.family

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results]

    @property
    def policy_version(self) -> int:
        versions = [t.policy_version for r in self.results for t in r.turns]
        return min(versions) if versions else 0


@dataclass
class Counters:
    launched: int = 0
    in_flight: int = 0
    dropped: int = 0
    skipped: int = 0
    jobs: dict[str, int] = field(default_factory=lambda: {"done": 0, "dead": 0})


@dataclass(frozen=True)
class LastStep:
    """What the last outer step came to: its mean reward and components, and the costs so far."""

    reward: float
    components: dict[str, float]
    cost_usd: float | None  # the outer trainer's spending, where it has reported one
    compute_usd: dict[str, float]  # the inner jobs' (jobs_usd) and the backend's own (pool_usd, ...)


@dataclass(frozen=True)
class LoopStatus:
    """Where the loop stands, as a display shows it."""

    trained_steps: int
    policy_version: int
    counters: Counters
    buffered: int  # groups with signal, waiting for an outer step
    last_step: LastStep | None  # None until a step trains in this process


@dataclass(frozen=True)
class LoopSummary:
    """What a played loop came to: outer steps trained, groups launched, skipped (no signal) and dropped (too
    stale); where the outer trainer stopped it (:class:`~aitrainsai.trainers.StopRun`), why (``stopped``) and
    whether resuming may help (``resumable``). Both None: the loop ran to its end."""

    steps: int
    launched: int
    skipped: int
    dropped: int
    stopped: str | None = None
    resumable: bool | None = None


class LoopDisplay(Protocol):
    """What shows a run as it goes (the command line supplies one): open while the loop plays, told each change of
    its status, and given each line a tracker warns with."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...

    def update(self, status: LoopStatus) -> None: ...

    def warn(self, line: str) -> None: ...


class NestedLoop:
    def __init__(self, session: Session, *, display: LoopDisplay | None = None):
        self.session = session
        self.run = session.run
        self.config = session.config
        self.loop_config = session.config.loop
        self.display = display
        self.last_step: LastStep | None = None
        self.train_families = session.train_families
        self.held_out = session.held_out_families
        if any(f.held_out for f in self.train_families):
            raise ValueError("a held-out family is in families.train: the loop never trains on one")
        self.backend = session.backend
        self.trainer = session.inner_trainer
        self.policy = session.outer_trainer
        self.reward_spec = session.reward_spec
        self.context = session.context
        self.rng = random.Random(self.loop_config.seed)
        self.counters = Counters()
        self.buffer: list[Group] = []
        self.trained_steps = 0
        self._family_cycle: list[Any] = []

    # -- public ----------------------------------------------------------------------------------------------------
    async def play(self, resume: bool = False) -> LoopSummary:
        """Play (or resume) the loop to its end or its stop; the summary of what it did."""
        tasks: set[asyncio.Task] = set()
        async with self.session:  # starts the backend; closes it and the policy, also after errors
            try:
                await self._run_steps(resume, tasks)
            except StopRun as exc:  # the trainer asked to stop: keep what finished, resume later (if that can help)
                _cancel(tasks)
                self.run.record(Stopped(reason=str(exc), resumable=exc.resumable, steps=self.trained_steps))
                return self._summary(stopped=str(exc), resumable=exc.resumable)
        summary = self._summary()
        self.run.record(Finished(steps=summary.steps, dropped=summary.dropped, skipped=summary.skipped,
                                 launched=summary.launched))
        return summary

    def _summary(self, stopped: str | None = None, resumable: bool | None = None) -> LoopSummary:
        return LoopSummary(steps=self.trained_steps, launched=self.counters.launched, skipped=self.counters.skipped,
                           dropped=self.counters.dropped, stopped=stopped, resumable=resumable)

    async def _run_steps(self, resume: bool, tasks: set[asyncio.Task]) -> None:
        """Outer steps until the configured number, then the final evaluation and the policy's export. ``tasks``
        (groups in flight) is the caller's, so that a stop can cancel them."""
        steps = self.loop_config.steps
        per_step = self.loop_config.groups_per_step
        max_groups = steps * per_step * self.loop_config.max_group_factor
        await self.policy.start()
        if resume:
            tasks |= await self._resume()
            for step in self._unfinished_evals():  # the run was killed inside an evaluation: finish it first
                await self._evaluate(step)
        if self.loop_config.eval_initial and self.trained_steps == 0:
            await self._evaluate(0)  # the untrained policy, on the eval seeds the final evaluation uses
        while self.trained_steps < steps:
            needed = (steps - self.trained_steps) * per_step - len(self.buffer) - len(tasks)
            # on-policy (no lag allowed): a step's groups start only once the previous update is made
            room = (groups_in_flight(self.backend.capacity, self.loop_config.group_size, per_step)
                    if self.loop_config.max_steps_off_policy else per_step)
            while needed > 0 and len(tasks) < room and self.counters.launched < max_groups:
                tasks.add(asyncio.ensure_future(self._play_group(self._launch(self._next_group()))))
                needed -= 1
            if not tasks:
                self.run.record(Stopped(reason=f"{max_groups} groups launched without enough signal to train"))
                break
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            tasks -= done
            for task in done:
                self._accept(task.result())
            while len(self.buffer) >= per_step and self.trained_steps < steps:
                await self._train_step(self.buffer[:per_step])
                self.buffer = self.buffer[per_step:]
                every = self.loop_config.eval_every
                if every and self.trained_steps % every == 0 and self.trained_steps < steps:
                    await self._evaluate()
        _cancel(tasks)
        if self.loop_config.eval_every or self.loop_config.final_eval:
            await self._evaluate()
        if not self.run.records(PolicyExport):
            exported = await self.policy.export()
            if exported:
                spec = self.reward_spec
                self.run.record(PolicyExport(refs=dict(exported), step=self.trained_steps, reward_spec=RewardSpecCopy(
                    name=spec.name, formula=spec.formula(), agent_text=spec.agent_text(),
                    file=_read_text(spec.source))))

    # -- groups ----------------------------------------------------------------------------------------------------
    def _next_group(self) -> Group:
        if not self._family_cycle:
            self._family_cycle = list(self.train_families)
            self.rng.shuffle(self._family_cycle)
        family = self._family_cycle.pop()
        index = self.counters.launched
        self.counters.launched += 1
        return Group(GroupRef.train(index, family.name), level=self.session.level(family))

    def _launch(self, group: Group) -> Group:
        """Record a new group before its episodes: resume and the report read its kind from this record."""
        self.run.record(GroupLaunched(group=group.ref))
        return group

    def _family(self, name: str):
        return next(f for f in self.train_families + self.held_out if f.name == name)

    async def _play_group(self, group: Group, eval_step: int | None = None) -> Group:
        """Play a group's episodes. The ledger's record wins: a finished episode is reused (never replayed, so its
        job never reruns and its reward is counted once), one left in training reattaches to its job, and the rest
        are played from the start."""
        family = self._family(group.family)
        rows = {row.id: row for row in self.run.episodes(group.id)}
        size = self._group_size(eval_step)
        members = {group.ref.episode_id(i): i for i in range(size + len(rows))}  # rows: an older, larger config's
        ids = sorted(set(rows) | {episode_id for episode_id, i in members.items() if i < size})

        async def one(episode_id: str) -> EpisodeResult:
            row = rows.get(episode_id)
            if row is not None and row.status in FINISHED:
                return _from_ledger(row)
            episode = self.session.episode(family, group.level, episode_id, step=self.trained_steps,
                                           group_id=group.id)
            if row is not None and row.status == "training":
                return await episode.resume()
            if eval_step is None:
                return await episode.play(self.policy, mode="train")
            member = members.get(episode_id)  # None only for an id of another shape (a ledger's older ids)
            key = episode_id if member is None else group.ref.eval_key(member)
            seed = zlib.crc32(key.encode())
            return await episode.play(self.policy, mode="eval", eval_seed=seed)

        self._report()
        group.results = list(await asyncio.gather(*(self._watched(one(i)) for i in ids)))
        return group

    def _group_size(self, eval_step: int | None) -> int:
        return self.loop_config.eval_episodes if eval_step is not None else self.loop_config.group_size

    async def _watched(self, coroutine) -> EpisodeResult:
        self.counters.in_flight += 1
        self._report()
        try:
            result = await coroutine
        finally:
            self.counters.in_flight -= 1
        if result.status in ("done", "dead", "infra"):
            self.counters.jobs["done" if result.status == "done" else "dead"] += 1
        self._report()
        return result

    def _accept(self, group: Group) -> None:
        lag = staleness(self.policy.policy_version, group.policy_version)
        left_out = [r.id for r in group.results if r.status == "infra"]
        if left_out:  # the infrastructure's failure is no reward: the group trains on the rest
            if not any(e.group == group.id for e in self.run.records(LeftOut)):  # once, a resumed run's too
                self.run.record(LeftOut(group=group.id, episodes=left_out))
            group.results = [r for r in group.results if r.status != "infra"]
        if left_out and len(group.results) < 2:
            self.counters.skipped += 1
            self.run.record(GroupSkipped(group=group.id, reward=group.rewards[0] if group.results else 0.0))
        elif lag > self.loop_config.max_steps_off_policy:
            self.counters.dropped += 1
            self.run.record(GroupDropped(group=group.id, lag=lag))
        elif max(group.rewards) - min(group.rewards) <= 1e-9:
            self.counters.skipped += 1
            self.run.record(GroupSkipped(group=group.id, reward=group.rewards[0]))
        else:
            self.buffer.append(group)
        self._report()

    async def _train_step(self, groups: list[Group]) -> None:
        started = time.monotonic()
        batch = [[ScoredEpisode(id=r.id, turns=list(r.turns), reward=r.reward) for r in g.results]
                 for g in groups]
        metrics = await self.policy.update(batch)
        self.trained_steps += 1
        # The state goes into a directory of its own and counts once the outer_step event is recorded: a run killed
        # in between resumes from the previous step's state and trains on these groups again, never twice.
        state = self._policy_dir(self.trained_steps)
        shutil.rmtree(state, ignore_errors=True)
        await self.policy.save_state(state)
        results = [r for g in groups for r in g.results]
        components: dict[str, float] = {}
        for r in results:
            for k, v in r.components.items():
                components[k] = components.get(k, 0.0) + v / len(results)
        compute = {"jobs_usd": self.run.jobs_cost([r.id for r in results]), **self.backend.costs()}
        self.run.record(OuterStep(step=self.trained_steps, groups=[g.id for g in groups], compute=compute,
                                  policy_version=self.policy.policy_version, seconds=time.monotonic() - started,
                                  mean_reward=sum(r.reward for r in results) / len(results), components=components,
                                  dropped=self.counters.dropped, skipped=self.counters.skipped, metrics=metrics,
                                  base_choices=[_base_choice(r) for r in results]))
        for old in state.parent.glob("step-*"):
            if old != state:
                shutil.rmtree(old, ignore_errors=True)
        cost = metrics.get("cost_usd_total")
        if not isinstance(cost, (int, float)):  # the last one reported stands
            cost = self.last_step.cost_usd if self.last_step is not None else None
        self.last_step = LastStep(reward=sum(r.reward for r in results) / len(results), components=components,
                                  cost_usd=None if cost is None else float(cost),
                                  compute_usd={"jobs_usd": self.run.jobs_cost(), **self.backend.costs()})
        self._report()

    async def _evaluate(self, step: int | None = None) -> None:
        """Evaluate the policy of ``step`` (default: now) on every family, but those already evaluated at it."""
        step = self.trained_steps if step is None else step
        evaluated = {e.family for e in self.run.records(Eval) if e.step == step}
        families = [f for f in self._eval_families() if f.name not in evaluated]
        known = self.run.groups()
        groups = [Group(GroupRef.eval(step, f.name), level=self.session.level(f)) for f in families]
        for group in groups:
            if group.id not in known:  # an evaluation a killed run began is recorded already
                self._launch(group)
        played = await asyncio.gather(*(self._play_group(g, eval_step=step) for g in groups))
        for group in played:
            family = self._family(group.family)
            trained = [r.train for r in group.results if r.train]
            self.run.record(Eval(step=step, family=group.family, held_out=family.held_out,
                                 mean_reward=sum(group.rewards) / len(group.rewards),
                                 post=[t.post for t in trained], pre=[t.pre for t in trained],
                                 uplift=[t.uplift for t in trained],
                                 base_choices=[_base_choice(r) for r in group.results]))

    # -- resume ----------------------------------------------------------------------------------------------------
    def _policy_dir(self, step: int) -> Path:
        return self.run.dir / "policy" / f"step-{step:04d}"

    async def _resume(self) -> set[asyncio.Task]:
        """Restore the policy and the counters, and finish the unconsumed groups (see :meth:`_play_group`)."""
        consumed: set[str] = set()
        for step in self.run.records(OuterStep):
            self.trained_steps = max(self.trained_steps, step.step)
            consumed.update(step.groups)
        consumed.update(e.group for e in self.run.records(GroupDropped))
        consumed.update(e.group for e in self.run.records(GroupSkipped))
        await self._load_policy()
        refs = {ref.id: ref for ref in self.run.groups().values() if ref.kind == "train"}
        by_group: dict[str, list[EpisodeRow]] = {}
        for row in self.run.episodes():
            if row.group_id in refs:
                by_group.setdefault(row.group_id, []).append(row)
        # the next group's number follows the highest one recorded (an id is never reused)
        self.counters.launched = max((ref.index + 1 for ref in refs.values() if ref.index is not None), default=0)
        tasks: set[asyncio.Task] = set()
        if self.trained_steps < self.loop_config.steps:  # groups left over from a finished loop are not needed
            for group_id, rows in sorted(by_group.items()):
                if group_id not in consumed:
                    level = rows[0].level
                    group = Group(refs[group_id], level=self.session.level(self._family(refs[group_id].family))
                                  if level is None else level)
                    tasks.add(asyncio.ensure_future(self._play_group(group)))
        self.run.record(Resumed(trained_steps=self.trained_steps, groups_in_progress=len(tasks)))
        return tasks

    async def _load_policy(self) -> None:
        root = self.run.dir / "policy"
        saved = self._policy_dir(self.trained_steps)
        if self.trained_steps and saved.is_dir():
            await self.policy.load_state(saved)
        elif any(not p.name.startswith("step-") for p in root.glob("*")):
            await self.policy.load_state(root)  # a run recorded before per-step states
        elif self.trained_steps:
            raise RuntimeError(f"cannot resume: the policy state of outer step {self.trained_steps} is missing "
                               f"({saved})")

    def _eval_families(self) -> list:
        return self.held_out + (self.train_families if self.loop_config.eval_families == "all" else [])

    def _unfinished_evals(self) -> list[int]:
        """Steps whose evaluation a killed run began and did not finish."""
        refs = self.run.groups()
        begun = {ref.step for row in self.run.episodes() if (ref := refs.get(row.group_id or ""))
                 and ref.kind == "eval" and ref.step is not None}
        families = len(self._eval_families())
        done: dict[int, int] = {}
        for event in self.run.records(Eval):
            done[event.step] = done.get(event.step, 0) + 1
        return sorted(step for step in begun if done.get(step, 0) < families)

    def status(self) -> LoopStatus:
        c = self.counters
        return LoopStatus(trained_steps=self.trained_steps, policy_version=self.policy.policy_version,
                          counters=Counters(c.launched, c.in_flight, c.dropped, c.skipped, dict(c.jobs)),
                          buffered=len(self.buffer), last_step=self.last_step)

    def _report(self) -> None:
        if self.display is not None:
            self.display.update(self.status())


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _cancel(tasks: set[asyncio.Task]) -> None:
    """Cancel the groups still in flight. Not awaited: an episode's own handlers would record a cancelled job as
    finished; left alone, its unfinished records make a resume replay or reattach it."""
    for task in tasks:
        task.cancel()
    tasks.clear()


def _from_ledger(row: EpisodeRow) -> EpisodeResult:
    """A finished episode's result, as its row recorded it."""
    data = row.data
    if data.outcome is None or row.reward is None or row.family is None:
        raise LedgerError(f"episode {row.id} is {row.status} but its row holds no outcome: cannot resume it")
    return EpisodeResult(row.id, row.family, row.reward, data.components, data.outcome, data.turns, data.train,
                         row.status)


def _base_choice(result: EpisodeResult) -> BaseChoice:
    outcome = result.outcome
    scores = outcome.baseline_scores
    best = max(scores, key=lambda name: scores[name]) if scores else None
    return BaseChoice(family=result.family, base=outcome.base_model, best_untrained=best, bases=len(scores),
                      picked_best=outcome.base_model is not None and best is not None
                      and scores[outcome.base_model] >= scores[best])


def run_loop(session: Session, *, display: LoopDisplay | None = None, resume: bool = False) -> LoopSummary:
    """Run (or resume) the nested loop, shown on ``display`` (None: tracker warnings go to stderr); mark the run
    finished, stopped (the outer trainer raised :class:`~aitrainsai.trainers.StopRun`; the summary's ``stopped``
    says why) or failed."""
    import sys

    from aitrainsai.stopping import run_until_stopped

    from aitrainsai.run.tracking import Tracking

    run = session.run
    loop = NestedLoop(session, display=display)
    warn = display.warn if display is not None else lambda line: print(line, file=sys.stderr)
    with run.hold():
        run.set_status("running")
        try:
            with display or contextlib.nullcontext(), Tracking(run.ledger.runs_dir, run.id, session.trackers(), warn):
                summary = run_until_stopped(lambda: loop.play(resume=resume),
                                            on_signal=lambda signum: _record_signal(run, signum))
        except BaseException as exc:
            run.set_status("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        run.set_status("stopped" if summary.stopped is not None else "finished")
    return summary


def _record_signal(run: Run, signum: int) -> None:
    """The stop's event, written as the signal comes (a stop that outlives its bound ends the process; the run's
    released lock then reads ``interrupted``)."""
    import signal

    with contextlib.suppress(Exception):  # a ledger that cannot be written must not stop the stop
        run.record(StopSignal(signal=signal.Signals(signum).name, stop_timeout_s=STOP_TIMEOUT_S))
