"""A run with every tracker this repository ships, each read back with its library's own reader: the values are the
report's (a run of the given-numbers trainer: real payloads, no model)."""

import os

import pytest

from aitrainsai.cli.report import collect
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from episode_helpers import plugins_with_given_numbers, resolved_config, session_of

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # nothing leaves the machine


@pytest.mark.slow  # a whole run, its payloads in processes
def test_a_run_tracked_by_tensorboard_mlflow_and_wandb_reads_back_as_its_report(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from aitrainsai_tracker_wandb.tracker import read_records

    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=2", "loop.group_size=2", "loop.groups_per_step=1",
                               "inner_trainer.given-numbers.spread=0.3", "families.train=['calc_chain']",
                               "loop.eval_families=held_out", "trackers=['tensorboard', 'mlflow', 'wandb']")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    run_loop(session_of(run, plugins))
    steps = {e.data["step"]: e.data["mean_reward"] for e in run.events("outer_step")}
    report = collect(run)
    uplifts = sorted(u for family in report.uplift.values() for u in family)
    assert list(steps) == [1, 2] and len(uplifts) == 4
    trackers = run.dir / "trackers"

    board = EventAccumulator(str(trackers / "tensorboard" / "step"), size_guidance={SCALARS: 0})
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("reward")} == pytest.approx(steps)
    jobs = EventAccumulator(str(trackers / "tensorboard" / "job"), size_guidance={SCALARS: 0})
    jobs.Reload()
    every_job = sorted(j.progress.uplift for j in run.jobs() if j.progress.uplift is not None)
    assert sorted(e.value for e in jobs.Scalars("uplift")) == pytest.approx(every_job)  # the report's and the evals'
    assert all(any(u == pytest.approx(v) for v in every_job) for u in uplifts)

    client = MlflowClient(tracking_uri=f"sqlite:///{trackers / 'mlflow' / 'mlflow.db'}")
    (tracked,) = client.search_runs([client.get_experiment_by_name("aitrainsai").experiment_id],
                                    f"tags.`aitrainsai.run_id` = '{run.id}'")
    assert tracked.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, "step/reward")} == \
        pytest.approx(steps)

    (offline,) = (trackers / "wandb").rglob("*.wandb")
    rows = [r["history"]["item"] for r in read_records(offline) if r["type"] == "history"]
    assert {row["step/x"]: row["step/reward"] for row in rows if "step/x" in row} == pytest.approx(steps)
    assert len([row for row in rows if "job/uplift" in row]) == len(jobs.Scalars("uplift"))
