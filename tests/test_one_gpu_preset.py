"""The one-gpu preset's CPU form at a tiny size, end to end through `aitrainsai run`: the local trainer really trains
SmolLM2-135M (one step, one prompt, two rollouts), the untrained policy and the final one play held-out triage on the
same eval seeds, and the report shows job quality per step apart from validation and the initial-vs-final table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aitrainsai.ledger import Ledger

pytest.importorskip("aitrainsai_trainer_local")
pytest.importorskip("aitrainsai_outer_recipe")

TINY = ["loop.steps=1", "loop.eval_episodes=1", "gpu_backend.local.workers=2", "families.train=['calc_chain']",
        "inner_trainer.local.eval_size=2", "inner_trainer.local.eval_max_new_tokens=4",
        "outer_trainer.recipe.choices={steps=[1], prompts_per_step=[1], group_size=[2], max_new_tokens=[4], "
        "max_turns=[1], dataset_size=[32], rubric=['shaped', 'exact+format'], level_mix=['task']}"]


def test_the_one_gpu_preset_runs_at_a_tiny_size_and_reports_the_comparison(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITRAINSAI_")}
    sets = [arg for setting in TINY for arg in ("-s", setting)]
    done = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "run", "--runs-dir", str(tmp_path),
                           "--preset", "one-gpu-cpu", *sets], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (name,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    run = Ledger(tmp_path).run(name)
    assert run.info()["status"] == "finished"
    assert run.info()["config"]["loop"]["eval_initial"] is True
    evals = [e["data"] for e in run.events("eval")]
    assert [(e["step"], e["family"]) for e in evals] == [(0, "triage"), (1, "triage")]
    trained = [e for e in run.episodes() if not e["group_id"].startswith("eval")]
    assert len(trained) == 2 and all(e["status"] in ("done", "dead", "invalid") for e in trained)
    assert any((e["data"] or {}).get("train") for e in run.episodes()), "no job trained"
    report = (run.dir / "report" / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| step | mean reward |"))
    assert "job_quality" in header and "validation" in header and "mean uplift" in header
    assert "## Held-out families: initial vs final policy" in report
    assert any(line.startswith("| triage | 1 | 0 → 1 |") for line in report.splitlines())
