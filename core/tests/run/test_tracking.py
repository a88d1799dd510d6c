"""The built-in JSON-lines tracker through the conformance kit; the feed from a real ledger, a thread per tracker
(whole runs: core/tests/run/test_loop.py); the records' rule for values that are not finite."""

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from aitrainsai import AnyPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker
from aitrainsai.builtin.jsonl_tracker import JsonlTracker
from aitrainsai.run import tracking
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.record import Eval, Finished, OuterStep, Reward
from aitrainsai.run.tracking import Tracking
from aitrainsai.testing import TrackerConformance

POINT = TypeAdapter(AnyPoint)


class TestJsonlTracker(TrackerConformance):
    tracker = JsonlTracker
    distribution = "aitrainsai"

    def read_back(self, run_dir: Path, options: dict[str, Any]):
        rows = []
        for line in (run_dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines():
            data = json.loads(line, parse_constant=_refuse)  # strict JSON: no Infinity, -Infinity, NaN
            if data["kind"] not in ("start", "end"):
                point = POINT.validate_python(data)
                rows += [(point.axis, name, point.x, value) for name, value in point.scalars().items()]
        return rows


def _refuse(token: str) -> Any:
    raise ValueError(f"not JSON: {token}")


# -- the feed: a real ledger, a thread per tracker ---------------------------------------------------------------
GUARD_S = 20.0  # a failure guard, never a measure: what a test waits for happens in milliseconds


class Recorder(Tracker):
    """Keeps what it is given; ``got`` is set once it holds ``want`` points."""

    name = "recorder"

    def __init__(self, want: int = 0, *, run_dir: Path):
        super().__init__(run_dir=run_dir)
        self.want = want
        self.calls: list[str] = []
        self.points: list[Any] = []
        self.end: RunEnd | None = None
        self.got = threading.Event()

    def start(self, run: TrackedRun) -> None:
        self.calls.append("start")

    def log(self, points: list[Any]) -> None:
        self.calls.append("log")
        self.points += points
        if len(self.points) >= self.want:
            self.got.set()

    def finish(self, end: RunEnd) -> None:
        self.calls.append("finish")
        self.end = end

    def close(self) -> None:
        self.calls.append("close")


class Misbehaving(Recorder):
    """A recorder that, in ``where`` (``make`` is its constructor), raises ``raises`` or, with none, blocks until
    ``release`` is set."""

    def __init__(self, where: str, raises: BaseException | None, release: threading.Event, *, run_dir: Path):
        super().__init__(run_dir=run_dir)
        self.where, self.raises, self.release = where, raises, release
        self.entered = threading.Event()
        self._misbehave("make")

    def _misbehave(self, where: str) -> None:
        if where != self.where:
            return
        self.entered.set()
        if self.raises is not None:
            raise self.raises
        self.release.wait()

    def start(self, run: TrackedRun) -> None:
        super().start(run)
        self._misbehave("start")

    def log(self, points: list[Any]) -> None:
        super().log(points)
        self._misbehave("log")

    def finish(self, end: RunEnd) -> None:
        super().finish(end)
        self._misbehave("finish")

    def close(self) -> None:
        super().close()
        self._misbehave("close")


def _steps(run: Any, steps: range) -> None:
    for step in steps:
        run.record(OuterStep(step=step, mean_reward=step / 10, components={"validation": 1.0}))
        run.record(Eval(step=step, family="triage", held_out=True, mean_reward=step / 20, uplift=[0.1]))


def _ledger_run(tmp_path: Path) -> Any:
    ledger = Ledger(tmp_path)
    return ledger.create_run({"loop": {"steps": 4}}, [{"name": "aitrainsai", "version": "0.1.0"}])


@pytest.fixture
def quick_end(monkeypatch):
    """The end of a run waits 3 s (not 60) for a tracker that does not return (room enough for a healthy one's last
    points, finish and close on a loaded machine); the threads poll often."""
    monkeypatch.setattr(tracking, "STOP_WAIT_S", 3.0)
    monkeypatch.setattr(tracking, "POLL_S", 0.05)


@pytest.mark.parametrize("where", ["start", "log", "finish", "close"])  # (its constructor: as in start)
def test_a_hung_tracker_holds_up_only_itself(tmp_path, quick_end, where):
    """A tracker that never returns (first in the run's list, as the old single thread fed it first): the other
    is fed every point, told the end and closed; the run's end waits its bound, then names the hung one
    abandoned, once."""
    run = _ledger_run(tmp_path)
    _steps(run, range(1, 3))
    release = threading.Event()
    made: dict[str, Any] = {}
    healthy = Recorder(4, run_dir=run.dir)

    def hung() -> Tracker:
        made["hung"] = Misbehaving(where, None, release, run_dir=run.dir)
        return made["hung"]

    warnings: list[str] = []
    try:
        with Tracking(tmp_path, run.id, {"hung": hung, "healthy": lambda: healthy}, warnings.append):
            assert healthy.got.wait(GUARD_S), f"the healthy tracker got {len(healthy.points)} of 4 points"
            _steps(run, range(3, 5))
            run.record(Finished(steps=4, dropped=0, skipped=0, launched=4))
        assert [(p.axis, p.x) for p in healthy.points] == [
            (axis, x) for x in range(1, 5) for axis in ("step", "eval/triage")]
        assert healthy.end == RunEnd(status="finished", steps=4)
        assert healthy.calls[-2:] == ["finish", "close"]
        assert [w for w in warnings if "hung" in w] == [
            f"tracker hung: still in {where}() 3 s after the end of the run; abandoned (a resume feeds it what it "
            "missed)"]
        assert not [w for w in warnings if "healthy" in w]
    finally:
        release.set()
    _no_tracker_threads_left()
    calls = made["hung"].calls  # released: it ends with no call after the hung one but its close
    assert calls[calls.index(where) + 1:] == ([] if where == "close" else ["close"])


EXCEPTIONS = [SystemExit(3), KeyboardInterrupt(), RuntimeError("boom")]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


@pytest.mark.parametrize("raises", [*EXCEPTIONS, Unprintable()], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("where", ["make", "start", "log", "finish", "close"])
def test_a_tracker_that_raises_is_named_once_and_the_others_go_on(tmp_path, quick_end, where, raises):
    """Whatever a tracker raises (``SystemExit`` and ``KeyboardInterrupt`` too) is its own: it is named once and fed
    nothing more (closed: it may let go of its files); the other tracker gets every point, the end and its close."""
    run = _ledger_run(tmp_path)
    _steps(run, range(1, 3))
    made: dict[str, Any] = {}
    healthy = Recorder(4, run_dir=run.dir)

    def failing() -> Tracker:
        made["failing"] = Misbehaving(where, raises, threading.Event(), run_dir=run.dir)
        return made["failing"]

    warnings: list[str] = []
    with Tracking(tmp_path, run.id, {"failing": failing, "healthy": lambda: healthy}, warnings.append):
        assert healthy.got.wait(GUARD_S), f"the healthy tracker got {len(healthy.points)} of 4 points"
        _steps(run, range(3, 5))
        run.record(Finished(steps=4, dropped=0, skipped=0, launched=4))
    assert len(healthy.points) == 8 and healthy.calls[-2:] == ["finish", "close"]
    named = [w for w in warnings if "failing" in w]
    assert len(named) == 1 and type(raises).__name__ in named[0], warnings
    assert named[0].startswith("tracker failing failed to close (" if where == "close" else "tracker failing failed (")
    if where != "make":
        calls = made["failing"].calls
        if where in ("finish", "close"):  # fed before its fault: the two phases in one batch or two
            calls = [call for i, call in enumerate(calls) if call != "log" or calls[i - 1] != "log"]
        assert calls == {"start": ["start"], "log": ["start", "log"], "finish": ["start", "log", "finish"],
                         "close": ["start", "log", "finish"]}[where] + ["close"]  # nothing more after the fault
    _no_tracker_threads_left()


def _no_tracker_threads_left() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("aitrainsai-tracker-"):
            thread.join(GUARD_S)
            assert not thread.is_alive(), thread.name


def test_values_that_are_not_finite_reach_the_trackers_named(tmp_path, quick_end):
    """A ledger holding inf, -inf, NaN and an integer beyond a double (a reward, a score, an update's metric): the
    records the trackers get hold None (or leave the item out) and name each value; the jsonl file is strict JSON."""
    run = _ledger_run(tmp_path)
    inf, nan = float("inf"), float("nan")
    run.record(OuterStep(step=1, mean_reward=inf, components={"validation": nan, "format": 1.0},
                         metrics={"tokens": 10**400, "lr": 0.01}))  # (a float metric's inf: null in the ledger)
    run.record(Reward(episode="g0000-e0", total=nan, family="calc_chain", step=1, components={"format": -inf}))
    run.record(Eval(step=1, family="triage", held_out=True, mean_reward=0.5, uplift=[inf, 0.2]))
    run.record(Finished(steps=1, dropped=0, skipped=0, launched=1))
    recorder = Recorder(3, run_dir=run.dir)
    warnings: list[str] = []
    with Tracking(tmp_path, run.id, {"recorder": lambda: recorder, "jsonl": lambda: JsonlTracker(run_dir=run.dir)},
                  warnings.append):
        assert recorder.got.wait(GUARD_S)
    assert warnings == []
    step, episode, evaluation = recorder.points
    assert step.mean_reward is None and step.components == {"format": 1.0} and step.update == {"lr": 0.01}
    assert step.nonfinite == {"mean_reward": "inf", "components/validation": "nan", "update/tokens": "inf"}
    assert (episode.reward, episode.components, episode.nonfinite) == (
        None, {}, {"reward": "nan", "components/format": "-inf"})
    assert (evaluation.mean_uplift, evaluation.nonfinite) == (None, {"mean_uplift": "inf"})
    lines = [json.loads(line, parse_constant=_refuse)
             for line in (run.dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["start", "step", "episode", "eval", "end"]
    assert lines[1]["mean_reward"] is None and lines[1]["nonfinite"]["mean_reward"] == "inf"
    assert [POINT.validate_python(line) for line in lines[1:4]] == recorder.points


@pytest.mark.parametrize("data", [{"record": {"attempts": ["x"]}}, {"record": "x"}, ["x"], {"record": {"attempts": 3}}])
def test_a_damaged_episode_row_costs_its_own_point_at_most(tmp_path, quick_end, data):
    """A damaged or foreign ledger: an episode row whose record is not what the core writes. The trackers are fed
    every other point, and the episode's own where it can still be read; the feed never stops."""
    run = _ledger_run(tmp_path)
    run.upsert_episode("g0000-e0", status="done", step=1, family="calc_chain", reward=0.5)
    run.db.write("UPDATE episodes SET data = ? WHERE id = ?", (json.dumps(data), "g0000-e0"))  # not the core's
    run.record(Reward(episode="g0000-e0", total=0.5, family="calc_chain", step=1, components={}))
    _steps(run, range(1, 3))
    run.record(Finished(steps=2, dropped=0, skipped=0, launched=1))
    recorder = Recorder(4, run_dir=run.dir)
    warnings: list[str] = []
    with Tracking(tmp_path, run.id, {"recorder": lambda: recorder}, warnings.append):
        assert recorder.got.wait(GUARD_S)
    assert warnings == []
    kinds = [type(p).__name__ for p in recorder.points]
    assert kinds[-4:] == ["StepPoint", "EvalPoint", "StepPoint", "EvalPoint"], kinds
    assert recorder.end is not None and recorder.end.status == "finished"


@pytest.mark.parametrize("stored", ['["x"]', "not json", "3"])
def test_a_damaged_event_row_is_left_out_and_the_feed_goes_on(tmp_path, quick_end, stored):
    """An event whose stored data is not a JSON object (a damaged or foreign ledger): the run's readers skip it; the
    trackers get every other point and the run's end."""
    run = _ledger_run(tmp_path)
    _steps(run, range(1, 2))
    run.db.write("INSERT INTO events (run_id, kind, data, created_at) VALUES (?, ?, ?, ?)",
                 (run.id, "outer_step", stored, 0.0))
    _steps(run, range(2, 3))
    run.record(Finished(steps=2, dropped=0, skipped=0, launched=0))
    assert [e.kind for e in run.events()].count("outer_step") == 2
    recorder = Recorder(4, run_dir=run.dir)
    with Tracking(tmp_path, run.id, {"recorder": lambda: recorder}, lambda line: None):
        assert recorder.got.wait(GUARD_S)
    kinds = [type(p).__name__ for p in recorder.points]
    assert kinds == ["StepPoint", "EvalPoint", "StepPoint", "EvalPoint"], kinds
    assert recorder.end is not None and recorder.end.status == "finished"


@pytest.mark.parametrize("value, name", [(float("inf"), "inf"), (float("-inf"), "-inf"), (float("nan"), "nan")])
def test_a_record_holds_finite_numbers_and_names_the_rest(tmp_path, value, name):
    """The one rule, in the record types: a field's value becomes None, a dict's item or a list's is left out, an
    interval missing an end is None; each is named in ``nonfinite``, and ``scalars()`` is finite. A value a point
    cannot name (a string "inf") is refused; a run's config names one as a string."""
    job = JobPoint(seq=1, x=1, job="j", episode="e", family="f", status="done", pre=0.1, post=value, uplift=value,
                   uplift_ci=(0.0, value), train_rewards=[0.1, value, 0.3], cost_usd=value)
    assert (job.post, job.uplift, job.uplift_ci, job.train_rewards, job.cost_usd) == (None, None, None, [0.1, 0.3],
                                                                                       None)
    assert job.nonfinite == {"post": name, "uplift": name, "uplift_ci/1": name, "train_rewards/1": name,
                             "cost_usd": name}
    assert all(math.isfinite(v) for v in job.scalars().values()) and "post" not in job.scalars()
    assert job.model_dump() == POINT.validate_python(job.model_dump(mode="json")).model_dump()  # read back the same
    step = StepPoint(seq=1, x=1, mean_reward=0.5, update={"loss": value, "lr": 0.1}, seconds=value)
    assert (step.update, step.seconds, step.nonfinite) == ({"lr": 0.1}, None, {"update/loss": name, "seconds": name})
    with pytest.raises(ValidationError, match="finite"):
        StepPoint(seq=1, x=1, mean_reward=name)
    run = TrackedRun(run_id="r", run_dir=tmp_path, config={"trainer": {"lr": value, "betas": [0.9, value]}})
    assert run.config == {"trainer": {"lr": name, "betas": [0.9, name]}}
