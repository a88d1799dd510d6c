"""A run's plugin selection, and the versions recorded with it, decide what every process of the run loads: the
trainers on the orchestrator's side use the run's plugins (not a fresh load of whatever is installed), and a payload
process loads the run's plugins that its runtime names, at the recorded versions, whatever was installed since.

A plugin "installed" here is a real distribution on the path (a module and its ``.dist-info`` with an entry point),
found by ``importlib.metadata`` in this process and in the payload processes started with it on ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aitrainsai.config import load_config, resolve
from aitrainsai.plugins import with_env
from aitrainsai.run.ledger import Ledger
from aitrainsai.plugins import SELECTION_VARIABLE, VERSIONS_VARIABLE, PluginError, Plugins
from aitrainsai.run.session import Session

BROKEN = "aitrainsai-family-broken"


def install(site: Path, dist: str, source: str, version: str = "1.0") -> None:
    """A distribution ``dist`` in ``site``: one module registering nothing (``source``) and its metadata."""
    module = dist.replace("-", "_")
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[aitrainsai]\nbroken = {module}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder of distributions on this process's path (and on its payloads' ``PYTHONPATH``)."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv(SELECTION_VARIABLE, raising=False)
    monkeypatch.delenv(VERSIONS_VARIABLE, raising=False)
    return folder


def session(tmp_path, plugins, trainer="local") -> Session:
    resolved = resolve(load_config(None, [f"inner_trainer.use={trainer!r}", "families.train=['calc_chain']",
                                          "families.held_out=[]"], presets=plugins.presets), plugins, outer=False)
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [], selection=plugins.selection_string())
    return Session(resolved, plugins, run)


@pytest.mark.parametrize("trainer", ["local", "prime_rl"])
def test_a_plugin_left_out_of_the_run_is_never_loaded_by_its_trainers(tmp_path, site, trainer):
    pytest.importorskip(f"aitrainsai_trainer_{trainer}")
    install(site, BROKEN, "raise ImportError('BROKEN cannot be imported')\n")
    with pytest.raises(PluginError, match="BROKEN"):
        Plugins.load()  # what the trainers did on the orchestrator's side
    plugins = Plugins.load(f"no:{BROKEN}")
    sess = session(tmp_path, plugins, trainer)
    inner = sess.inner_trainer
    payload = inner.eval_payload(sess.family("calc_chain"), 1, inner.base_models[0], None, tmp_path / "eval",
                                 "j-eval")
    assert payload.runtime.distributions
    if trainer == "local":
        assert "aitrainsai-family-calc-chain" in payload.runtime.distributions


def test_a_plugin_installed_while_a_run_goes_changes_nothing_the_run_loads(tmp_path, site):
    pytest.importorskip("aitrainsai_trainer_local")
    plugins = Plugins.load()
    sess = session(tmp_path, plugins)
    inner = sess.inner_trainer
    install(site, BROKEN, "raise ImportError('BROKEN cannot be imported')\n")  # installed mid-run
    payload = inner.eval_payload(sess.family("calc_chain"), 1, inner.base_models[0], None, tmp_path / "eval",
                                 "j-eval")
    assert "aitrainsai-family-calc-chain" in payload.runtime.distributions


def test_a_payload_loads_the_run_plugins_its_runtime_names_at_the_recorded_versions(tmp_path, site):
    pytest.importorskip("aitrainsai_trainer_local")
    plugins = Plugins.load()
    sess = session(tmp_path, plugins)
    inner = sess.inner_trainer
    payload = with_env(inner.eval_payload(sess.family("calc_chain"), 1, inner.base_models[0], None,
                                          tmp_path / "eval", "j"), sess.payload_env)
    selection = payload.env[SELECTION_VARIABLE].split(",")
    assert sorted(selection) == ["aitrainsai-family-calc-chain", "aitrainsai-trainer-local"], selection
    versions = dict(entry.split("==") for entry in payload.env[VERSIONS_VARIABLE].split(","))
    assert set(versions) == {"aitrainsai", *selection}
    install(site, BROKEN, "raise ImportError('BROKEN cannot be imported')\n")  # installed after the payload was made

    def load_in_a_payload_process() -> subprocess.CompletedProcess:
        script = ("from aitrainsai.plugins import Plugins\n"
                  "plugins = Plugins.load()\n"
                  "print(plugins.selection_string(), sorted(plugins.task_families.names()))\n")
        env = {**os.environ, **payload.env, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)

    loaded = load_in_a_payload_process()
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split()[0] == "aitrainsai-family-calc-chain,aitrainsai-trainer-local"
    assert "['calc_chain']" in loaded.stdout

    # a plugin of the run upgraded while the run goes: the payload refuses in one line instead of running other code
    install(site, "aitrainsai-family-calc-chain", "from aitrainsai_family_calc_chain.plugin import *\n", "9.9")
    changed = load_in_a_payload_process()
    assert changed.returncode == 1
    recorded = versions['aitrainsai-family-calc-chain']
    assert (f"aitrainsai-family-calc-chain {recorded} (installed: 9.9)" in changed.stderr
            and "other plugin versions than its run recorded" in changed.stderr), changed.stderr[-2000:]


def test_with_env_leaves_a_payload_without_a_runtime_the_whole_selection():
    from aitrainsai.backends import JobPayload

    env = {SELECTION_VARIABLE: "a,b", VERSIONS_VARIABLE: "aitrainsai==1,a==1,b==2"}
    plain = with_env(JobPayload(job_id="j", workdir=Path("/tmp/w"), command=["true"]), env)
    assert plain.env == env
    narrowed = with_env(JobPayload(job_id="j", workdir=Path("/tmp/w"), command=["true"],
                                   runtime={"distributions": {"aitrainsai": "", "B": "==2"}}), env)
    assert narrowed.env == {SELECTION_VARIABLE: "b", VERSIONS_VARIABLE: "aitrainsai==1,b==2"}
    assert json.loads(narrowed.model_dump_json())["env"] == narrowed.env
