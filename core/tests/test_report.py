import warnings

import pytest

from aitrainsai.ledger import Ledger
from aitrainsai.report import write_report


@pytest.mark.parametrize("with_steps", [True, False])
def test_a_run_without_an_evaluation_step_reports_without_a_warning(tmp_path, with_steps):
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="no-eval")
    if with_steps:
        run.event("outer_step", step=0, mean_reward=0.5, components={"validation": 0.5}, base_choices=[])
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

    from aitrainsai.progress import LoopProgress

    out = StringIO()
    progress = LoopProgress(Console(file=out, width=300), steps=2)
    assert "compute cost" not in progress._fields(None)
    progress.update(None, compute_usd={"jobs_usd": 0.0})
    assert "compute cost" not in progress._fields(None)
    progress.update(None, compute_usd={"jobs_usd": 1.2, "pool_usd": 1.9, "idle_usd": 0.7})
    assert progress._fields(None)["compute cost"] == "$1.20 in jobs (pool $1.90, idle $0.70)"
    assert "compute cost: $1.20 in jobs (pool $1.90, idle $0.70)" in out.getvalue()


def test_the_report_says_how_often_the_agent_picked_the_better_base(tmp_path):
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path).create_run({}, [], name="bases")
    choice = {"family": "calc_chain", "best_untrained": "Qwen/Qwen3-1.7B", "bases": 2}
    run.event("outer_step", step=0, mean_reward=0.5, components={}, base_choices=[
        {**choice, "base": "Qwen/Qwen3-1.7B", "picked_best": True},
        {**choice, "base": "Qwen/Qwen3-0.6B", "picked_best": False},
        {**choice, "base": None, "picked_best": False},  # no job: no choice
        {**choice, "base": "SmolLM2-135M-Instruct", "bases": 1, "picked_best": True}])  # one base: no choice
    text = write_report(run).read_text()
    assert ("The agent picked the base with the better untrained score in 1 of 2 jobs (50%); jobs per base: "
            "Qwen/Qwen3-0.6B 1, Qwen/Qwen3-1.7B 1.") in text
    one = Ledger(tmp_path / "one").create_run({}, [], name="one-base")
    one.event("outer_step", step=0, mean_reward=0.5, components={}, base_choices=[
        {**choice, "base": "SmolLM2-135M-Instruct", "bases": 1, "picked_best": True}])
    assert "## Base choice" not in write_report(one).read_text()
