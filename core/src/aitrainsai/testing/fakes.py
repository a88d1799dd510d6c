"""The fakes a plugin's tests (and the core's) run a run with, selectable by name once added:
:class:`GivenNumbersTrainer` (``inner_trainer.use = "given-numbers"``), an inner trainer whose payloads are real
subprocesses that report the numbers it is given, so episodes, backends and resume run without a model;
:class:`ScriptedPolicy` (``outer_trainer.use = "scripted"``), an agent that plays back the messages it is given;
:class:`FailingTracker` (``trackers = ["failing"]``), a tracker that raises; and, added apart
(:data:`FAKE_FAMILIES`), the tally task families (:mod:`aitrainsai.testing.tally`). (Models: Inspect AI's
``mockllm``, llm's mock model.)

    plugins = Plugins.load()
    plugins.add(FAKES, name="given-numbers", distribution="test-given-numbers")
    plugins.add(FAKE_FAMILIES, name="tally", distribution="test-tally")  # families.train = ["tally"]
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from aitrainsai.backends import JobPayload, JobResult
from aitrainsai.chat import Message
from aitrainsai.components import ComponentConfig
from aitrainsai.evaluation import EngineSpec
from aitrainsai.hookspecs import hookimpl
from aitrainsai.trackers import TrackedRun, Tracker
from aitrainsai.trainers import (AgentTask, AgentTurn, InnerTrainer, InnerTrainerConfig, JobConfigBase, OuterTrainer,
                                 SampleMode, ScoredEpisode, TrainOutcome)

EVALUATING_MARKER = "evaluating"  # in the payload's working directory while it is in its evaluation phase


class GivenNumbersConfig(InnerTrainerConfig):
    pre: dict[str, float] = {"tiny-a": 0.3, "tiny-b": 0.4}
    post: float = 0.6
    train_seconds: float = 450.0
    eval_size: int = 10
    crash: bool = False
    job_seconds: float = 0.0
    eval_seconds: float = 0.0  # > 0: after training, the payload writes EVALUATING_MARKER and "evaluates" this long
    spread: float = 0.0  # added to post on odd episodes (...-e1-job): every group then has a reward spread
    deterministic: bool = False  # declare training deterministic (InnerTrainer.deterministic): identical jobs share
    reproducible: bool | None = True  # what a payload reports of the job's code (TrainOutcome.reproducible)
    infra: list[int] = []  # episodes (...-e{n}-job) whose payload dies of the infrastructure (exit 75, classify())
    jitter: float = 0.0  # a random amount up to this added to post by each payload: trainings of one job differ


class GivenJobConfig(JobConfigBase):
    learning_rate: float = 1e-4
    seed: int = 0  # the training seed (it changes no number here)


class GivenNumbersTrainer(InnerTrainer):
    """Runs real subprocess payloads that report the configured numbers: episode plumbing without a model."""

    name = "given-numbers"
    base_models = ("tiny-a", "tiny-b")
    Config = GivenNumbersConfig
    JobConfig = GivenJobConfig

    def payload(self, job_dir, spec, job_id, family):
        c = self.config
        learning_rate = self.job_config(job_dir).learning_rate  # so that the agent's choices change the outcome
        post = c.post + (0.2 if learning_rate >= 1e-3 else 0.0)
        episode = re.search(r"-e(\d+)-job$", job_id)
        if c.spread and episode and int(episode.group(1)) % 2:
            post += c.spread
        crash = 75 if episode and int(episode.group(1)) in c.infra else 3 if c.crash else 0
        post_code = f"{post!r} + __import__('random').random() * {c.jitter!r}" if c.jitter else repr(post)
        code = ("import json, os, sys, time; sys.exit(%r) if %r else None; time.sleep(%r); %s"
                "os.makedirs('ckpt', exist_ok=True); json.dump({'post': %s}, open('ckpt/post.json', 'w')); "
                "json.dump({'train_seconds': %r, 'reproducible': %r}, open('train.json', 'w'))"
                % (crash, crash, c.job_seconds, _logged(job_id), post_code, c.train_seconds, c.reproducible))
        return JobPayload(job_id=job_id, workdir=Path(job_dir).parent / "run", command=["python", "-c", code],
                          artifacts={"train": "train.json", "checkpoint": "ckpt"}, timeout_s=60)

    def deterministic(self, backend):
        """As configured; never with ``spread``, which makes a job's numbers depend on its episode, not its files."""
        return self.config.deterministic and not self.config.spread

    def classify(self, outcome: JobResult) -> JobResult:
        """Exit 75 is the infrastructure's, as the local trainer's driver says it."""
        if outcome.status == "dead" and outcome.exit_code == 75:
            return outcome.model_copy(update={"reason": "infra"})
        return outcome

    def result(self, outcome: JobResult) -> TrainOutcome:
        data = json.loads(outcome.artifacts["train"].read_text())
        return TrainOutcome(checkpoint=outcome.artifacts["checkpoint"], train_seconds=data["train_seconds"],
                            reproducible=data.get("reproducible"))

    def eval_payload(self, family, level, base_model, checkpoint, workdir, job_id):
        """Scores the base's given number, or the post a checkpoint holds, as ``eval_size`` items; a checkpoint's
        evaluation takes ``eval_seconds`` with EVALUATING_MARKER in its folder, and is logged like a job."""
        c = self.config
        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        engine = EngineSpec(engine="given", base_model=base_model, dtype="none", max_new_tokens=1, batch_size=1)
        result = {"family": family.name, "level": level, "eval_seed": 0, "eval_size": c.eval_size,
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


ScriptEntry = Message | str
"""A scripted turn: an assistant message (:func:`call` builds one), or text that does not parse."""


def _submit_the_template() -> list[ScriptEntry]:
    return [call("submit_job")]


class ScriptedConfig(ComponentConfig):
    script: list[ScriptEntry] = Field(
        default_factory=_submit_the_template,
        description="the turns of every conversation, in order: a message, or a string (text that does not parse); "
                    "the default submits the job template as it is")


class ScriptedPolicy(OuterTrainer):
    """An agent that plays back a script: the n-th turn of every conversation is the script's n-th entry (a message,
    or a string: unparseable text), then "done". It learns nothing; an update of any groups only counts a version. Made
    ``ScriptedPolicy(script)`` in a test, or by the loop from ``outer_trainer.scripted.script``."""

    name = "scripted"
    description = "a fake agent for tests: plays back the turns it is given"
    Config = ScriptedConfig

    def __init__(self, config: ScriptedConfig | list[ScriptEntry], *, state_dir: Path = Path()):
        config = config if isinstance(config, ScriptedConfig) else ScriptedConfig(script=config)
        super().__init__(config, state_dir=state_dir)
        self.config: ScriptedConfig = config
        self.version = 0

    @property
    def policy_version(self) -> int:
        return self.version

    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        turn = sum(message.get("role") == "assistant" for message in messages)
        entry = self.config.script[turn] if turn < len(self.config.script) else None
        if entry is None:
            return AgentTurn(message={"role": "assistant", "content": "done"}, policy_version=self.version)
        if isinstance(entry, str):
            return AgentTurn(message={"role": "assistant", "content": entry}, policy_version=self.version,
                             parse_error="no JSON tool call found")
        return AgentTurn(message=entry, policy_version=self.version)

    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        if groups:
            self.version += 1
        return {"groups_used": float(len(groups))}

    async def save_state(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "scripted.json").write_text(json.dumps({"version": self.version}))

    async def load_state(self, path: Path) -> None:
        self.version = json.loads((Path(path) / "scripted.json").read_text())["version"]


def call(name: str, **arguments: Any) -> Message:
    """An assistant message that calls tool ``name`` with ``arguments`` (for a :class:`ScriptedPolicy`)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c-{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


class FailingTracker(Tracker):
    """A tracker whose ``log`` raises (the run must go on without it); ``start`` notes itself in
    ``run_dir/failing-tracker.started``."""

    name = "failing"

    def start(self, run: TrackedRun) -> None:
        (self.run_dir / "failing-tracker.started").write_text(run.run_id)

    def log(self, points: list[Any]) -> None:
        raise RuntimeError("this tracker always fails")


class GivenNumbersPlugin:
    """A plugin that registers the fakes (the given-numbers trainer): ``plugins.add(FAKES, ...)`` in a test."""

    __name__ = "given_numbers"

    @hookimpl
    def register_inner_trainers(self, register):
        register(GivenNumbersTrainer)

    @hookimpl
    def register_outer_trainers(self, register):
        register(ScriptedPolicy)

    @hookimpl
    def register_trackers(self, register):
        register(FailingTracker)


FAKES = GivenNumbersPlugin()
