"""The presets of issue 16. The one-gpu preset's CPU form at a tiny size, end to end through `aitrainsai run`: the
local trainer really trains its tiny base (SmolLM2-135M's tokenizer and architecture, two narrow layers; one step, one
prompt, two rollouts), the untrained policy and the final one play held-out triage on the same eval seeds, and the
report shows job quality per step apart from validation and the initial-vs-final table. The quickstart preset
(`make run`): its recipe decision space."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pathlib import Path

from aitrainsai.run.ledger import Ledger

pytest.importorskip("aitrainsai_trainer_local")
pytest.importorskip("aitrainsai_outer_recipe")

TINY = ["loop.steps=1", "loop.eval_episodes=1", "gpu_backend.local.workers=2", "families.train=['calc_chain']",
        "inner_trainer.local.eval_size=2", "inner_trainer.local.eval_max_new_tokens=4",
        # the two sizes do different work (train speed): a group has a signal where the tiny base learns nothing
        "outer_trainer.recipe.choices={steps=[1], prompts_per_step=[1], group_size=[2, 3], max_new_tokens=[4, 6], "
        "max_turns=[1], dataset_size=[32], rubric=['shaped', 'exact+format'], level_mix=['task']}"]


@pytest.mark.slow  # a whole run through worker processes: over a minute on 2 CPUs
def test_the_one_gpu_preset_runs_at_a_tiny_size_and_reports_the_comparison(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITRAINSAI_")}
    env["AITRAINSAI_LOCAL_BASE"] = "tiny-llama"  # the mechanics of the preset, not learning
    sets = [arg for setting in TINY for arg in ("-s", setting)]
    done = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "run", "--runs-dir", str(tmp_path),
                           "--preset", "one-gpu-cpu", *sets], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (name,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    run = Ledger(tmp_path).run(name)
    assert run.info().status == "finished"
    assert run.info().config["loop"]["eval_initial"] is True
    evals = [e.data for e in run.events("eval")]
    assert [(e["step"], e["family"]) for e in evals] == [(0, "triage"), (1, "triage")]
    trained = [e for e in run.episodes() if not (e.group_id or "").startswith("eval")]
    assert len(trained) == 2 and all(e.status in ("done", "dead", "invalid") for e in trained)
    trains = [e.data.train for e in run.episodes()]
    assert any(trains), "no job trained"
    assert {t.base_model for t in trains if t} == {"tiny-llama"}
    report = (run.dir / "report" / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| step | mean reward |"))
    assert "job_quality" in header and "validation" in header and "mean uplift" in header
    assert "## Held-out families: initial vs final policy" in report
    assert any(line.startswith("| triage | 1 | 0 → 1 |") for line in report.splitlines())


def test_the_quickstart_preset_leaves_the_recipe_one_decision_on_policy():
    """make run's preset: multi_hop only, on-policy steps, and a recipe space whose one open decision is the
    rubric (exact or shaped), every job on the same rows; the fixed values fit the run's step budget."""
    from aitrainsai.config import load_config, resolve
    from aitrainsai.families import Constraints, EvalInterface, TaskSpec
    from aitrainsai.plugins import Plugins
    from aitrainsai.trainers import AgentTask
    from aitrainsai_outer_recipe.policy import RecipePolicy
    from aitrainsai_trainer_local.inner import LocalTrainer

    plugins = Plugins.load()
    resolved = resolve(load_config(preset="quickstart", presets=plugins.presets), plugins)
    assert resolved.families.train == ["multi_hop"] and resolved.loop.max_steps_off_policy == 0
    assert resolved.gpu_backend.config.workers == 2
    assert resolved.outer_trainer.config.dataset_seed is not None
    budget = resolved.inner_trainer.config.max_train_steps
    policy = RecipePolicy(resolved.outer_trainer.config, state_dir=Path("unused"))
    trainer = LocalTrainer(LocalTrainer.Config(max_train_steps=budget))
    spec = TaskSpec(family="multi_hop", level=1, held_out=False, goal="g",
                    constraints=trainer.constraints(Constraints()),
                    eval_interface=EvalInterface(system_prompt="s", tools=[], answer_format="a", turn_limit=2),
                    public_modules=["aitrainsai_family_multi_hop"], dev_examples=[])
    template = {"trainer.toml": trainer.config_template(spec)}
    task = AgentTask(family="multi_hop", level=1, levels=[1, 2, 3, 4], held_out=False, template=template,
                     family_module="aitrainsai_family_multi_hop", allowed_bases=["SmolLM2-135M-Instruct"],
                     max_train_steps=budget, max_dataset_size=2000)
    space = policy.decisions(task)
    assert {k: v for k, v in space.items() if len(v) > 1} == {"rubric": ["exact", "shaped"]}
    assert space["steps"] == [budget]
