"""Shared pieces for cross-package tests: runs of the installed families with the fakes of :mod:`aitrainsai.testing`
(a scripted agent, and an inner trainer that reports given numbers), and an orchestrator process for the backends'
and the viewer's tests. (The engine's own tests run on the fakes alone: :mod:`aitrainsai.testing.runs`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from aitrainsai.config import RunConfig, load_config, resolve
from aitrainsai.plugins import Plugins
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.session import Session
from aitrainsai.testing import (EVALUATING_MARKER, FAKES, GivenNumbersTrainer, ScriptedPolicy,  # noqa: F401
                                call)
from aitrainsai.testing.runs import orchestrator_script as runs_orchestrator
from aitrainsai.testing.runs import run_episode, session_of, signal_when, template_calls  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def plugins():
    return Plugins.load()


def plugins_with_given_numbers() -> Plugins:
    plugins = Plugins.load()
    plugins.add(FAKES, name="given-numbers", distribution="test-given-numbers")
    return plugins


_GIVEN: list[Plugins] = []


def given_plugins() -> Plugins:
    """One plugin set with the given-numbers trainer for this test process."""
    if not _GIVEN:
        _GIVEN.append(plugins_with_given_numbers())
    return _GIVEN[0]


def resolved_config(plugins, *overrides):
    config = load_config(None, ["inner_trainer.use=given-numbers", "families.train=['calc_chain','ledger']",
                                "gpu_backend.local.workers=4", f"reward_spec={ROOT / 'reward_specs' / 'default.toml'}",
                                # the default preset's evaluations are held-out only, with the untrained policy
                                # first; these tests count every family's evaluation at the end
                                "loop.eval_initial=false", "loop.eval_families=all",
                                *overrides], presets=plugins.presets)
    return resolve(config, plugins)


@pytest.fixture
def make_episode(tmp_path):
    sessions: list[Session] = []

    def make(family="calc_chain", episode_id="ep-1", **config):
        """An episode of a fresh run, or with ``episode_id`` other than ep-1, another of the last one's run."""
        if episode_id == "ep-1":
            plugins = given_plugins()
            resolved = resolve(RunConfig.model_validate({
                "reward_spec": str(ROOT / "reward_specs" / "default.toml"),
                "gpu_backend": {"use": "local", "local": {"workers": 2}},
                "inner_trainer": {"use": "given-numbers", "given-numbers": config},
                "families": {"train": [], "held_out": []}}), plugins, outer=False)
            run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [], name="test")
            sessions.append(Session(resolved, plugins, run))
        return sessions[-1].episode(family, 1, episode_id, step=0, group_id="g0")

    return make


def orchestrator_script(runs: Path, name: str, *settings: str) -> str:
    """A Python script (``python -c SCRIPT new|resume``) that runs, or resumes, the loop of the run ``name`` in
    ``runs`` with the given-numbers trainer and ``settings`` (``--set`` strings): a real orchestrator process for the
    backends' and the viewer's tests to signal."""
    return runs_orchestrator(runs, name, *settings, helpers="episode_helpers", plugins="plugins_with_given_numbers",
                             config="resolved_config", path=ROOT / "tests")

