"""Feeding a run's trackers (:mod:`aitrainsai.trackers`) from its ledger, each on a thread of its own.

The ledger is the source: each tracker's thread, with its own connection, reads the events written since it last
looked, turns them into points (an episode's ``reward`` event into its :class:`EpisodePoint` and, where it trained a
job, its :class:`JobPoint`; an ``outer_step`` into a :class:`StepPoint`; an ``eval`` into an :class:`EvalPoint`) and
hands its tracker the points past that tracker's cursor (``run_dir/trackers/<name>.cursor``, moved after each write).
So the loop never waits on a tracker, a tracker reads only as fast as it writes (the ledger is its queue: nothing piles
up in memory behind a slow one), a tracker that hangs holds up only itself, a resumed run feeds each tracker from where
it left off (a tracker added on resume gets the whole run), and a tracker that raises anything (``SystemExit`` too)
is named once and fed nothing more.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

from aitrainsai.run.ledger import Ledger, LedgerError, Run
from aitrainsai.run.record import (Eval, Finished, GroupLaunched, OuterStep, Reward, Stopped, StopSignal, legacy_group,
                                   parse_record)
from aitrainsai.trackers import EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker

POLL_S = 2.0  # how often a tracker's thread looks at the ledger
STOP_WAIT_S = 60.0  # how long the end of a run waits for the trackers' last writes (all of them together)


class _Points:
    """Points from a run's ledger, read incrementally: the counters an axis needs (finished episodes, trained jobs,
    each group's uplifts) carry from one read to the next."""

    def __init__(self, run: Run):
        self.run = run
        self.seq = 0
        self.episodes = 0
        self.jobs = 0
        self.uplifts: dict[str, list[float]] = {}
        self.eval_groups: set[str] = set()
        self.end: RunEnd | None = None

    def read(self) -> list[StepPoint | EpisodePoint | JobPoint | EvalPoint]:
        points: list[Any] = []
        for row in self.run.events(after=self.seq):
            self.seq = row.seq
            try:
                record = parse_record(row.kind, row.data)
                points += self._points(record, row.seq, row.created_at)
            except (ValueError, ArithmeticError, TypeError, KeyError, AttributeError):  # validation; beyond a double
                continue  # an event this core does not know (a newer writer's), one no point can hold, or a row a
                # damaged or foreign ledger holds: that event is left out, never the tracker's feed
        return points

    def _points(self, record: Any, seq: int, at: float) -> list[Any]:
        if isinstance(record, GroupLaunched):
            if record.group.kind == "eval":
                self.eval_groups.add(record.group.id)
        elif isinstance(record, Reward):
            return self._episode(record, seq, at)
        elif isinstance(record, OuterStep):
            return [self._step(record, seq, at)]
        elif isinstance(record, Eval):
            uplift = record.uplift
            return [EvalPoint(seq=seq, axis=f"eval/{record.family}", x=record.step, at=at, family=record.family,
                              held_out=record.held_out, mean_reward=record.mean_reward,
                              mean_uplift=mean(uplift) if uplift else None, jobs=len(uplift))]
        elif isinstance(record, Finished):
            self.end = RunEnd(status="finished", steps=record.steps)
        elif isinstance(record, Stopped):
            self.end = RunEnd(status="stopped", reason=record.reason, steps=record.steps or 0)
        elif isinstance(record, StopSignal):
            self.end = RunEnd(status="stopped", reason=f"{record.signal} received")
        return []

    def _episode(self, reward: Reward, seq: int, at: float) -> list[Any]:
        try:
            row = self.run.episode(reward.episode)
        except LedgerError:  # a damaged or foreign row: the point says what the event says
            row = None
        outcome = row.data.outcome if row is not None else None
        attempts = outcome.attempts if outcome is not None else []
        group = row.group_id if row is not None else None
        legacy = legacy_group(group, reward.family or "") if group else None  # a ledger from before GroupLaunched
        evaluation = group in self.eval_groups or (legacy is not None and legacy.kind == "eval")
        self.episodes += 1
        points: list[Any] = [EpisodePoint(
            seq=seq, x=self.episodes, at=at, episode=reward.episode, group=group, family=reward.family or "",
            step=reward.step, evaluation=evaluation, status=row.status if row is not None else "unknown",
            reward=reward.total if reward.total is not None else 0.0, components=reward.components,
            attempts=len(attempts), accepted_attempt=outcome.first_valid_attempt if outcome is not None else None)]
        job = self.run.job(f"{reward.episode}-job")
        if job is None or job.state.value not in ("done", "dead"):
            return points
        result = job.progress
        steps = (result.metrics or {}).get("steps") or ((result.train.metrics if result.train else {}) or {}).get(
            "steps") or []
        rewards = [_float(s["reward_mean"]) for s in steps if isinstance(s, dict)
                   and isinstance(s.get("reward_mean"), (int, float))]
        self.jobs += 1
        dead = job.state.value == "dead"
        if not dead and result.uplift is not None and group:
            self.uplifts.setdefault(group, []).append(result.uplift)
        points.append(JobPoint(
            seq=seq, x=self.jobs, at=at, job=job.id, episode=reward.episode, family=reward.family or "",
            status="dead" if dead else "done", base_model=result.base_model, pre=result.pre, post=result.post,
            uplift=result.uplift, uplift_ci=result.uplift_ci, eval_size=result.eval_size, train_rewards=rewards,
            train_seconds=result.train_seconds, wall_seconds=job.wall_s, cost_usd=job.cost_usd or 0.0,
            dead_reason=(result.reason or result.dead_reason) if dead else None))
        return points

    def _step(self, step: OuterStep, seq: int, at: float) -> StepPoint:
        uplifts = [u for group in step.groups for u in self.uplifts.get(group, [])]
        update = {k: _float(v) for k, v in step.metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return StepPoint(seq=seq, x=step.step, at=at, mean_reward=step.mean_reward, components=step.components,
                         jobs_trained=len(uplifts), mean_uplift=mean(uplifts) if uplifts else None,
                         cost_usd=float(step.compute.get("jobs_usd", 0.0)), seconds=step.seconds,
                         policy_version=step.policy_version, dropped=step.dropped, skipped=step.skipped, update=update)


class _Fed:
    """One tracker (made on its thread by ``make``), its cursor (the last event ``seq`` it was fed) and its state."""

    def __init__(self, name: str, make: Callable[[], Tracker], folder: Path):
        self.name = name
        self.make = make
        self.tracker: Tracker | None = None
        self.cursor_file = folder / f"{name}.cursor"
        self.cursor: int | None = None
        self.failed = False
        self.calling: str | None = None  # the tracker's method running now
        self.abandoned = False  # left behind at the end of the run

    def read_cursor(self) -> int | None:
        try:
            return int(json.loads(self.cursor_file.read_text())["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save_cursor(self, seq: int) -> None:
        self.cursor = seq
        temporary = self.cursor_file.with_suffix(".tmp")
        temporary.write_text(json.dumps({"seq": seq}))
        temporary.replace(self.cursor_file)


class Tracking:
    """Feeds ``trackers`` (name -> what makes the tracker) from run ``run_id``'s ledger while the block runs, each on
    a thread of its own; ``warn`` gets one line per tracker that fails. ``with Tracking(...): ...`` starts the
    threads; leaving the block has each feed what is left, tell its tracker how the run ended (when it did end: a
    finished or stopped run) and close it, waiting at most ``STOP_WAIT_S`` for them all: a tracker still in a call
    then is named and left behind (abandoned: a resume feeds it what it missed)."""

    def __init__(self, runs_dir: Path, run_id: str, trackers: dict[str, Callable[[], Tracker]],
                 warn: Callable[[str], None]):
        self.runs_dir = Path(runs_dir)
        self.run_id = run_id
        self.fed = [_Fed(name, tracker, self.runs_dir / run_id / "trackers") for name, tracker in trackers.items()]
        self._warn = warn
        self._warned = threading.Lock()  # one line at a time, from any thread
        self._stop = threading.Event()
        self._threads: list[tuple[_Fed, threading.Thread]] = []

    def __enter__(self) -> Tracking:
        for fed in self.fed:
            thread = threading.Thread(target=self._main, args=(fed,), name=f"aitrainsai-tracker-{fed.name}",
                                      daemon=True)
            thread.start()
            self._threads.append((fed, thread))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        deadline = time.monotonic() + STOP_WAIT_S
        for _, thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for fed, thread in self._threads:
            if thread.is_alive():
                fed.abandoned = True
                self.warn(f"tracker {fed.name}: still in {fed.calling or 'a call'}() {STOP_WAIT_S:.0f} s after the "
                          "end of the run; abandoned (a resume feeds it what it missed)")

    def warn(self, line: str) -> None:
        with self._warned:
            try:
                self._warn(line)
            except Exception:  # noqa: BLE001 - a warning that cannot be shown must not end a tracker's thread
                pass

    # -- a tracker's thread ----------------------------------------------------------------------------------------
    def _main(self, fed: _Fed) -> None:
        try:
            ledger = Ledger(self.runs_dir)
        except Exception as exc:  # noqa: BLE001 - nothing here may reach the run
            self.warn(f"tracker {fed.name}: the ledger cannot be read ({exc}); it records nothing this run")
            return
        try:
            self._feed(fed, ledger.run(self.run_id))
        except Exception as exc:  # noqa: BLE001 - the ledger's (a tracker's own errors stop in _call)
            self.warn(f"tracker {fed.name}: reading the ledger failed ({_said(exc)}); it records nothing more this "
                      "run")
        finally:
            if fed.tracker is not None:
                self._call(fed, "close", fed.tracker.close)
            ledger.close()

    def _feed(self, fed: _Fed, run: Run) -> None:
        info = run.info()
        plugins = {str(p.get("name")): str(p.get("version")) for p in info.plugins}
        fed.cursor = fed.read_cursor()
        tracked = TrackedRun(run_id=run.id, name=info.name, run_dir=run.dir, config=info.config, plugins=plugins,
                             created_at=info.created_at, resumed=fed.cursor is not None)
        if not self._call(fed, "start", functools.partial(self._start, fed, tracked)):
            return
        points = _Points(run)
        while not fed.abandoned:
            stopping = self._stop.is_set()
            new = [p for p in points.read() if p.seq > (fed.cursor or 0)]
            if new and not self._call(fed, "log", functools.partial(self._log, fed, new)):
                return
            if stopping:
                break
            self._stop.wait(POLL_S)
        if points.end is not None and not fed.abandoned:
            assert fed.tracker is not None
            self._call(fed, "finish", functools.partial(fed.tracker.finish, points.end))

    @staticmethod
    def _start(fed: _Fed, tracked: TrackedRun) -> None:
        fed.cursor_file.parent.mkdir(parents=True, exist_ok=True)
        fed.tracker = fed.make()
        fed.tracker.start(tracked)
        if fed.cursor is None:
            fed.save_cursor(0)

    @staticmethod
    def _log(fed: _Fed, points: list[Any]) -> None:
        assert fed.tracker is not None  # a tracker that failed to start is never fed
        fed.tracker.log(points)
        fed.save_cursor(points[-1].seq)

    def _call(self, fed: _Fed, what: str, call: Callable[[], Any]) -> bool:
        """Runs one of the tracker's calls; False (the tracker named, once, and fed nothing more) if it raised."""
        fed.calling = what
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - a tracker's failure is its own, SystemExit included
            said = _said(exc)
            if fed.failed or fed.abandoned:
                pass  # named already
            elif what == "close":
                self.warn(f"tracker {fed.name} failed to close ({said})")
            else:
                self.warn(f"tracker {fed.name} failed ({said}); it records nothing more this run")
            fed.failed = True
            return False
        finally:
            fed.calling = None
        return True


def _said(exc: BaseException) -> str:
    """``Type: message`` (cut short), for one line; just the type when the message cannot be made."""
    try:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception:  # noqa: BLE001 - a tracker's exception is its own code, its __str__ too
        return type(exc).__name__


def _float(value: int | float) -> float:
    """``value`` as a float; an int beyond a double as inf (with its sign), for the point to name."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
