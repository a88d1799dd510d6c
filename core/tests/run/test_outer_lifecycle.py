"""What the loop does with an outer trainer that prices its work, stops a run, exports its policy or refuses to
start: a clean, resumable stop; cost in the ledger, the progress line, ``runs`` and the report; the exported policy
beside the reward spec and the agent's exact prompt; a preflight problem as one line before any run exists."""

from __future__ import annotations

import pytest
from aitrainsai import hookimpl
from aitrainsai.config import ConfigError, resume_overrides
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from aitrainsai.cli.report import write_report
from aitrainsai.trainers import StopRun
from aitrainsai.testing import ScriptedPolicy
from aitrainsai.testing.fakes import ScriptedConfig
from aitrainsai.testing.runs import fake_config, fake_plugins, needs_verifiers, session_of
from pydantic import Field


class PricedConfig(ScriptedConfig):
    stop_after_updates: int = Field(0, json_schema_extra={"on_resume": True})  # 0: never stop
    price_per_sample: float = 0.25
    preflight_problem: str = ""
    refuse_at_start: str = ""  # a refusal a resume cannot change (an unoffered base, say)
    service_problem: str = ""  # what the service would refuse, asked before the run exists


class PricedPolicy(ScriptedPolicy):
    """The scripted policy, with a price per sample, a spending stop, an export and a preflight."""

    name = "priced"
    Config = PricedConfig

    def __init__(self, config: PricedConfig, *, state_dir):
        super().__init__(config, state_dir=state_dir)
        self.samples = 0

    @classmethod
    def preflight(cls, config):
        return [config.preflight_problem] if config.preflight_problem else []

    @classmethod
    def service_problems(cls, config):
        return [config.service_problem] if config.service_problem else []

    async def start(self):
        if self.config.refuse_at_start:
            raise StopRun(self.config.refuse_at_start, resumable=False)
        await super().start()

    async def sample(self, messages, tools, task, *, mode="train"):
        # The cap is checked where a hosted trainer checks it, before paying for a sample; it counts updates, so that
        # when it stops the run is known (the first step's episodes are finished; later ones are in flight).
        limit = self.config.stop_after_updates
        if limit and self.version >= limit:
            raise StopRun(f"spending cap reached after {self.samples} samples (${self.cost():.2f})")
        self.samples += 1
        return await super().sample(messages, tools, task, mode=mode)

    def cost(self) -> float:
        return self.samples * self.config.price_per_sample

    async def update(self, groups):
        metrics = await super().update(groups)
        return {**metrics, "cost_usd_total": self.cost(), "tokens_sampled": 10.0}

    async def export(self):
        return {"adapter": f"tinker://test/external_weights/v{self.policy_version}"}


class PricedPlugin:
    __name__ = "priced"

    @hookimpl
    def register_outer_trainers(self, register):
        register(PricedPolicy)


def priced_plugins():
    plugins = fake_plugins()
    plugins.add(PricedPlugin(), name="priced", distribution="test-priced")
    return plugins


BASE = ("outer_trainer.use=priced", "loop.steps=2", "loop.group_size=2", "loop.groups_per_step=1",
        "families.held_out=[]", "loop.eval_every=0")


@needs_verifiers
@pytest.mark.slow
def test_a_stop_keeps_every_finished_episode_and_the_run_resumes_to_the_end(tmp_path):
    plugins = priced_plugins()
    # Two workers: two groups in flight (every one with signal), so the third starts after the first update.
    resolved = fake_config(plugins, *BASE, "loop.final_eval=false", "loop.steps=3", "gpu_backend.local.workers=2",
                           "inner_trainer.given-numbers.spread=0.3", "outer_trainer.priced.stop_after_updates=1")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    summary = run_loop(session_of(run, plugins))
    assert (summary.stopped or "").startswith("spending cap reached after ")
    assert run.info().status == "stopped"
    (stop,) = [e.data for e in run.events("stopped")]
    assert stop["resumable"] is True
    finished = {e.id for e in run.episodes() if e.status in ("done", "dead", "invalid", "no_submission")}
    assert finished, "no episode finished before the stop"
    assert not list(run.events("policy_export")), "a stopped run exported its policy"

    # resumed with the cap raised, the one kind of option a resume may change; nothing else may
    record = run.info().config
    with pytest.raises(ConfigError, match="loop.steps: cannot change when a run resumes"):
        resume_overrides(record, ["loop.steps=5"], plugins)
    with pytest.raises(ConfigError, match="what may: outer_trainer.priced.stop_after_updates"):
        resume_overrides(record, ["outer_trainer.priced.price_per_sample=0"], plugins)
    run.set_config(resume_overrides(record, ["outer_trainer.priced.stop_after_updates=0"], plugins))
    summary = run_loop(session_of(run, plugins), resume=True)
    assert summary.stopped is None and summary.steps == 3
    assert run.info().status == "finished"
    for episode in run.episodes():
        if episode.id in finished:
            assert len([m for m in run.transcript(episode.id) if m["role"] == "system"]) == 1, "replayed"
    (export,) = [e.data for e in run.events("policy_export")]
    assert export["refs"] == {"adapter": "tinker://test/external_weights/v3"}


@needs_verifiers
@pytest.mark.slow
def test_cost_and_the_exported_policy_reach_the_ledger_the_progress_line_runs_and_the_report(tmp_path):
    pytest.importorskip("matplotlib")
    from io import StringIO

    from rich.console import Console

    from aitrainsai.cli.progress import LoopProgress

    plugins = priced_plugins()
    resolved = fake_config(plugins, *BASE, "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    out = StringIO()
    run_loop(session_of(run, plugins), display=LoopProgress(Console(file=out, width=300), resolved.loop.steps))
    steps = [e.data for e in run.events("outer_step")]
    assert [s["metrics"]["cost_usd_total"] for s in steps] == sorted(s["metrics"]["cost_usd_total"] for s in steps)
    total = steps[-1]["metrics"]["cost_usd_total"]
    assert total > 0
    assert f"agent cost: ${total:.2f}" in out.getvalue()
    (summary,) = Ledger(tmp_path).summaries()
    assert summary.agent_cost_usd == pytest.approx(total)

    (export,) = [e.data for e in run.events("policy_export")]
    assert export["reward_spec"]["name"] == "default" and "reward =" in export["reward_spec"]["formula"]
    import json

    prompts = {p.stem: json.loads(p.read_text()) for p in (run.dir / "agent_prompt").glob("*.json")}
    assert set(prompts) <= {"tally"} and prompts
    report = write_report(run).read_text()
    assert f"${total:.2f} over 2 outer steps" in report
    assert "## Trained policy" in report and "`tinker://test/external_weights/v2`" in report
    assert "[terms]" in report or "[[terms]]" in report, "the reward spec's file is not in the report"
    prompt_file = (run.dir / "report" / "agent_prompt.md").read_text()
    first = next(iter(prompts.values()))
    assert first["messages"][0]["content"] in prompt_file  # the system message, verbatim
    assert '"name": "submit_job"' in prompt_file


def test_a_preflight_or_service_problem_is_one_line_before_any_run_exists():
    from aitrainsai.run.session import Session

    plugins = priced_plugins()
    resolved = fake_config(plugins, *BASE, "outer_trainer.priced.preflight_problem=no API key in TINKER_API_KEY")
    with pytest.raises(ConfigError, match=r"^config: outer_trainer.priced: no API key in TINKER_API_KEY$"):
        Session.check(resolved, plugins)
    resolved = fake_config(plugins, *BASE, "outer_trainer.priced.service_problem=base model 'x' is not offered")
    with pytest.raises(ConfigError, match=r"^config: outer_trainer.priced: base model 'x' is not offered$"):
        Session.check(resolved, plugins)
    Session.check(fake_config(plugins, *BASE), plugins)  # no problem: nothing raised


def test_a_refusal_a_resume_cannot_change_is_recorded_as_such(tmp_path):
    plugins = priced_plugins()
    resolved = fake_config(plugins, *BASE, "outer_trainer.priced.refuse_at_start='base model not offered'")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    summary = run_loop(session_of(run, plugins))
    assert (summary.stopped, summary.resumable, summary.steps) == ("base model not offered", False, 0)
    assert [e.data["resumable"] for e in run.events("stopped")] == [False]
    assert not run.episodes()
