"""The compact task view (``loop.task_view = "compact"``): what a small agent opens with instead of the whole spec,
template and schema, rendered from the same spec and template; and the run setting that selects it."""

import asyncio
import tomllib

import pytest

from aitrainsai.config import ConfigError, load_config, resolve, resume_overrides
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.session import Session
from episode_helpers import ROOT, ScriptedPolicy, given_plugins, resolved_config, session_of

COMPACT_CHARS = 4_000  # the compact opening (system and user messages) of every installed family is shorter


def episode_in(plugins, tmp_path, family, view):
    """An episode of ``family`` in a run of the default inner trainer (the local one, with its real trainer.toml)."""
    config = load_config(None, ["families.train=[]", "families.held_out=[]", f"loop.task_view={view}",
                                f"reward_spec={ROOT / 'reward_specs' / 'default.toml'}"], presets=plugins.presets)
    resolved = resolve(config, plugins, outer=False)
    run = Ledger(tmp_path / view / family).create_run(resolved.snapshot(), [], name="view")
    return Session(resolved, plugins, run).episode(family, None, "ep-1", step=0, group_id="g0")


def test_the_compact_view_of_every_family_holds_the_task_and_the_decisions_but_not_the_files(plugins, tmp_path):
    families = plugins.task_families.names()
    assert len(families) >= 2
    for family in families:
        episode = episode_in(plugins, tmp_path, family, "compact")
        system, user = (m["content"] for m in episode.opening_messages())
        text = f"{system}\n{user}"
        spec, template = episode.spec, episode.template()
        assert spec.goal in user and spec.eval_interface.answer_format in user
        c = spec.constraints
        for number in (c.max_train_steps, c.max_dataset_size, c.max_wall_seconds):
            assert f"at most {number} " in user, (family, number)
        assert all(base in user for base in c.allowed_bases) and c.allowed_bases
        assert f"Turn limit {spec.eval_interface.turn_limit}." in user
        assert all(schema["function"]["name"] in user for schema in spec.eval_interface.tools)
        assert spec.public_modules[0] in user
        assert spec.dev_examples[0].item.question in user
        for name in template:
            assert f"- {name}: " in user, (family, name)
        lines = user.splitlines()
        for key, value in tomllib.loads(template["trainer.toml"]).items():
            assert any(line.startswith(f"{key} = ") and str(value).lower() in line.lower() for line in lines), key
        assert "learning_rate = 0.0002 (float >0 <=0.01)" in lines  # the local trainer's schema, in one line
        assert episode.context.reward_spec.formula() in system and "edit_file" in user and "submit_job" in user
        for name, body in template.items():
            assert body not in text, (family, name)
        assert spec.eval_interface.system_prompt not in text  # environment.py holds it; read_file shows it
        assert "tool_calls" not in text and '"parameters"' not in text  # no transcript, no tool schema
        full = sum(len(m["content"]) for m in episode_in(plugins, tmp_path, family, "full").opening_messages())
        assert len(text) < COMPACT_CHARS and 4 * len(text) < full, (family, len(text), full)


def test_a_run_with_the_compact_view_opens_every_episode_with_it_and_keeps_it_on_resume(tmp_path):
    plugins = given_plugins()
    resolved = resolved_config(plugins, "loop.task_view=compact")
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [])
    episode = Session(resolved, plugins, run).episode("ledger", None, "e0")
    asyncio.run(episode.play(ScriptedPolicy([])))  # the agent replies without a tool call: the episode ends
    transcript = run.transcript("e0")
    assert [m["role"] for m in transcript] == ["system", "user", "assistant"] and transcript[2]["content"] == "done"
    opening = transcript[:2]
    assert opening == episode.compact_opening() and opening != _full_opening(episode)
    assert "trainer.toml now" in opening[1]["content"] and "## Job template" not in opening[1]["content"]
    resumed = session_of(run, plugins)  # aitrainsai run --resume: the recorded config, the same view
    assert resumed.context.task_view == "compact"
    with pytest.raises(ConfigError, match="loop.task_view: cannot change when a run resumes"):
        resume_overrides(run.info().config, ["loop.task_view=full"], plugins)


def test_the_view_defaults_to_full_and_a_bad_one_is_one_config_error(tmp_path):
    plugins = given_plugins()
    assert resolved_config(plugins).loop.task_view == "full"
    record = resolved_config(plugins).snapshot()
    del record["loop"]["task_view"]  # a run recorded before the setting existed resumes with the full view
    run = Ledger(tmp_path / "runs").create_run(record, [])
    assert session_of(run, plugins).context.task_view == "full"
    with pytest.raises(ConfigError) as raised:
        resolved_config(plugins, "loop.task_view=tiny")
    assert str(raised.value) == ("config (with --set): loop.task_view: Input should be 'full' or 'compact' "
                                 "(got 'tiny')")


def _full_opening(episode):
    view, episode.context.task_view = episode.context.task_view, "full"
    try:
        return episode.opening_messages()
    finally:
        episode.context.task_view = view
