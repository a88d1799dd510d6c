"""The composition root: one place builds the parts of a run, hides what jobs must not see, and builds only what a
command uses."""

import asyncio
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from aitrainsai.cli.command import cli
from aitrainsai.config import load_config, resolve
from aitrainsai.run.ledger import Ledger
from aitrainsai.isolation.view import hidden_paths
from aitrainsai.run.session import Session
from aitrainsai.trainers import AgentTurn
from episode_helpers import ScriptedPolicy, call, given_plugins, resolved_config


def test_a_session_builds_every_part_once_from_the_resolved_config(tmp_path):
    plugins = given_plugins()
    resolved = resolved_config(plugins, "gpu_backend.local.workers=3", "loop.max_agent_turns=5")
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [])
    session = Session(resolved, plugins, run)
    assert session.backend.capacity == 3 and session.inner_trainer.name == "given-numbers"
    assert session.outer_trainer is session.outer_trainer and session.outer_trainer.name == "recipe"
    assert [f.name for f in session.train_families] == ["calc_chain", "ledger"]
    assert [f.name for f in session.held_out_families] == ["triage"]
    assert session.family("ledger") is session.train_families[1]
    episode = session.episode("ledger", None, "e0")
    assert episode.context is session.context and session.context.max_agent_turns == 5
    assert session.context.hide == session.hidden and session.context.baselines is session.baselines


def test_a_families_job_format_reaches_its_episodes_whether_or_not_the_run_lists_it(tmp_path):
    """``families.job_format`` is the format of every family's tasks (``aitrainsai job run`` lists none);
    ``families.job_formats`` names a family's own."""
    plugins = given_plugins()
    resolved = resolved_config(plugins, "families.job_format='verifiers-v1'",
                               "families.job_formats={ledger='verifiers'}")
    session = Session(resolved, plugins, Ledger(tmp_path / "runs").create_run(resolved.snapshot(), []))
    assert session.episode("calc_chain", None, "e0").spec.job_format == "verifiers-v1"
    assert session.episode("ledger", None, "e1").spec.job_format == "verifiers"
    single = resolved_config(plugins, "families.train=[]", "families.held_out=[]", "families.job_format='verifiers-v1'")
    session = Session(single, plugins, Ledger(tmp_path / "runs2").create_run(single.snapshot(), []))
    assert session.episode("calc_chain", None, "job").spec.job_format == "verifiers-v1"


def test_a_session_without_an_outer_trainer_never_builds_one(tmp_path):
    plugins = given_plugins()
    config = load_config(None, ["inner_trainer.use=given-numbers", "outer_trainer.use=no-such-policy"],
                         presets=plugins.presets)
    resolved = resolve(config, plugins, outer=False)  # the bad outer section is not even looked at
    assert resolved.outer_trainer is None
    session = Session(resolved, plugins, Ledger(tmp_path / "runs").create_run(resolved.snapshot(), []))
    with pytest.raises(RuntimeError, match="without an outer trainer"):
        _ = session.outer_trainer


def test_hidden_paths_are_the_runs_dir_and_every_familys_private_modules(tmp_path):
    import aitrainsai_family_calc_chain as calc_chain

    hidden = hidden_paths(tmp_path / "runs")
    package = calc_chain.__file__.rsplit("/", 1)[0]
    assert (tmp_path / "runs").resolve() in hidden
    names = {str(p) for p in hidden}
    assert f"{package}/family.py" in names  # the hidden eval and the scorer
    assert f"{package}/__init__.py" not in names and f"{package}/world.py" not in names  # public modules
    assert any("aitrainsai_family_triage" in name for name in names)  # every installed family, not the run's


def test_job_run_neither_needs_nor_checks_an_outer_trainer(monkeypatch):
    import aitrainsai.cli.command as cli_module

    def stop():  # called once everything is checked, right before the run is created
        raise click.UsageError("checked; stopping before the run")

    monkeypatch.setattr(cli_module, "_require_sandbox", stop)
    result = CliRunner().invoke(cli, ["job", "run", "--family", "calc_chain", "-s", "outer_trainer.use=nope",
                                      "-s", "outer_trainer.nope.x=1"])
    assert "checked; stopping before the run" in result.output, result.output
    assert "outer_trainer" not in result.output


def test_the_workspace_starts_with_the_template_files(make_episode):
    episode = make_episode()
    script = [call("list_files"), call("read_file", path="trainer.toml")]
    asyncio.run(episode.play(ScriptedPolicy(script)))
    tool_results = [m["content"] for m in episode.messages if m.get("role") == "tool"]
    template = episode.template()
    for name in template:
        assert name in tool_results[0]
    assert tool_results[1] == template["trainer.toml"]
    assert json.dumps(sorted(p.name for p in episode.workspace.root.iterdir())) == json.dumps(sorted(template))


def test_families_left_out_by_the_plugin_selection_stay_hidden(tmp_path):
    import os
    import subprocess
    import sys

    code = ("from aitrainsai.isolation.view import family_package_views; "
            "print([v.path.rsplit('/', 1)[1] for v in family_package_views() if v.visible])")
    env = {**os.environ, "AITRAINSAI_PLUGINS": "no:aitrainsai-family-ledger"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "aitrainsai_family_ledger" in out  # not selected, but its hidden eval is hidden all the same


def test_every_payload_loads_the_plugins_this_run_loaded(make_episode, tmp_path):
    from aitrainsai.backends import JobPayload

    from episode_helpers import template_calls

    episode = make_episode()
    submitted: list[JobPayload] = []
    backend = episode.context.backend
    submit = backend.submit

    async def record(payload):
        submitted.append(payload)
        return await submit(payload)

    backend.submit = record
    asyncio.run(episode.play(ScriptedPolicy([*template_calls(episode), call("submit_job")])))
    selection = given_plugins().selection_string()
    ids = [p.job_id for p in submitted]
    assert [i.split("-")[0] for i in ids[:2]] == ["baseline"] * 2 and ids[2:] == ["ep-1-job", "ep-1-job-eval"]
    assert all(p.env["AITRAINSAI_PLUGINS"] == selection for p in submitted)
    assert "aitrainsai-family-calc-chain" in selection.split(",")
    assert all(p.env["AITRAINSAI_PLUGIN_VERSIONS"] == given_plugins().versions_string() for p in submitted)


def test_closing_a_session_closes_the_outer_trainer_and_the_backend_side_by_side(tmp_path):
    """A stop is bounded: a slow outer close must not hold up the backend's (which may be what stops the billing),
    and an error in one still lets the other finish."""
    plugins = given_plugins()
    resolved = resolved_config(plugins)
    session = Session(resolved, plugins, Ledger(tmp_path / "runs").create_run(resolved.snapshot(), []))
    events: list[str] = []

    async def slow_outer_close():
        events.append("outer started")
        await asyncio.sleep(0.3)
        events.append("outer closed")
        raise RuntimeError("the service did not answer")

    async def backend_close():
        events.append("backend started")
        await asyncio.sleep(0.1)
        events.append("backend closed")

    session.outer_trainer.close = slow_outer_close
    session.backend.close = backend_close
    with pytest.raises(RuntimeError, match="did not answer"):
        asyncio.run(session.__aexit__(None, None, None))
    assert events == ["backend started", "outer started", "backend closed", "outer closed"]


@pytest.mark.skipif(not __import__("aitrainsai.isolation").isolation.sandbox_works(),
                    reason="this machine cannot build the sandbox")
def test_the_agent_side_alone_is_measured_and_trains_nothing(tmp_path):
    """play_agent: the turns until the submission is accepted (the real probe), counted; the reward is the spec's
    with the job untrained, and no episode row or job is recorded."""
    plugins = given_plugins()
    resolved = resolved_config(plugins)
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [])
    session = Session(resolved, plugins, run)
    policy = ScriptedPolicy(["garbled", call("read_file", path="trainer.toml"), call("submit_job")])
    outcome = asyncio.run(session.episode("ledger", None, "check-ledger-0").play_agent(policy, mode="train"))
    assert (outcome.turns, outcome.parsed_turns, outcome.call_turns) == (3, 2, 2)
    assert (outcome.failed_turns, outcome.recovered) == (1, 1)  # the garbled turn, put right by the next
    assert outcome.submitted and outcome.first_accepted and outcome.accepted
    assert outcome.reward == pytest.approx(0.35)  # 0.35 x validation (first try), no job quality without a job
    assert not run.episodes() and not run.jobs()
    silent = asyncio.run(session.episode("ledger", None, "check-ledger-1").play_agent(ScriptedPolicy(["prose"]),
                                                                                       mode="train"))
    assert not silent.submitted and silent.reward == pytest.approx(-0.1) and silent.call_turns == 0
    assert (silent.failed_turns, silent.recovered) == (1, 0)  # unparsed, then a turn with no call: not put right
    slipped = ScriptedPolicy([call("red_file", path="trainer.toml"), call("read_file", path="nope.toml"),
                              call("read_file", path="trainer.toml")])
    outcome = asyncio.run(session.episode("ledger", None, "check-ledger-2").play_agent(slipped, mode="train"))
    assert (outcome.call_turns, outcome.failed_turns, outcome.recovered) == (3, 2, 1)

    class OverItsContext:  # a policy that can sample no more of this conversation: the agent phase ends there
        async def sample(self, messages, tools, task, *, mode="train"):
            return AgentTurn(message={"role": "assistant", "content": ""}, parse_error="over the limit", end=True)

    ended = asyncio.run(session.episode("ledger", None, "check-ledger-3").play_agent(OverItsContext(), mode="train"))
    assert (ended.turns, ended.failed_turns, ended.submitted) == (1, 1, False)


def test_a_validation_only_run_records_the_accepted_job_and_trains_nothing(tmp_path):
    """loop.train_jobs=false (a demonstration run): the episode ends at the accepted job, recorded as validated
    with its frozen job and conversation, its reward the validation part; no job is trained."""
    plugins = given_plugins()
    resolved = resolved_config(plugins, "loop.train_jobs=false")
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [])
    session = Session(resolved, plugins, run)
    policy = ScriptedPolicy([call("read_file", path="trainer.toml"), call("submit_job")])
    result = asyncio.run(session.episode("ledger", None, "s0-ledger-e0", step=0, group_id="s0-ledger").play(policy))
    assert result.status == "validated" and result.train is None
    assert result.reward == pytest.approx(0.35)  # validation, first try; no job quality without a trained job
    (row,) = run.episodes()
    assert row.status == "validated" and not run.jobs()
    assert Path(row.data.frozen_job or "").is_dir() and row.data.frozen_digest
    assert [m["role"] for m in run.transcript(row.id)][-2:] == ["assistant", "tool"]


def test_every_shipped_preset_resolves_against_the_installed_plugins():
    """A preset is config a user runs by name: each one the installed distributions ship loads and resolves (its
    component options validated), so that a renamed option cannot leave one broken until someone runs it."""
    from aitrainsai.plugins import Plugins

    plugins = Plugins.load()
    assert {"default", "llm-demos", "llm-quickstart"} <= set(plugins.presets)
    for name in plugins.presets:
        resolve(load_config(None, [], preset=name, presets=plugins.presets), plugins, f"--preset {name}")  # or raises
