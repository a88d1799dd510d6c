"""The nested loop end to end on real probes and real subprocess jobs, on the fakes (the tally families, an inner
trainer that reports given numbers, the scripted policy); and resume after SIGKILL."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from aitrainsai.cli.report import collect, write_report
from aitrainsai.testing.runs import fake_config, fake_plugins, needs_verifiers, session_of


@needs_verifiers
@pytest.mark.slow
def test_the_loop_trains_evaluates_and_reports(tmp_path):
    """... and feeds its trackers: the JSON-lines one holds what the ledger and the report hold; one that fails is
    named once and the run goes on."""
    pytest.importorskip("matplotlib")
    from rich.console import Console

    from aitrainsai.cli.progress import LoopProgress

    plugins = fake_plugins()
    resolved = fake_config(plugins, "loop.steps=2", "loop.group_size=2", "loop.groups_per_step=2",
                           "inner_trainer.given-numbers.spread=0.3",  # every group has signal: none is skipped
                           "trackers=['failing', 'jsonl']")
    ledger = Ledger(tmp_path)
    run = ledger.create_run(resolved.snapshot(), [])
    console = Console(file=io.StringIO(), width=200)
    summary = run_loop(session_of(run, plugins), display=LoopProgress(console, resolved.loop.steps))
    assert summary.steps == 2
    steps = [e.data for e in run.events("outer_step")]
    assert [s["policy_version"] for s in steps] == [1, 2]
    assert all(len(s["groups"]) == 2 for s in steps)
    evals = [e.data for e in run.events("eval")]
    assert {e["family"] for e in evals} == {"tally_held_out", "tally"}
    assert any(e["held_out"] for e in evals)
    trained_families = {e.family for e in run.episodes() if not (e.group_id or "").startswith("eval")}
    assert "tally_held_out" not in trained_families, "the held-out family was trained on"
    assert run.info().status == "finished"
    report = write_report(run)
    text = report.read_text()
    assert "## Outer steps" in text and "| 2 |" in text
    for name in ("reward.png", "uplift.png", "heldout.png", "rates.png"):
        assert (report.parent / name).stat().st_size > 1000
    failed = [line for line in console.file.getvalue().splitlines() if "tracker failing failed" in line]
    assert len(failed) == 1 and "this tracker always fails" in failed[0]
    assert (run.dir / "failing-tracker.started").read_text() == run.id
    lines = [json.loads(line) for line in (run.dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines()]
    assert [p["mean_reward"] for p in lines if p["kind"] == "step"] == [s["mean_reward"] for s in steps]
    data = collect(run)
    jobs = {p["episode"]: p for p in lines if p["kind"] == "job"}
    assert sorted(j["uplift"] for j in jobs.values() if j["episode"].startswith("g")) == sorted(
        u for family in data.uplift.values() for u in family)
    assert [(p["axis"], p["x"], p["mean_reward"]) for p in lines if p["kind"] == "eval"] == [
        (f"eval/{e['family']}", e["step"], e["mean_reward"]) for e in evals]
    assert [p["status"] for p in lines if p["kind"] == "end"] == ["finished"]


@needs_verifiers
@pytest.mark.slow  # a whole run, its payloads in processes
@pytest.mark.parametrize("lag", [0, 2])
def test_an_on_policy_loop_samples_each_step_from_the_last_update(tmp_path, lag):
    """max_steps_off_policy = 0: a step's group starts only after the previous update, so the second group is
    sampled by policy version 1. With lag allowed, both groups start at once (version 0), as the pool prefers."""
    plugins = fake_plugins()
    resolved = fake_config(plugins, "loop.steps=2", "loop.group_size=2", f"loop.max_steps_off_policy={lag}",
                           "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    run_loop(session_of(run, plugins))
    sampled = {e.group_id: {t.policy_version for t in e.data.turns} for e in run.episodes()}
    assert sampled == ({"g0000": {0}, "g0001": {1}} if lag == 0 else {"g0000": {0}, "g0001": {0}})


@needs_verifiers
@pytest.mark.slow  # a whole run, its payloads in processes
def test_an_episode_the_infrastructure_failed_is_left_out_of_its_groups_signal(tmp_path):
    """Groups of three whose third job dies of the infrastructure (a machine too slow for the budget): each group
    trains on its other two (their spread), never on the third's reward; the run says which it left out."""
    plugins = fake_plugins()
    resolved = fake_config(plugins, "loop.steps=1", "loop.group_size=3", "loop.groups_per_step=1",
                           "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3",
                           "inner_trainer.given-numbers.infra=[2]")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    run_loop(session_of(run, plugins))
    (step,) = [e.data for e in run.events("outer_step")]
    (group,) = step["groups"]
    statuses = {e.id: e.status for e in run.episodes(group)}
    assert statuses == {f"{group}-e0": "done", f"{group}-e1": "done", f"{group}-e2": "infra"}
    (left,) = [e.data for e in run.events("left_out")]
    assert left == {"group": group, "episodes": [f"{group}-e2"]}
    rewards = {e.id: e.reward for e in run.episodes(group)}
    assert step["mean_reward"] == pytest.approx((rewards[f"{group}-e0"] + rewards[f"{group}-e1"]) / 2)


def test_the_loop_refuses_a_held_out_family_in_training(tmp_path):
    from aitrainsai.config import ConfigError

    plugins = fake_plugins()
    with pytest.raises(ConfigError, match="held-out family"):
        fake_config(plugins, "families.train=['tally','tally_held_out']", "families.held_out=[]")


KILLER = textwrap.dedent("""
    import os, threading, time
    from aitrainsai.testing.runs import fake_config, fake_plugins, session_of
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.run.loop import run_loop

    plugins = fake_plugins()
    resolved = fake_config(plugins, "loop.steps=3", "loop.group_size=2", "loop.groups_per_step=2",
                           "loop.final_eval=false", "inner_trainer.given-numbers.post=0.5",
                           "inner_trainer.given-numbers.spread=0.3",
                           "inner_trainer.given-numbers.job_seconds=1.5", "trackers=['jsonl']")
    ledger = Ledger({runs!r})
    run = ledger.create_run(resolved.snapshot(), [], name="killed")

    def kill_mid_step():
        while True:
            time.sleep(0.2)
            steps = list(Ledger({runs!r}).run("killed").events("outer_step"))
            jobs = Ledger({runs!r}).run("killed").jobs()
            if steps and any(j.state == "running" for j in jobs):
                os.kill(os.getpid(), 9)

    threading.Thread(target=kill_mid_step, daemon=True).start()
    run_loop(session_of(run, plugins))
""")

RESUMER = textwrap.dedent("""
    from aitrainsai.testing.runs import fake_plugins, session_of
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.run.loop import run_loop

    run = Ledger({runs!r}).run("killed")
    print(run_loop(session_of(run, fake_plugins()), resume=True))
""")


@needs_verifiers
@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_without_running_a_job_twice(tmp_path):
    runs = tmp_path / "runs"
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log")}
    killed = subprocess.run([sys.executable, "-c", KILLER.format(runs=str(runs))],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = Ledger(runs).run("killed")
    steps_before = len(list(run.events("outer_step")))
    assert 1 <= steps_before < 3
    resumed = subprocess.run([sys.executable, "-c", RESUMER.format(runs=str(runs))],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = Ledger(runs).run("killed")
    assert len(list(run.events("outer_step"))) == 3
    assert run.info().status == "finished"
    executions = (tmp_path / "executions.log").read_text().split()
    assert len(executions) == len(set(executions)), f"jobs run twice: {sorted(executions)}"
    jobs = {j.id: j.state for j in run.jobs()}
    finished = [i for i, status in jobs.items() if status in ("done", "dead")]
    missing = {*finished, *(f"{i}-eval" for i in finished)} - set(executions)
    assert not missing, f"finished jobs that never ran: {sorted(missing)}"
    # A group still in flight when the last step trained is cancelled: its jobs may have run without finishing.
    extra = {e.removesuffix("-eval") for e in executions} - set(finished)
    trained_on = {g for e in run.events("outer_step") for g in e.data["groups"]}
    assert not [i for i in extra if i.split("-")[0] in trained_on], \
        f"jobs of trained groups that ran but are not finished in the ledger: { {i: jobs.get(i) for i in extra} }"
    # the tracker resumed where it was: every point once, the steps 1..3, each finished episode, one end
    lines = [json.loads(line) for line in (run.dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines()]
    points = [(p["axis"], p["x"]) for p in lines if p["kind"] not in ("start", "end")]
    assert len(points) == len(set(points))
    assert [p["x"] for p in lines if p["kind"] == "step"] == [1, 2, 3]
    assert sorted(p["episode"] for p in lines if p["kind"] == "episode") == sorted(
        e.data["episode"] for e in run.events("reward"))
    assert [p["resumed"] for p in lines if p["kind"] == "start"] == [False, True]
    assert [p["status"] for p in lines if p["kind"] == "end"] == ["finished"]
