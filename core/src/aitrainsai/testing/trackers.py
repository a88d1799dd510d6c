"""The conformance kit for trackers: what every tracker must do, checked through the tracker's own store.

    class TestMyTracker(TrackerConformance):
        tracker = MyTracker
        distribution = "aitrainsai-tracker-mine"
        heavy_modules = ("mylib",)

        def read_back(self, run_dir, options):  # with the library's own reader
            return [(axis, name, x, value), ...]
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from aitrainsai.trackers import EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker

Scalar = tuple[str, str, int, float]  # axis, name (a point's scalars() key), x, value
FLOAT32_MAX = 3.4028234663852886e38  # a store of float32 values may leave out what lies beyond


def sample_points(first_seq: int = 1, scale: float = 1.0) -> list[Any]:
    """One point of every kind, two outer steps: the kit's batch (``scale`` changes every value, for a re-feed)."""
    s = first_seq
    return [
        EpisodePoint(seq=s, x=s, at=1_800_000_000.0 + s, episode=f"g0000-e{s}", group="g0000", family="calc_chain",
                     step=0, status="done", reward=0.5 * scale, components={"validation": 1.0 * scale}, attempts=1,
                     accepted_attempt=1),
        JobPoint(seq=s, x=s, at=1_800_000_000.0 + s, job=f"g0000-e{s}-job", episode=f"g0000-e{s}",
                 family="calc_chain", status="done", base_model="tiny", pre=0.25, post=0.5 * scale,
                 uplift=0.25 * scale, uplift_ci=(0.1, 0.4), eval_size=32, train_rewards=[0.1, 0.3 * scale],
                 train_seconds=12.0, wall_seconds=20.0),
        StepPoint(seq=s + 1, x=s, at=1_800_000_100.0 + s, mean_reward=0.6 * scale,
                  components={"validation": 1.0, "job_quality": 0.4 * scale}, jobs_trained=1,
                  mean_uplift=0.25 * scale, update={"loss": -0.1 * scale}),
        EvalPoint(seq=s + 2, axis="eval/triage", x=s, at=1_800_000_200.0 + s, family="triage", held_out=True,
                  mean_reward=0.3 * scale, mean_uplift=0.1 * scale, jobs=2),
    ]


def extreme_points(first_seq: int = 1) -> list[Any]:
    """Points holding what a reward, a score or an update may compute: inf, -inf, NaN, and 1e300 (a finite double
    beyond a float32's range) beside ordinary values."""
    s, inf, nan = first_seq, float("inf"), float("nan")
    return [
        EpisodePoint(seq=s, x=s, at=1_800_000_000.0 + s, episode=f"g0000-e{s}", group="g0000", family="calc_chain",
                     step=0, status="done", reward=nan, components={"validation": inf, "format": 1.0}, attempts=1),
        JobPoint(seq=s, x=s, at=1_800_000_000.0 + s, job=f"g0000-e{s}-job", episode=f"g0000-e{s}",
                 family="calc_chain", status="done", pre=0.25, post=inf, uplift=inf, uplift_ci=(0.1, inf),
                 train_rewards=[nan, 0.2, -inf], train_seconds=1e300),
        StepPoint(seq=s + 1, x=s, at=1_800_000_100.0 + s, mean_reward=-inf, components={"validation": 1.0,
                  "job_quality": nan}, jobs_trained=1, mean_uplift=inf, update={"loss": inf, "grad_norm": 1e300}),
        EvalPoint(seq=s + 2, axis="eval/triage", x=s, at=1_800_000_200.0 + s, family="triage", held_out=True,
                  mean_reward=0.3, mean_uplift=-inf, jobs=2),
    ]


def expected(points: list[Any]) -> list[Scalar]:
    return [(p.axis, name, p.x, value) for p in points for name, value in p.scalars().items()]


class TrackerConformance:
    """Subclass with ``tracker``, ``distribution``, ``heavy_modules`` and :meth:`read_back`; ``options`` are the
    tracker's options for the tests (its store under the test's folder)."""

    tracker: ClassVar[type[Tracker]]
    distribution: ClassVar[str]
    heavy_modules: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[dict[str, Any]] = {}

    def read_back(self, run_dir: Path, options: dict[str, Any]) -> list[Scalar]:
        """Every scalar the tracker stored for the run in ``run_dir``, read with the library's own reader, one entry
        per stored value (a value stored twice appears twice)."""
        pytest.fail(f"{type(self).__name__} must implement read_back() to read what the tracker stored")

    def prepare(self, run_dir: Path) -> None:
        """Called before a test's first tracker in ``run_dir`` is made (e.g. to copy a store made once). Default:
        nothing."""

    def make(self, run_dir: Path) -> Tracker:
        return self.tracker(self.tracker.Config.model_validate(self.options), run_dir=run_dir)

    @staticmethod
    def run(run_dir: Path, resumed: bool = False) -> TrackedRun:
        return TrackedRun(run_id="20261205-000000-abcd", name="kit", run_dir=run_dir, resumed=resumed,
                          config={"loop": {"steps": 2}, "trackers": ["kit"]}, plugins={"aitrainsai": "0.1.0"})

    # -- the checks ------------------------------------------------------------------------------------------------
    def test_registered_by_its_distribution(self):
        from aitrainsai.plugins import Plugins

        assert self.tracker.name in Plugins.load([self.distribution]).trackers

    def test_importing_the_plugin_loads_no_tracking_library(self):
        module = self.tracker.__module__
        code = (f"import sys, {module}; print(sorted(m for m in {list(self.heavy_modules)!r} if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"

    def test_what_is_logged_reads_back(self, tmp_path):
        self.prepare(tmp_path)
        tracker = self.make(tmp_path)
        first, second = sample_points(1), sample_points(3)
        try:
            tracker.start(self.run(tmp_path))
            tracker.log(first)
            tracker.log(second)
            tracker.finish(RunEnd(status="finished", steps=2))
        finally:
            tracker.close()
        stored = self.read_back(tmp_path, self.options)
        want = expected(first + second)
        assert _keys(stored) == _keys(want)
        got = {(a, n, x): v for a, n, x, v in stored}
        for axis, name, x, value in want:
            assert got[axis, name, x] == pytest.approx(value, rel=1e-5), (axis, name, x)

    def test_a_resumed_run_continues_with_no_duplicate_point(self, tmp_path):
        """Killed after writing points the core did not see written: the resumed tracker is fed them again (here
        with other values) and then new ones; each (axis, name, x) is stored once (the old value or the new)."""
        first = sample_points(1)
        again, new = sample_points(3, scale=1.5), sample_points(5)
        self.prepare(tmp_path)
        before = self.make(tmp_path)
        try:
            before.start(self.run(tmp_path))
            before.log(first + sample_points(3))
        finally:
            before.close()  # no finish: the run did not end
        after = self.make(tmp_path)
        try:
            after.start(self.run(tmp_path, resumed=True))
            after.log(again + new)
            after.finish(RunEnd(status="finished", steps=3))
        finally:
            after.close()
        stored = self.read_back(tmp_path, self.options)
        keys = [(a, n, x) for a, n, x, _ in stored]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        assert not duplicates, f"stored twice: {duplicates[:5]}"
        assert set(keys) == _keys(expected(first + again + new))
        got = {(a, n, x): v for a, n, x, v in stored}
        old = {(a, n, x): v for a, n, x, v in expected(sample_points(3))}
        for axis, name, x, value in expected(again):
            assert got[axis, name, x] in (pytest.approx(value, rel=1e-5), pytest.approx(old[axis, name, x], rel=1e-5))

    def test_a_value_that_is_not_finite_is_never_stored(self, tmp_path):
        """inf, -inf and NaN reach a tracker as absent (the records name them in ``nonfinite``); what the tracker
        stores reads back finite, every ordinary value with it. A finite value its store cannot hold (1e300 in a
        float32) is left out, never stored as inf."""
        points = extreme_points(1)
        self.prepare(tmp_path)
        tracker = self.make(tmp_path)
        try:
            tracker.start(self.run(tmp_path))
            tracker.log(points)
            tracker.finish(RunEnd(status="finished", steps=1))
        finally:
            tracker.close()
        stored = self.read_back(tmp_path, self.options)
        assert [row for row in stored if not (isinstance(row[3], (int, float)) and math.isfinite(row[3]))] == []
        want = {(a, n, x): v for a, n, x, v in expected(points)}
        got = {(a, n, x): v for a, n, x, v in stored}
        assert set(got) <= set(want), f"stored what no record holds: {sorted(set(got) - set(want))}"
        ordinary = {key for key, value in want.items() if abs(value) <= FLOAT32_MAX}
        assert ordinary <= set(got), f"left out: {sorted(ordinary - set(got))}"
        for key, value in got.items():
            assert value == pytest.approx(want[key], rel=1e-5), key

    def test_a_store_that_cannot_be_written_raises(self, tmp_path):
        """A run folder that is a file: the tracker raises (the core turns it off); it does not hang."""
        blocked = tmp_path / "not-a-folder"
        blocked.write_text("")
        tracker = self.make(blocked)
        with pytest.raises(Exception):  # noqa: B017, PT011 - any error: the core turns the tracker off
            try:
                tracker.start(self.run(blocked))
                tracker.log(sample_points(1))
            finally:
                tracker.close()


def _keys(scalars: list[Scalar]) -> set[tuple[str, str, int]]:
    return {(a, n, x) for a, n, x, _ in scalars}
