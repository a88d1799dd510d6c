"""Runs on the fakes alone, for the engine's tests (the core's own, and a subprocess orchestrator's, which imports
them from here): the given-numbers inner trainer, the scripted policy and the tally families, over the core's
built-in plugins only; nothing else installed is loaded."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aitrainsai.chat import Message
from aitrainsai.config import ResolvedConfig, RunConfig, load_config, resolve, resolve_snapshot
from aitrainsai.jobs.job import job_template
from aitrainsai.plugins import Plugins
from aitrainsai.run.episode import Episode, EpisodeResult
from aitrainsai.run.ledger import Ledger, LedgerError, Run
from aitrainsai.run.session import Session
from aitrainsai.testing.fakes import FAKES, ScriptEntry, ScriptedPolicy, call
from aitrainsai.testing.tally.family import FAKE_FAMILIES

needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="an accepted job is a verifiers environment: install aitrainsai[jobs]")
"""For a test whose probe must accept a job (the job template's environment loads verifiers in the sandbox)."""


def fake_plugins() -> Plugins:
    """The core's built-in plugins with the fakes: ``given-numbers``, ``scripted``, ``failing``, the tally families."""
    plugins = Plugins.load("")
    plugins.add(FAKES, name="given-numbers", distribution="test-given-numbers")
    plugins.add(FAKE_FAMILIES, name="tally", distribution="test-tally")
    return plugins


def fake_config(plugins: Plugins, *overrides: str) -> ResolvedConfig:
    """A run on the fakes: tally trained, tally_held_out held out, four local workers, ``overrides`` (``--set``
    strings) over it."""
    config = load_config(None, ["inner_trainer.use=given-numbers", "outer_trainer.use=scripted",
                                "families.train=['tally']", "gpu_backend.local.workers=4", "reward_spec=default",
                                *overrides], presets=plugins.presets)
    return resolve(config, plugins)


def session_of(run: Run, plugins: Plugins) -> Session:
    """The session of a run from its recorded config (as ``aitrainsai run --resume`` builds it)."""
    return Session(resolve_snapshot(run.info().config, plugins), plugins, run)


def episode_session(runs: Path, plugins: Plugins, *, run: Run | None = None, name: str = "test",
                    loop: dict[str, Any] | None = None, **given: Any) -> Session:
    """A session with no outer trainer, for episodes played by hand: the given-numbers trainer with options
    ``given``, two local workers, loop settings ``loop``; of a new run named ``name`` in ``runs``, or of ``run`` (as
    a resume with these settings would build it)."""
    resolved = resolve(RunConfig.model_validate({
        "reward_spec": "default",
        "gpu_backend": {"use": "local", "local": {"workers": 2}},
        "inner_trainer": {"use": "given-numbers", "given-numbers": given},
        "loop": loop or {},
        "families": {"train": [], "held_out": []}}), plugins, outer=False)
    return Session(resolved, plugins, run or Ledger(runs).create_run(resolved.snapshot(), [], name=name))


def template_calls(episode: Episode) -> list[Message]:
    """``write_file`` calls that write the episode's job template, file by file."""
    files = job_template(episode.spec, episode.context.trainer.config_template(episode.spec))
    return [call("write_file", path=name, content=text) for name, text in files.items()]


def run_episode(episode: Episode, script: list[ScriptEntry]) -> EpisodeResult:
    return asyncio.run(episode.play(ScriptedPolicy(script)))


ORCHESTRATOR = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even when started with SIGINT ignored (`&`)
sys.path[:0] = {path!r}
from {helpers} import {plugins} as make_plugins, {config} as make_config
from aitrainsai.testing.runs import session_of
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import Interrupted, run_loop

plugins = make_plugins()
ledger = Ledger({runs!r})
if sys.argv[1] == "new":
    run = ledger.create_run(make_config(plugins, *{settings!r}).snapshot(), [], name={name!r})
else:
    run = ledger.run({name!r})
try:
    print(run_loop(session_of(run, plugins), resume=sys.argv[1] == "resume"), flush=True)
except Interrupted as stop:  # as the command line ends: one line, 128 + the signal
    print("interrupted by " + stop.name, file=sys.stderr, flush=True)
    sys.exit(stop.exit_code)
"""


def orchestrator_script(runs: Path, name: str, *settings: str, helpers: str = "aitrainsai.testing.runs",
                        plugins: str = "fake_plugins", config: str = "fake_config", path: Path | None = None) -> str:
    """A Python script (``python -c SCRIPT new|resume``) that runs, or resumes, the loop of the run ``name`` in
    ``runs`` with ``settings`` (``--set`` strings): a real orchestrator process to signal. Its plugins and config come
    from ``helpers`` (a module, found on ``path`` where given): by default the fakes here."""
    return ORCHESTRATOR.format(runs=str(runs), name=name, settings=list(settings), helpers=helpers, plugins=plugins,
                               config=config, path=[str(path)] if path is not None else [])


def signal_when(process: subprocess.Popen, ready: Callable[[], bool], sig: int, *, within_s: float = 240.0,
                every_s: float = 0.1) -> bool:
    """Send ``sig`` to a running orchestrator once ``ready()`` holds (a run not in the ledger yet, ``LedgerError``,
    is not ready); False when it ended or ``within_s`` passed first."""

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
