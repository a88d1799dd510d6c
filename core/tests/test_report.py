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
