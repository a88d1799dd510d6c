"""The mlflow tracker against real MLflow stores (SQLite files under tmp), read back with MLflow's own client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# MLflow's usage telemetry posts to its makers' servers; nothing here may leave the machine (the tracker sets the
# same default; this makes sure of it before anything imports MLflow).
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

from mlflow.entities import ViewType  # noqa: E402 - the library must import: no silent skip
from mlflow.tracking import MlflowClient  # noqa: E402

from aitrainsai import EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun  # noqa: E402
from aitrainsai.testing import TrackerConformance  # noqa: E402
from aitrainsai_tracker_mlflow.tracker import RUN_ID_TAG, MlflowConfig, MlflowTracker  # noqa: E402

T0 = 1_700_000_000.0
CONFIG = {"name": "demo", "reward_spec": "default", "loop": {"steps": 5, "group_size": 2, "final_eval": True},
          "families": {"train": ["arith", "sort"], "held_out": ["count"], "level": None},
          "outer_trainer": {"use": "recipe", "recipe": {"learning_rate": 0.001, "prompt": "x" * 7000,
                                                        "api_key": "sk-hidden"}},
          "trackers": ["mlflow"], "tracker": {"mlflow": {"tracking_uri": "http://user:pw@127.0.0.1:1"}}}


def step(x: int, reward: float, uplift: float | None = None) -> StepPoint:
    return StepPoint(seq=10 * x, x=x, at=T0 + x, mean_reward=reward, components={"validation": reward / 2},
                     mean_uplift=uplift, update={"loss": 1.0 / x})


def episode(x: int, reward: float) -> EpisodePoint:
    return EpisodePoint(seq=10 * x + 1, x=x, at=T0 + x, episode=f"e{x}", family="arith", status="scored",
                        reward=reward, attempts=1)


def tracked(run_dir: Path, run_id: str, *, resumed: bool = False) -> TrackedRun:
    return TrackedRun(run_id=run_id, name="demo", run_dir=run_dir, config=CONFIG, created_at=T0,
                      plugins={"aitrainsai": "0.1.0", "aitrainsai-tracker-mlflow": "0.1.0"}, resumed=resumed)


def database(run_dir: Path) -> Path:
    return run_dir / "trackers" / "mlflow" / "mlflow.db"


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store made once by the tracker in its default place (a new SQLite store runs MLflow's migrations: seconds);
    each test starts from a copy."""
    run_dir = tmp_path_factory.mktemp("template")
    tracker = MlflowTracker(run_dir=run_dir)
    tracker.start(tracked(run_dir, "template"))
    tracker.close()
    assert database(run_dir).is_file()
    return database(run_dir)


@pytest.fixture
def run_dir(tmp_path: Path, template: Path) -> Path:
    database(tmp_path).parent.mkdir(parents=True)
    shutil.copyfile(template, database(tmp_path))
    return tmp_path


def client_of(run_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{database(run_dir).resolve().as_posix()}")


def runs_tagged(client: MlflowClient, run_id: str, experiment: str = "aitrainsai") -> list:
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return client.search_runs([experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}'", run_view_type=ViewType.ALL)


def test_logs_params_tags_and_metrics_then_finishes(run_dir: Path) -> None:
    tracker = MlflowTracker(run_dir=run_dir)
    tracker.start(tracked(run_dir, "r-finish"))
    tracker.log([step(1, 0.5), episode(1, 0.25), episode(2, 0.75),
                 JobPoint(seq=12, x=1, at=T0 + 2, job="e1-job", episode="e1", family="arith", status="done",
                          pre=0.1, post=0.4, uplift=0.3, uplift_ci=(0.1, 0.5), train_rewards=[0.2, 0.6]),
                 EvalPoint(seq=13, axis="eval/count", x=1, at=T0 + 3, family="count", held_out=True,
                           mean_reward=0.6, jobs=2)])
    tracker.log([step(2, 0.7, uplift=0.2)])
    tracker.finish(RunEnd(status="finished", steps=2))
    tracker.close()
    tracker.close()  # a second close is harmless

    client = client_of(run_dir)
    [run] = runs_tagged(client, "r-finish")
    assert run.info.run_id == tracker.mlflow_run_id and run.info.run_name == "r-finish"
    assert run.info.status == "FINISHED" and run.info.end_time is not None and run.info.start_time == T0 * 1000
    assert history(client, run.info.run_id, "step/reward") == [(1, 0.5), (2, 0.7)]
    assert history(client, run.info.run_id, "step/mean_uplift") == [(2, 0.2)]  # absent at step 1
    assert history(client, run.info.run_id, "step/component/validation") == [(1, 0.25), (2, 0.35)]
    assert history(client, run.info.run_id, "step/update/loss") == [(1, 1.0), (2, 0.5)]
    assert history(client, run.info.run_id, "episode/reward") == [(1, 0.25), (2, 0.75)]
    assert history(client, run.info.run_id, "job/uplift") == [(1, 0.3)]
    assert history(client, run.info.run_id, "job/train_reward_last") == [(1, 0.6)]
    assert history(client, run.info.run_id, "eval/count/reward") == [(1, 0.6)]
    assert [m.timestamp for m in client.get_metric_history(run.info.run_id, "eval/count/jobs")] == [(T0 + 3) * 1000]
    params = run.data.params
    assert params["loop.steps"] == "5" and params["loop.final_eval"] == "true" and params["name"] == "demo"
    assert params["families.train"] == '["arith","sort"]' and params["families.level"] == "null"
    assert params["outer_trainer.recipe.learning_rate"] == "0.001"
    prompt = params["outer_trainer.recipe.prompt"]  # longer than MLflow's 6000: cut, marked
    assert len(prompt) == 6000 and prompt.endswith("...[cut]") and prompt.startswith("xxx")
    assert not [k for k in params if k.startswith("tracker") or k.endswith("api_key")]
    tags = run.data.tags
    assert tags[RUN_ID_TAG] == "r-finish" and tags["aitrainsai.plugin.aitrainsai-tracker-mlflow"] == "0.1.0"
    assert tags["aitrainsai.end"] == "finished" and tags["aitrainsai.run_dir"] == str(run_dir)
    assert not (run_dir / "trackers" / "mlflow" / "artifacts").exists()  # nothing but the store is written


def test_a_resumed_tracker_reopens_the_run_and_adds_no_duplicate(run_dir: Path) -> None:
    first = MlflowTracker(run_dir=run_dir)
    first.start(tracked(run_dir, "r-resume"))
    first.log([step(1, 0.1), episode(1, 0.1), episode(2, 0.2)])
    first.log([step(2, 0.2), step(3, 0.3), episode(3, 0.3)])
    # killed here: no finish, no close; the core's cursor stayed after step 1's batch

    second = MlflowTracker(run_dir=run_dir)
    second.start(tracked(run_dir, "r-resume", resumed=True))
    assert second.mlflow_run_id == first.mlflow_run_id
    second.log([step(2, 9.0), step(3, 9.0, uplift=0.5), episode(3, 9.0), step(4, 0.4), episode(4, 0.4)])
    second.finish(RunEnd(status="stopped", reason="SIGTERM received", steps=4))
    second.close()

    client = client_of(run_dir)
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "KILLED" and run.data.tags["aitrainsai.end_reason"] == "SIGTERM received"
    run_id = run.info.run_id
    assert history(client, run_id, "step/reward") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]  # first write kept
    assert history(client, run_id, "episode/reward") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert history(client, run_id, "step/mean_uplift") == [(3, 0.5)]  # new key at an old step: not a duplicate

    third = MlflowTracker(run_dir=run_dir)  # resumed after a stop: the same run runs again, fed everything again
    third.start(tracked(run_dir, "r-resume", resumed=True))
    assert client.get_run(run_id).info.status == "RUNNING"
    assert "aitrainsai.end" not in client.get_run(run_id).data.tags
    third.log([step(x, 5.0) for x in range(1, 6)] + [episode(x, 5.0) for x in range(1, 5)])
    third.finish(RunEnd(status="finished", steps=5))
    third.close()

    assert len(runs_tagged(client, "r-resume")) == 1
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key} has a step twice: {sorted(steps)}"
    assert history(client, run_id, "step/reward") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 5.0)]


def test_tracking_uri_and_experiment_options(run_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                             template: Path) -> None:
    elsewhere = tmp_path_factory.mktemp("server") / "store.db"
    shutil.copyfile(template, elsewhere)
    uri = f"sqlite:///{elsewhere.as_posix()}"
    config = MlflowConfig(tracking_uri=uri, experiment="nested rl")
    fresh = tmp_path_factory.mktemp("fresh-run")
    tracker = MlflowTracker(config, run_dir=fresh)
    tracker.start(tracked(fresh, "r-elsewhere"))
    tracker.log([step(1, 1.0)])
    tracker.close()
    assert not (fresh / "trackers").exists()
    client = MlflowClient(tracking_uri=uri)
    [run] = runs_tagged(client, "r-elsewhere", experiment="nested rl")
    assert history(client, run.info.run_id, "step/reward") == [(1, 1.0)]
    assert run.info.status == "RUNNING"  # closed without finish: as a killed run would be


@pytest.mark.parametrize("block", ["trackers", "trackers/mlflow/mlflow.db"])
def test_an_unwritable_store_raises(tmp_path: Path, block: str) -> None:
    blocker = tmp_path / block  # a directory where the store's file goes, or a file where its folder goes
    if block == "trackers":
        blocker.write_text("")
    else:
        blocker.mkdir(parents=True)
    tracker = MlflowTracker(run_dir=tmp_path)
    with pytest.raises(OSError):
        tracker.start(tracked(tmp_path, "r-blocked"))
    tracker.close()
    with pytest.raises(RuntimeError, match="not started"):
        tracker.log([step(1, 1.0)])


def test_preflight_and_options() -> None:
    assert MlflowTracker.preflight(MlflowConfig()) == []
    assert MlflowTracker.preflight(MlflowConfig(tracking_uri="http://127.0.0.1:5000")) == []
    assert MlflowTracker.preflight(MlflowConfig(tracking_uri="sqlite:////tmp/x.db")) == []
    [problem] = MlflowTracker.preflight(MlflowConfig(tracking_uri="ftp://127.0.0.1/store"))
    assert "\n" not in problem and "tracker.mlflow.tracking_uri 'ftp://127.0.0.1/store'" in problem
    with pytest.raises(ValueError):
        MlflowConfig(experiment="")
    with pytest.raises(ValueError):
        MlflowConfig(tracking_url="http://127.0.0.1:5000")  # type: ignore[call-arg]


def test_the_plugin_registers_the_tracker_and_imports_without_mlflow() -> None:
    from aitrainsai import Plugins

    assert Plugins.load(["aitrainsai-tracker-mlflow"], builtins=False).trackers.get("mlflow") is MlflowTracker
    code = ("import sys, aitrainsai_tracker_mlflow.plugin, aitrainsai_tracker_mlflow.tracker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'sqlalchemy', 'alembic')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class TestMlflowConformance(TrackerConformance):
    tracker = MlflowTracker
    distribution = "aitrainsai-tracker-mlflow"
    heavy_modules = ("mlflow", "sqlalchemy", "alembic")

    @pytest.fixture(autouse=True)
    def _template(self, template: Path) -> None:
        self.template_db = template

    def prepare(self, run_dir: Path) -> None:
        database(run_dir).parent.mkdir(parents=True)
        shutil.copyfile(self.template_db, database(run_dir))

    def read_back(self, run_dir, options):
        """Every value of every metric of the run, from ``MlflowClient``: ``eval/<family>/name`` or ``axis/name``."""
        client = client_of(run_dir)
        (run,) = runs_tagged(client, self.run(run_dir).run_id)
        rows = []
        for key in run.data.metrics:
            parts = key.split("/")
            axis, name = ("/".join(parts[:2]), "/".join(parts[2:])) if parts[0] == "eval" else (
                parts[0], "/".join(parts[1:]))
            rows += [(axis, name, m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        return rows
