"""The TensorBoard tracker, read back with TensorBoard's own readers (both Python event accumulators)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.util import tensor_util

from aitrainsai import EpisodePoint, EvalPoint, JobPoint, Plugins, RunEnd, StepPoint, TrackedRun
from aitrainsai.testing import TrackerConformance
from aitrainsai_tracker_tensorboard.tracker import TensorBoardConfig, TensorBoardTracker

CONFIG = {"name": "demo", "outer_trainer": {"use": "recipe", "lr": 0.01}, "families": ["arith", "logic"]}
PLUGINS = {"aitrainsai": "0.1.0", "aitrainsai-tracker-tensorboard": "0.1.0"}
T0 = 1_700_000_000.0


def run_info(run_dir: Path, resumed: bool = False) -> TrackedRun:
    return TrackedRun(run_id="r1", name="demo", run_dir=run_dir, config=CONFIG, plugins=PLUGINS, created_at=T0,
                      resumed=resumed)


def step(x: int, reward: float) -> StepPoint:
    return StepPoint(seq=100 + x, x=x, at=T0 + x, mean_reward=reward, components={"validation": reward / 2},
                     jobs_trained=2, mean_uplift=reward / 10, cost_usd=0.5, seconds=3.0, policy_version=x,
                     update={"loss": 1.0 - reward})


def episode(x: int, reward: float) -> EpisodePoint:
    return EpisodePoint(seq=200 + x, x=x, at=T0 + 10 + x, episode=f"e{x}", family="arith", status="done",
                        reward=reward, components={"format": 1.0}, attempts=2, accepted_attempt=1)


def job(x: int, post: float | None) -> JobPoint:
    if post is None:
        return JobPoint(seq=300 + x, x=x, at=T0 + 20 + x, job=f"j{x}", episode=f"e{x}", family="arith",
                        status="dead", dead_reason="oom", cost_usd=0.1)
    return JobPoint(seq=300 + x, x=x, at=T0 + 20 + x, job=f"j{x}", episode=f"e{x}", family="arith", status="done",
                    pre=0.2, post=post, uplift=post - 0.2, uplift_ci=(post - 0.3, post - 0.1), eval_size=64,
                    train_rewards=[0.1, 0.4, 0.7], train_seconds=12.0, wall_seconds=30.0, cost_usd=0.2)


def evaluation(family: str, x: int, reward: float) -> EvalPoint:
    return EvalPoint(seq=400 + x, axis=f"eval/{family}", x=x, at=T0 + 30 + x, family=family, held_out=False,
                     mean_reward=reward, mean_uplift=reward / 10, jobs=4)


def read(folder: Path, plugin: bool = False) -> dict[str, list[tuple[int, float, object]]]:
    """Every tag of one TensorBoard run: (step, wall time, value) in order, as TensorBoard's reader keeps them: the
    classic ``EventAccumulator`` (scalars and text tensors), or the one TensorBoard's Python data provider uses."""
    module = plugin_event_accumulator if plugin else event_accumulator
    guidance = {module.TENSORS: 0} | ({} if plugin else {module.SCALARS: 0})  # 0: keep every event
    acc = module.EventAccumulator(str(folder), size_guidance=guidance)
    acc.Reload()
    out: dict[str, list[tuple[int, float, object]]] = {}
    if not plugin:
        for tag in acc.Tags()[module.SCALARS]:
            out[tag] = [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()[module.TENSORS]:
        rows = []
        for e in acc.Tensors(tag):
            value = tensor_util.make_ndarray(e.tensor_proto)
            rows.append((e.step, e.wall_time, value.item().decode() if value.dtype == object else float(value)))
        out[tag] = rows
    return out


def values(rows) -> dict[int, float]:
    steps = [s for s, _, _ in rows]
    assert len(steps) == len(set(steps)), f"a step twice: {steps}"
    return {s: v for s, _, v in rows}


def test_fresh_run_writes_a_run_per_axis_and_the_config_once(tmp_path):
    tracker = TensorBoardTracker(run_dir=tmp_path)
    tracker.start(run_info(tmp_path))
    tracker.log([step(1, 0.25), episode(1, 0.5), job(1, 0.6), episode(2, 0.75), job(2, None)])
    tracker.log([evaluation("arith", 0, 0.3), step(2, 0.5), evaluation("arith", 2, 0.4)])
    tracker.finish(RunEnd(status="finished", steps=2))
    tracker.close()

    root = tmp_path / "trackers" / "tensorboard"
    assert tracker.folder == root
    assert sorted(p.name for p in root.iterdir()) == ["episode", "eval-arith", "job", "step"]
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(root))
    multiplexer.Reload()
    assert sorted(multiplexer.Runs()) == ["episode", "eval-arith", "job", "step"]

    for plugin in (False, True):
        steps = read(root / "step", plugin)
        assert values(steps["reward"]) == {1: 0.25, 2: 0.5}
        assert values(steps["component/validation"]) == {1: 0.125, 2: 0.25}
        assert values(steps["update/loss"]) == {1: 0.75, 2: 0.5}
        assert values(steps["policy_version"]) == {1: 1.0, 2: 2.0}
        assert [w for _, w, _ in steps["reward"]] == [T0 + 1, T0 + 2]  # wall time: when the ledger recorded it
        [(config_step, _, config)] = steps["config"]
        assert config_step == 0 and json.loads(config) == CONFIG  # a markdown code block of the JSON
        [(_, _, plugins)] = steps["plugins"]
        assert "- aitrainsai-tracker-tensorboard 0.1.0" in plugins

        episodes = read(root / "episode", plugin)
        assert values(episodes["reward"]) == {1: 0.5, 2: 0.75}
        assert values(episodes["component/format"]) == {1: 1.0, 2: 1.0}
        jobs = read(root / "job", plugin)
        assert values(jobs["post"]) == pytest.approx({1: 0.6})  # the dead job has no scores
        assert values(jobs["dead"]) == {1: 0.0, 2: 1.0}
        assert values(jobs["train_reward_last"]) == pytest.approx({1: 0.7})
        assert values(jobs["uplift_low"]) == pytest.approx({1: 0.3})
        assert values(read(root / "eval-arith", plugin)["reward"]) == pytest.approx({0: 0.3, 2: 0.4})


CHILD = """
import json, os, sys
from pathlib import Path
from pydantic import TypeAdapter
from aitrainsai import AnyPoint, TrackedRun
import aitrainsai_tracker_tensorboard.plugin
from aitrainsai_tracker_tensorboard.tracker import TensorBoardTracker
assert "tensorboard" not in sys.modules, "the tracker's modules import tensorboard only when used"
args = json.loads(sys.argv[1])
tracker = TensorBoardTracker(run_dir=Path(args["run_dir"]))
tracker.start(TrackedRun.model_validate(args["run"]))
tracker.log(TypeAdapter(list[AnyPoint]).validate_python(args["points"]))
assert "torch" not in sys.modules and "tensorflow" not in sys.modules
os._exit(0)  # killed: no finish, no close, no flush at exit
"""


def killed_after(run_dir: Path, points) -> None:
    """A process that starts a fresh tracker, logs ``points`` and dies without finishing or closing it."""
    args = {"run_dir": str(run_dir), "run": run_info(run_dir).model_dump(mode="json"),
            "points": [p.model_dump(mode="json") for p in points]}
    subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], check=True, timeout=60)


def test_resume_after_a_kill_replaces_the_points_fed_again(tmp_path):
    killed_after(tmp_path, [evaluation("arith", 0, 0.1), step(1, 0.2), episode(1, 0.1), step(2, 0.3),
                            episode(2, 0.2), job(1, 0.5), step(3, 0.4), episode(3, 0.3), episode(4, 0.4),
                            job(2, 0.6)])
    # The core had moved its cursor past step 1 and episode 2 only: steps 2-3, episodes 3-4, job 2 come again
    # (with other numbers), then new points, one on an axis the killed process never wrote.
    tracker = TensorBoardTracker(run_dir=tmp_path)
    tracker.start(run_info(tmp_path, resumed=True))
    tracker.log([step(2, 0.33), episode(3, 0.35), episode(4, 0.45), job(2, 0.65), step(3, 0.44)])
    tracker.log([step(4, 0.55), episode(5, 0.55), job(3, 0.7), evaluation("arith", 4, 0.5),
                 evaluation("logic", 4, 0.6)])
    tracker.finish(RunEnd(status="finished", steps=5))
    tracker.close()

    root = tmp_path / "trackers" / "tensorboard"
    for plugin in (False, True):
        steps = read(root / "step", plugin)
        assert values(steps["reward"]) == pytest.approx({1: 0.2, 2: 0.33, 3: 0.44, 4: 0.55})
        assert values(steps["update/loss"]) == pytest.approx({1: 0.8, 2: 0.67, 3: 0.56, 4: 0.45})
        assert [s for s, _, _ in steps["config"]] == [0]  # written by the first process only
        episodes = read(root / "episode", plugin)
        assert values(episodes["reward"]) == pytest.approx({1: 0.1, 2: 0.2, 3: 0.35, 4: 0.45, 5: 0.55})
        assert values(episodes["attempts"]) == {1: 2, 2: 2, 3: 2, 4: 2, 5: 2}
        jobs = read(root / "job", plugin)
        assert values(jobs["post"]) == pytest.approx({1: 0.5, 2: 0.65, 3: 0.7})
        assert values(read(root / "eval-arith", plugin)["reward"]) == pytest.approx({0: 0.1, 4: 0.5})
        assert values(read(root / "eval-logic", plugin)["reward"]) == pytest.approx({4: 0.6})
        for folder in root.iterdir():  # every tag of every axis: each step once
            for rows in read(folder, plugin).values():
                values(rows)


def test_a_point_fed_twice_in_one_process_is_replaced_and_the_config_stays_once(tmp_path):
    first = TensorBoardTracker(run_dir=tmp_path)
    first.start(run_info(tmp_path))
    first.log([step(1, 0.1)])  # left open: as if killed
    second = TensorBoardTracker(run_dir=tmp_path)
    second.start(run_info(tmp_path, resumed=True))
    second.log([step(1, 0.2), step(2, 0.3)])
    second.log([step(2, 0.35), step(3, 0.4)])  # the core never does this; replaced all the same
    second.close()
    first.close()

    for plugin in (False, True):
        steps = read(tmp_path / "trackers" / "tensorboard" / "step", plugin)
        assert values(steps["reward"]) == pytest.approx({1: 0.2, 2: 0.35, 3: 0.4})
        [(_, _, config)] = steps["config"]
        assert json.loads(config) == CONFIG


def test_a_replay_from_step_zero_writes_the_config_again_after_its_start(tmp_path):
    first = TensorBoardTracker(run_dir=tmp_path)
    first.start(run_info(tmp_path))
    first.log([step(0, 0.1)])
    second = TensorBoardTracker(run_dir=tmp_path)
    second.start(run_info(tmp_path, resumed=True))
    second.log([step(0, 0.2)])
    second.close()
    first.close()
    # The START at step 0 drops the first copy (TensorBoard's data provider drops text too; the classic
    # EventAccumulator purges only scalars, images, ... so it would show both copies: outer steps start at 1).
    steps = read(tmp_path / "trackers" / "tensorboard" / "step", plugin=True)
    assert values(steps["reward"]) == pytest.approx({0: 0.2})
    assert len(steps["config"]) == 1


def test_logdir_option_puts_the_run_under_its_id_and_a_resume_into_an_empty_one_writes_the_config(tmp_path):
    tracker = TensorBoardTracker(TensorBoardConfig(logdir="tb"), run_dir=tmp_path / "run")
    tracker.start(run_info(tmp_path / "run", resumed=True))  # e.g. logdir changed on resume: nothing there yet
    tracker.log([step(3, 0.5)])
    tracker.close()
    steps = read(tmp_path / "run" / "tb" / "r1" / "step")
    assert values(steps["reward"]) == {3: 0.5}
    assert len(steps["config"]) == 1

    absolute = TensorBoardTracker(TensorBoardConfig(logdir=str(tmp_path / "all")), run_dir=tmp_path / "run")
    absolute.start(run_info(tmp_path / "run"))
    absolute.log([episode(1, 0.5)])
    absolute.close()
    assert values(read(tmp_path / "all" / "r1" / "episode")["reward"]) == {1: 0.5}


def test_a_value_a_float32_cannot_hold_is_left_out_and_named_at_its_step(tmp_path):
    """inf, -inf, NaN (absent from the record, named in it) and 1e300 (finite, beyond a float32: it would read back
    as inf) are never written as scalars; a text ``nonfinite`` at the point's step names each, and the point's
    other values are there."""
    inf = float("inf")
    tracker = TensorBoardTracker(run_dir=tmp_path)
    tracker.start(run_info(tmp_path))
    tracker.log([step(1, 0.25), StepPoint(seq=102, x=2, at=T0 + 2, mean_reward=-inf, components={"validation": 0.5},
                                          update={"loss": float("nan"), "grad_norm": 1e300}),
                 job(1, inf), episode(1, 0.5)])
    tracker.close()

    root = tmp_path / "trackers" / "tensorboard"
    for plugin in (False, True):
        steps = read(root / "step", plugin)
        assert values(steps["reward"]) == {1: 0.25}
        assert values(steps["component/validation"]) == {1: 0.125, 2: 0.5}
        assert values(steps["update/loss"]) == {1: 0.75} and "update/grad_norm" not in steps
        assert values(steps["nonfinite"]) == {2: "mean_reward: -inf\nupdate/grad_norm: 1e+300 (beyond a float32)\n"
                                                 "update/loss: nan"}
        jobs = read(root / "job", plugin)
        assert "post" not in jobs and "uplift" not in jobs and values(jobs["pre"]) == pytest.approx({1: 0.2})
        assert values(jobs["nonfinite"]) == {1: "post: inf\nuplift: inf\nuplift_ci/0: inf\nuplift_ci/1: inf"}
        assert "nonfinite" not in read(root / "episode", plugin)
        for rows in [*steps.values(), *jobs.values()]:
            assert all(isinstance(v, str) or math.isfinite(v) for _, _, v in rows)


def test_an_unwritable_store_raises(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(OSError):
        TensorBoardTracker(run_dir=blocker / "run").start(run_info(blocker / "run"))
    tracker = TensorBoardTracker(TensorBoardConfig(logdir=str(blocker / "tb")), run_dir=tmp_path)
    with pytest.raises(OSError):
        tracker.start(run_info(tmp_path))
    tracker.close()


def test_preflight_gives_one_line_per_bad_option(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert TensorBoardTracker.preflight(TensorBoardConfig()) == []
    assert TensorBoardTracker.preflight(TensorBoardConfig(logdir=str(tmp_path / "new" / "tb"))) == []
    assert TensorBoardTracker.preflight(TensorBoardConfig(logdir="relative/tb")) == []
    [line] = TensorBoardTracker.preflight(TensorBoardConfig(logdir=str(blocker / "tb")))
    assert "logdir" in line and "blocker" in line and "\n" not in line
    [line] = TensorBoardTracker.preflight(TensorBoardConfig(logdir=" "))
    assert "logdir" in line
    with pytest.raises(ValidationError):
        TensorBoardConfig(log_dir="tb")  # unknown options are errors


def test_registered_under_its_entry_point(tmp_path):
    plugins = Plugins.load("aitrainsai-tracker-tensorboard")
    assert plugins.trackers.get("tensorboard") is TensorBoardTracker
    tracker = plugins.trackers.create("tensorboard", {"logdir": "tb"}, run_dir=tmp_path)
    assert isinstance(tracker, TensorBoardTracker) and tracker.config.logdir == "tb"


class TestTensorBoardConformance(TrackerConformance):
    tracker = TensorBoardTracker
    distribution = "aitrainsai-tracker-tensorboard"
    heavy_modules = ("tensorboard",)

    def read_back(self, run_dir, options):
        """Every scalar, one entry per value TensorBoard's classic reader keeps (the folder names the axis)."""
        root = run_dir / "trackers" / "tensorboard"
        rows = []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            axis = folder.name.replace("eval-", "eval/", 1) if folder.name.startswith("eval-") else folder.name
            for tag, events in read(folder).items():
                rows += [(axis, tag, step, value) for step, _, value in events if not isinstance(value, str)]
        return rows
