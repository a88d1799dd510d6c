import warnings

import pytest

from aitrainsai.run.ledger import Ledger
from aitrainsai.run.record import EpisodeData, OuterStep
from aitrainsai.cli.report import write_report
from aitrainsai.trainers import AgentTurn


@pytest.mark.parametrize("with_steps", [True, False])
def test_a_run_without_an_evaluation_step_reports_without_a_warning(tmp_path, with_steps):
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="no-eval")
    if with_steps:
        run.record(OuterStep(step=0, mean_reward=0.5, components={"validation": 0.5}, base_choices=[]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" included
        path = write_report(run)
    text = path.read_text()
    assert "No evaluation step in this run: the held-out plot below is empty." in text
    assert "| step | family | held out |" not in text
    assert (path.parent / "heldout.png").stat().st_size > 0


def test_the_progress_line_shows_compute_cost_only_where_there_is_one():
    from io import StringIO

    from rich.console import Console

    from aitrainsai.cli.progress import LoopProgress
    from aitrainsai.run.loop import Counters, LastStep, LoopStatus

    def status(compute_usd: dict[str, float]) -> LoopStatus:
        last = LastStep(reward=0.5, components={}, cost_usd=None, compute_usd=compute_usd)
        return LoopStatus(trained_steps=1, policy_version=1, counters=Counters(), buffered=0, last_step=last)

    out = StringIO()
    progress = LoopProgress(Console(file=out, width=300), steps=2)
    assert "compute cost" not in progress._fields(None)
    free = status({"jobs_usd": 0.0})
    progress.update(free)
    assert "compute cost" not in progress._fields(free)
    paid = status({"jobs_usd": 1.2, "pool_usd": 1.9, "idle_usd": 0.7})
    progress.update(paid)
    assert progress._fields(paid)["compute cost"] == "$1.20 in jobs (pool $1.90, idle $0.70)"
    assert "compute cost: $1.20 in jobs (pool $1.90, idle $0.70)" in out.getvalue()


def test_the_report_says_how_often_the_agent_picked_the_better_base(tmp_path):
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="bases")
    choice = {"family": "calc_chain", "best_untrained": "Qwen/Qwen3-1.7B", "bases": 2}
    run.record(OuterStep(step=0, mean_reward=0.5, components={}, base_choices=[
        {**choice, "base": "Qwen/Qwen3-1.7B", "picked_best": True},
        {**choice, "base": "Qwen/Qwen3-0.6B", "picked_best": False},
        {**choice, "base": None, "picked_best": False},  # no job: no choice
        {**choice, "base": "SmolLM2-135M-Instruct", "bases": 1, "picked_best": True}]))  # one base: no choice
    text = write_report(run).read_text()
    assert ("The agent picked the base with the better untrained score in 1 of 2 jobs (50%); jobs per base: "
            "Qwen/Qwen3-0.6B 1, Qwen/Qwen3-1.7B 1.") in text
    one = Ledger(tmp_path / "one").create_run({}, [], name="one-base")
    one.record(OuterStep(step=0, mean_reward=0.5, components={}, base_choices=[
        {**choice, "base": "SmolLM2-135M-Instruct", "bases": 1, "picked_best": True}]))
    assert "## Base choice" not in write_report(one).read_text()


def _chose(chosen: dict) -> list[AgentTurn]:
    """A policy's turns that recorded its choices (as the recipe policy does)."""
    return [AgentTurn(message={"role": "assistant"}, meta={"chosen": chosen})]


def test_the_report_lists_jobs_and_what_separated_them(tmp_path):
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="jobs")

    def episode(name, step, reward, chosen, uplift=None, low=0.0):
        train = None if uplift is None else {"base_model": "b", "pre": 0.0, "post": uplift, "uplift": uplift,
                                             "uplift_ci": [low, uplift + 0.1], "eval_size": 16, "train_seconds": 1.0}
        run.upsert_episode(name, status="done" if train else "invalid", step=step, family="multi_hop",
                           group_id=f"s{step}", reward=reward,
                           data=EpisodeData.model_validate({"turns": _chose(chosen), "train": train}))

    episode("a", 1, 0.40, {"steps": 2, "rubric": "shaped", "lr": 1e-3}, uplift=0.0)
    episode("b", 1, 0.80, {"steps": 8, "rubric": "shaped", "lr": 1e-3}, uplift=0.25, low=0.06)
    episode("c", 2, 0.82, {"steps": 8, "rubric": "shaped", "lr": 1e-3}, uplift=0.31, low=0.12)
    episode("d", 2, -0.10, {"steps": 8, "rubric": "exact", "lr": 1e-3})  # no job: no outcome
    run.upsert_episode("e", status="done", step=1, family="multi_hop", group_id="s9", reward=0.5,
                       data=EpisodeData(turns=_chose({"steps": 2, "rubric": "shaped", "lr": 1e-3})))
    # (group s9 is in no step: listed, not counted below)
    for step in (1, 2):
        run.record(OuterStep(step=step, mean_reward=0.5, components={}, base_choices=[], groups=[f"s{step}"]))
    run.upsert_episode("eval2-triage-e0", status="done", step=2, family="triage", group_id="eval2-triage",
                       reward=0.5, data=EpisodeData(turns=_chose({"steps": 2})))  # an evaluation: not listed
    text = write_report(run).read_text()
    assert "| 1 | multi_hop | done | +0.800 | 0.000 → 0.250 | +0.250 (+0.060 .. +0.350) | rubric=shaped, steps=8 |" \
        in text
    assert "| 2 | multi_hop | invalid | -0.100 | - | - | rubric=exact, steps=8 |" in text
    assert "lr=" not in text and "triage" not in text.split("## What separated")[0].split("## Jobs")[1]
    assert "2 of 3 trained jobs have an uplift interval above 0." in text
    assert "| - | multi_hop | done | +0.500 | - | - | rubric=shaped, steps=2 |" in text
    separated = text.split("## What separated the jobs")[1]
    # rubric's options differ by 0.77 in mean reward, steps' by 0.11: rubric first (keys in the ledger's order)
    rubric = separated.index("| rubric | shaped | 2 → 1 | +0.673 | +0.187 |")
    assert rubric < separated.index("| steps | 8 | 1 → 2 |")
    assert "| rubric | exact | 0 → 1 | -0.100 | - |" in separated
    assert "| steps | 2 | 1 → 0 | +0.400 | +0.000 |" in separated


def test_a_job_that_chose_nothing_does_not_make_every_choice_differ(tmp_path):
    """An LLM agent's episodes: one never submitted (no design), two submitted the same design. Nothing separated
    the jobs, so no choice is listed (before, each key counted the missing design as an option of its own)."""
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="llm")
    design = {"rubric": "correct_answer", "learning_rate": 0.0005}
    train = {"base_model": "b", "pre": 0.0, "post": 0.0, "uplift": 0.0, "uplift_ci": [0.0, 0.0], "eval_size": 16,
             "train_seconds": 1.0}
    for name, step, data in (("a", 1, {}), ("b", 1, {"design": design, "train": train}),
                             ("c", 2, {"design": design, "train": train}),
                             ("d", 2, {"design": design, "train": train})):
        run.upsert_episode(name, status="done" if data else "no_submission", step=step, family="multi_hop",
                           group_id=f"s{step}", reward=0.6 if data else -0.1, data=EpisodeData.model_validate(data))
    for step in (1, 2):
        run.record(OuterStep(step=step, mean_reward=0.5, components={}, base_choices=[], groups=[f"s{step}"]))
    text = write_report(run).read_text()
    assert "| 1 | multi_hop | no_submission | -0.100 | - | - | - |" in text
    assert "| 2 | multi_hop | done | +0.600 | 0.000 → 0.000 | +0.000 (+0.000 .. +0.000) | - |" in text
    assert "## What separated the jobs" not in text


def test_the_report_gives_the_reward_of_each_policy_version_where_groups_were_skipped(tmp_path):
    """Identical jobs share one outcome, so a converged policy's groups have no reward spread and are skipped: no
    outer step holds them. The report still reads their rewards, by the policy version that wrote them."""
    pytest.importorskip("matplotlib")
    from aitrainsai.run.record import GroupSkipped, Reward

    run = Ledger(tmp_path).create_run({}, [], name="versions")
    for episode, step, group, total, quality in (("g0000-e0", 0, "g0000", 0.6, 0.4), ("g0000-e1", 0, "g0000", 0.9, 0.8),
                                                 ("g0001-e0", 1, "g0001", 0.9, 0.8), ("g0001-e1", 1, "g0001", 0.9, 0.8),
                                                 ("eval1-multi_hop-e0", 1, "eval1-multi_hop", 0.1, 0.0)):
        run.upsert_episode(episode, status="done", step=step, family="multi_hop", group_id=group, reward=total)
        run.record(Reward(episode=episode, total=total, step=step, family="multi_hop",
                          components={"job_quality": quality, "validation": 1.0}))
    run.record(OuterStep(step=1, mean_reward=0.75, components={"job_quality": 0.6}, base_choices=[], groups=["g0000"]))
    run.record(GroupSkipped(group="g0001", reward=0.9))
    text = write_report(run).read_text()
    section = text.split("## Reward by the policy that wrote the episodes")[1].split("##")[0]
    assert "| v0 | 2 | +0.750 | 0.600 | 1.000 |" in section
    assert "| v1 | 2 | +0.900 | 0.800 | 1.000 |" in section  # the evaluation episode is not counted
    assert "Mean reward, policy v0 → v1: +0.150; its components moved job_quality +0.200, validation +0.000" in section
