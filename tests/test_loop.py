"""The nested loop with the recipe policy: its evaluation episodes draw from the eval seeds, so the initial and
the final policy are compared on the same draws. (The loop's own tests, on the fakes: core/tests/run/test_loop.py.)"""

import re

import pytest

from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from aitrainsai.cli.report import write_report
from episode_helpers import plugins_with_given_numbers, resolved_config, session_of


@pytest.mark.slow  # a whole run, its payloads in processes
def test_the_initial_and_final_policy_are_compared_on_the_held_out_family(tmp_path):
    """eval_initial evaluates the untrained policy at step 0; eval_families=held_out plays only triage; the final
    evaluation draws its jobs from the same eval seeds, and the report compares the two episode by episode."""
    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=1", "loop.group_size=2", "loop.eval_episodes=3",
                               "loop.eval_initial=true", "loop.eval_families=held_out",
                               "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    run_loop(session_of(run, plugins))
    evals = [e.data for e in run.events("eval")]
    assert [(e["step"], e["family"]) for e in evals] == [(0, "triage"), (1, "triage")]
    episodes = {e.id: e for e in run.episodes()}
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
