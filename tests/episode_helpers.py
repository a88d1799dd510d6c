"""Shared pieces for cross-package tests: runs with the fakes of :mod:`aitrainsai.testing` (a scripted agent, and an
inner trainer that reports given numbers), and an orchestrator process for the fault tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aitrainsai.config import RunConfig, load_config, resolve, resolve_record
from aitrainsai.jobs.job import job_template
from aitrainsai.plugins import Plugins
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.session import Session
from aitrainsai.testing import (EVALUATING_MARKER, FAKES, GivenNumbersTrainer, ScriptedPolicy,  # noqa: F401
                                call)

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


def session_of(run, plugins) -> Session:
    """The session of a run from its recorded config (as ``aitrainsai run --resume`` builds it)."""
    return Session(resolve_record(run.info()["config"], plugins), plugins, run)


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
            run = Ledger(tmp_path / "runs").create_run(resolved.record(), [], name="test")
            sessions.append(Session(resolved, plugins, run))
        return sessions[-1].episode(family, 1, episode_id, step=0, group_id="g0")

    return make


def template_calls(episode) -> list[dict]:
    files = job_template(episode.spec, episode.context.trainer.config_template(episode.spec))
    return [call("write_file", path=name, content=text) for name, text in files.items()]


def run_episode(episode, script):
    return asyncio.run(episode.play(ScriptedPolicy(script)))


def signal_when(process, ready, sig, *, within_s: float = 240.0, every_s: float = 0.1) -> bool:
    """Send ``sig`` to a running orchestrator once ``ready()`` holds (a run not in the ledger yet, ``LedgerError``,
    is not ready); False when it ended or ``within_s`` passed first."""
    import time

    from aitrainsai.run.ledger import LedgerError

    def holds() -> bool:
        try:
            return ready()
        except LedgerError:  # the run is not in the ledger yet
            return False

    deadline = time.monotonic() + within_s
    while process.poll() is None and time.monotonic() < deadline:
        if holds():
            process.send_signal(sig)
            return True
        time.sleep(every_s)
    return False


ORCHESTRATOR = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even when started with SIGINT ignored (`&`)
sys.path.insert(0, {tests!r})
from episode_helpers import plugins_with_given_numbers, resolved_config, session_of
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import Interrupted, run_loop

plugins = plugins_with_given_numbers()
ledger = Ledger({runs!r})
if sys.argv[1] == "new":
    run = ledger.create_run(resolved_config(plugins, *{settings!r}).record(), [], name={name!r})
else:
    run = ledger.run({name!r})
try:
    print(run_loop(session_of(run, plugins), resume=sys.argv[1] == "resume"), flush=True)
except Interrupted as stop:  # as the command line ends: one line, 128 + the signal
    print("interrupted by " + stop.name, file=sys.stderr, flush=True)
    sys.exit(stop.exit_code)
"""


def orchestrator_script(runs: Path, name: str, *settings: str) -> str:
    """A Python script (``python -c SCRIPT new|resume``) that runs, or resumes, the loop of the run ``name`` in
    ``runs`` with the given-numbers trainer and ``settings`` (``--set`` strings): a real orchestrator process for the
    fault tests to signal."""
    return ORCHESTRATOR.format(tests=str(ROOT / "tests"), runs=str(runs), name=name, settings=list(settings))

