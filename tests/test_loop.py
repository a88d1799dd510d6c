"""The nested loop end to end on real probes and real subprocess jobs (an inner trainer that reports given
numbers), with the recipe policy; and resume after SIGKILL."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from aitrainsai.cli.report import collect, write_report
from episode_helpers import plugins_with_given_numbers, resolved_config, session_of  # noqa: F401 (scripts use them)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_loop_trains_evaluates_and_reports(tmp_path):
    """... and feeds its trackers: the JSON-lines one holds what the ledger and the report hold; one that fails is
    named once and the run goes on."""
    from rich.console import Console

    from aitrainsai.cli.progress import LoopProgress

    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=2", "loop.group_size=2", "loop.groups_per_step=2",
                               "inner_trainer.given-numbers.spread=0.3",  # every group has signal: none is skipped
                               "trackers=['failing', 'jsonl']")
    ledger = Ledger(tmp_path)
    run = ledger.create_run(resolved.record(), [])
    console = Console(file=io.StringIO(), width=200)
    summary = run_loop(session_of(run, plugins), display=LoopProgress(console, resolved.loop.steps))
    assert summary["steps"] == 2
    steps = [e["data"] for e in run.events("outer_step")]
    assert [s["policy_version"] for s in steps] == [1, 2]
    assert all(len(s["groups"]) == 2 for s in steps)
    evals = [e["data"] for e in run.events("eval")]
    assert {e["family"] for e in evals} == {"triage", "calc_chain", "ledger"}
    assert any(e["held_out"] for e in evals)
    trained_families = {e["family"] for e in run.episodes() if not e["group_id"].startswith("eval")}
    assert "triage" not in trained_families, "the held-out family was trained on"
    assert run.info()["status"] == "finished"
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
        u for family in data["uplift"].values() for u in family)
    assert [(p["axis"], p["x"], p["mean_reward"]) for p in lines if p["kind"] == "eval"] == [
        (f"eval/{e['family']}", e["step"], e["mean_reward"]) for e in evals]
    assert [p["status"] for p in lines if p["kind"] == "end"] == ["finished"]


@pytest.mark.slow  # a whole run, its payloads in processes
def test_the_initial_and_final_policy_are_compared_on_the_held_out_family(tmp_path):
    """eval_initial evaluates the untrained policy at step 0; eval_families=held_out plays only triage; the final
    evaluation draws its jobs from the same eval seeds, and the report compares the two episode by episode."""
    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=1", "loop.group_size=2", "loop.eval_episodes=3",
                               "loop.eval_initial=true", "loop.eval_families=held_out",
                               "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.record(), [])
    run_loop(session_of(run, plugins))
    evals = [e["data"] for e in run.events("eval")]
    assert [(e["step"], e["family"]) for e in evals] == [(0, "triage"), (1, "triage")]
    episodes = {e["id"]: e for e in run.episodes()}
    assert {f"eval{s}-triage-e{i}" for s in (0, 1) for i in range(3)} <= set(episodes)

    def dataset_seed(episode_id):  # the recipe draws it after its decisions: the same eval seed, the same value
        source = (run.dir / "episodes" / episode_id / "workspace" / "dataset.py").read_text()
        return re.search(r"SEED = (\d+)", source).group(1)

    assert [dataset_seed(f"eval0-triage-e{i}") for i in range(3)] == [dataset_seed(f"eval1-triage-e{i}")
                                                                       for i in range(3)]
    assert len({dataset_seed(f"eval0-triage-e{i}") for i in range(3)}) == 3
    text = write_report(run).read_text()
    section = text.split("## Held-out families: initial vs final policy")[1]
    row = next(line for line in section.splitlines() if line.startswith("| triage |"))
    assert row.startswith("| triage | 3 | 0 → 1 |") and row.count("..") == 2
    assert "| jobs trained | mean uplift |" in text and "its components moved" not in text  # one step: no change


@pytest.mark.slow  # a whole run, its payloads in processes
@pytest.mark.parametrize("lag", [0, 2])
def test_an_on_policy_loop_samples_each_step_from_the_last_update(tmp_path, lag):
    """max_steps_off_policy = 0: a step's group starts only after the previous update, so the second group is
    sampled by policy version 1. With lag allowed, both groups start at once (version 0), as the pool prefers."""
    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=2", "loop.group_size=2", f"loop.max_steps_off_policy={lag}",
                               "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.record(), [])
    run_loop(session_of(run, plugins))
    sampled = {e["group_id"]: {t["policy_version"] for t in e["data"]["turns"]} for e in run.episodes()}
    assert sampled == ({"g0000": {0}, "g0001": {1}} if lag == 0 else {"g0000": {0}, "g0001": {0}})


@pytest.mark.slow  # a whole run, its payloads in processes
def test_an_episode_the_infrastructure_failed_is_left_out_of_its_groups_signal(tmp_path):
    """Groups of three whose third job dies of the infrastructure (a machine too slow for the budget): each group
    trains on its other two (their spread), never on the third's reward; the run says which it left out."""
    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=1", "loop.group_size=3", "loop.groups_per_step=1",
                               "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3",
                               "inner_trainer.given-numbers.infra=[2]")
    run = Ledger(tmp_path).create_run(resolved.record(), [])
    run_loop(session_of(run, plugins))
    (step,) = [e["data"] for e in run.events("outer_step")]
    (group,) = step["groups"]
    statuses = {e["id"]: e["status"] for e in run.episodes(group)}
    assert statuses == {f"{group}-e0": "done", f"{group}-e1": "done", f"{group}-e2": "infra"}
    (left,) = [e["data"] for e in run.events("left_out")]
    assert left == {"group": group, "episodes": [f"{group}-e2"]}
    rewards = {e["id"]: e["reward"] for e in run.episodes(group)}
    assert step["mean_reward"] == pytest.approx((rewards[f"{group}-e0"] + rewards[f"{group}-e1"]) / 2)


def test_the_loop_refuses_a_held_out_family_in_training(tmp_path):
    from aitrainsai.config import ConfigError

    plugins = plugins_with_given_numbers()
    with pytest.raises(ConfigError, match="held-out family"):
        resolved_config(plugins, "families.train=['calc_chain','triage']", "families.held_out=[]")


KILLER = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, {tests!r})
    from episode_helpers import plugins_with_given_numbers, resolved_config, session_of
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.run.loop import run_loop

    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=3", "loop.group_size=2", "loop.groups_per_step=2",
                               "loop.final_eval=false", "inner_trainer.given-numbers.post=0.5",
                               "inner_trainer.given-numbers.spread=0.3",
                               "inner_trainer.given-numbers.job_seconds=1.5", "trackers=['jsonl']")
    ledger = Ledger({runs!r})
    run = ledger.create_run(resolved.record(), [], name="killed")

    def kill_mid_step():
        while True:
            time.sleep(0.2)
            steps = list(Ledger({runs!r}).run("killed").events("outer_step"))
            jobs = Ledger({runs!r}).run("killed").jobs()
            if steps and any(j["status"] == "running" for j in jobs):
                os.kill(os.getpid(), 9)

    threading.Thread(target=kill_mid_step, daemon=True).start()
    run_loop(session_of(run, plugins))
""")

RESUMER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from episode_helpers import plugins_with_given_numbers, session_of
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.run.loop import run_loop

    run = Ledger({runs!r}).run("killed")
    print(run_loop(session_of(run, plugins_with_given_numbers()), resume=True))
""")


@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_without_running_a_job_twice(tmp_path):
    runs = tmp_path / "runs"
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log")}
    killed = subprocess.run([sys.executable, "-c", KILLER.format(tests=str(ROOT / "tests"), runs=str(runs))],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = Ledger(runs).run("killed")
    steps_before = len(list(run.events("outer_step")))
    assert 1 <= steps_before < 3
    resumed = subprocess.run([sys.executable, "-c", RESUMER.format(tests=str(ROOT / "tests"), runs=str(runs))],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = Ledger(runs).run("killed")
    assert len(list(run.events("outer_step"))) == 3
    assert run.info()["status"] == "finished"
    executions = (tmp_path / "executions.log").read_text().split()
    assert len(executions) == len(set(executions)), f"jobs run twice: {sorted(executions)}"
    jobs = {j["id"]: j["status"] for j in run.jobs()}
    finished = [i for i, status in jobs.items() if status in ("done", "dead")]
    missing = {*finished, *(f"{i}-eval" for i in finished)} - set(executions)
    assert not missing, f"finished jobs that never ran: {sorted(missing)}"
    # A group still in flight when the last step trained is cancelled: its jobs may have run without finishing.
    extra = {e.removesuffix("-eval") for e in executions} - set(finished)
    trained_on = {g for e in run.events("outer_step") for g in e["data"]["groups"]}
    assert not [i for i in extra if i.split("-")[0] in trained_on], \
        f"jobs of trained groups that ran but are not finished in the ledger: { {i: jobs.get(i) for i in extra} }"
    # the tracker resumed where it was: every point once, the steps 1..3, each finished episode, one end
    lines = [json.loads(line) for line in (run.dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines()]
    points = [(p["axis"], p["x"]) for p in lines if p["kind"] not in ("start", "end")]
    assert len(points) == len(set(points))
    assert [p["x"] for p in lines if p["kind"] == "step"] == [1, 2, 3]
    assert sorted(p["episode"] for p in lines if p["kind"] == "episode") == sorted(
        e["data"]["episode"] for e in run.events("reward"))
    assert [p["resumed"] for p in lines if p["kind"] == "start"] == [False, True]
    assert [p["status"] for p in lines if p["kind"] == "end"] == ["finished"]
