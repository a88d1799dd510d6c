"""Shared pieces for cross-package tests: a scripted agent, and an inner trainer that reports given numbers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from aitrainsai import hookimpl
from aitrainsai.backends import JobPayload, JobResult
from aitrainsai.config import RunConfig, load_config, resolve, resolve_record
from aitrainsai.jobs.job import job_template
from aitrainsai.run.ledger import Ledger
from aitrainsai.plugins import Plugins
from aitrainsai.run.session import Session
from aitrainsai.evaluation import EngineSpec
from aitrainsai.trainers import AgentTurn, InnerTrainer, JobConfigBase, TrainOutcome
from aitrainsai.components import ComponentConfig

ROOT = Path(__file__).resolve().parents[1]
EVALUATING_MARKER = "evaluating"  # in the payload's working directory while it is in its evaluation phase


class GivenNumbersConfig(ComponentConfig):
    pre: dict[str, float] = {"tiny-a": 0.3, "tiny-b": 0.4}
    post: float = 0.6
    train_seconds: float = 450.0
    eval_size: int = 10
    crash: bool = False
    job_seconds: float = 0.0
    eval_seconds: float = 0.0  # > 0: after training, the payload writes EVALUATING_MARKER and "evaluates" this long
    spread: float = 0.0  # added to post on odd episodes (...-e1-job): every group then has a reward spread


class GivenJobConfig(JobConfigBase):
    learning_rate: float = 1e-4


class GivenNumbersTrainer(InnerTrainer):
    """Runs real subprocess payloads that report the configured numbers: episode plumbing without a model."""

    name = "given-numbers"
    base_models = ("tiny-a", "tiny-b")
    Config = GivenNumbersConfig
    JobConfig = GivenJobConfig

    def payload(self, job_dir, spec, job_id):
        c = self.config
        learning_rate = self.job_config(job_dir).learning_rate  # so that the agent's choices change the outcome
        post = c.post + (0.2 if learning_rate >= 1e-3 else 0.0)
        episode = re.search(r"-e(\d+)-job$", job_id)
        if c.spread and episode and int(episode.group(1)) % 2:
            post += c.spread
        code = ("import json, os, sys, time; sys.exit(3) if %r else None; time.sleep(%r); %s"
                "os.makedirs('ckpt', exist_ok=True); json.dump({'post': %r}, open('ckpt/post.json', 'w')); "
                "json.dump({'train_seconds': %r}, open('train.json', 'w'))"
                % (c.crash, c.job_seconds, _logged(job_id), post, c.train_seconds))
        return JobPayload(job_id=job_id, workdir=Path(job_dir).parent / "run", command=["python", "-c", code],
                          artifacts={"train": "train.json", "checkpoint": "ckpt"}, timeout_s=60)

    def result(self, outcome: JobResult) -> TrainOutcome:
        data = json.loads(outcome.artifacts["train"].read_text())
        return TrainOutcome(checkpoint=outcome.artifacts["checkpoint"], train_seconds=data["train_seconds"])

    def eval_payload(self, family, level, base_model, checkpoint, workdir, job_id):
        """Scores the base's given number, or the post a checkpoint holds, as ``eval_size`` items; a checkpoint's
        evaluation takes ``eval_seconds`` with EVALUATING_MARKER in its folder, and is logged like a job."""
        c = self.config
        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        engine = EngineSpec(engine="given", base_model=base_model, dtype="none", max_new_tokens=1, batch_size=1)
        result = {"family": family, "level": level, "eval_seed": 0, "eval_size": c.eval_size,
                  "engine": engine.model_dump(mode="json")}
        if checkpoint is None:
            code = "import json; score = %r; " % c.pre[base_model]
        else:
            shutil.copytree(checkpoint, workdir / "ckpt")
            evaluate = f"open({EVALUATING_MARKER!r}, 'w'); time.sleep({c.eval_seconds!r}); " if c.eval_seconds else ""
            code = ("import json, time; %s%sscore = json.load(open('ckpt/post.json'))['post']; "
                    % (evaluate, _logged(job_id)))
        code += ("n = %d; hits = min(n, round(score * n)); json.dump({**%r, 'item_scores': [1.0] * hits + [0.0] * "
                 "(n - hits)}, open('scores.json', 'w'))" % (c.eval_size, result))
        return JobPayload(job_id=job_id, workdir=workdir, command=["python", "-c", code],
                          artifacts={"scores": "scores.json"}, timeout_s=60)


def _logged(job_id: str) -> str:
    """Code that appends ``job_id`` to GIVEN_NUMBERS_LOG (each payload execution, for the fault tests)."""
    log = os.environ.get("GIVEN_NUMBERS_LOG", "")
    return f"open({log!r}, 'a').write({job_id!r} + '\\n'); " if log else ""


class ScriptedPolicy:
    """Plays back messages; a string entry is unparseable text."""

    def __init__(self, script: list):
        self.script = list(script)

    async def sample(self, messages, tools, task):
        if not self.script:
            return AgentTurn(message={"role": "assistant", "content": "done"})
        entry = self.script.pop(0)
        if isinstance(entry, str):
            return AgentTurn(message={"role": "assistant", "content": entry}, parse_error="no JSON tool call found")
        return AgentTurn(message=entry)


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c-{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


@pytest.fixture(scope="session")
def plugins():
    return Plugins.load()


class GivenNumbersPlugin:
    __name__ = "given_numbers"

    @hookimpl
    def register_inner_trainers(self, register):
        register(GivenNumbersTrainer)


def plugins_with_given_numbers() -> Plugins:
    plugins = Plugins.load()
    plugins.add(GivenNumbersPlugin(), name="given-numbers", distribution="test-given-numbers")
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

