"""The nested loop: groups of episodes stream through the GPU backend, and the outer trainer learns from them.

Each group is ``group_size`` episodes of one task (a training family at its level). Groups are launched with no
barrier per outer step: while the policy trains on finished groups, the backend's workers keep running jobs. A group
sampled more than ``max_steps_off_policy`` updates ago is dropped; a group whose rewards are all equal carries no
signal and is skipped; both are counted. Every ``eval_every`` steps (and at the end) the current policy plays the
held-out family and the training families with no update. ``resume`` continues a killed run from its ledger.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitrainsai.episode import Baselines, Episode, EpisodeContext, EpisodeResult
from aitrainsai.grpo import staleness
from aitrainsai.jobs import private_paths
from aitrainsai.reward_spec import load_reward_spec
from aitrainsai.trainers import AgentTurn

if TYPE_CHECKING:
    from aitrainsai.ledger import Run
    from aitrainsai.plugins import Plugins

FINISHED = ("done", "dead", "invalid", "no_submission")


def groups_in_flight(capacity: int, group_size: int, groups_per_step: int) -> int:
    """How many groups the loop keeps launched: enough to fill every worker, plus one outer step queued behind them,
    so that the pool never waits for a step boundary and the backend sees a whole step to order by length."""
    return max(capacity // group_size, 1) + groups_per_step


@dataclass
class Group:
    id: str
    family: str
    level: int
    results: list[EpisodeResult] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results]

    @property
    def policy_version(self) -> int:
        versions = [t.policy_version for r in self.results for t in r.turns]
        return min(versions) if versions else 0


@dataclass
class Counters:
    launched: int = 0
    in_flight: int = 0
    dropped: int = 0
    skipped: int = 0
    jobs: dict[str, int] = field(default_factory=lambda: {"done": 0, "dead": 0})


class NestedLoop:
    def __init__(self, run: "Run", plugins: "Plugins", resolved: dict[str, Any], *, progress: Any = None):
        self.run = run
        self.plugins = plugins
        self.config = resolved
        self.loop_config = resolved["loop"]
        self.progress = progress
        families = plugins.task_families
        self.train_families = [families.get(name)() for name in resolved["families"]["train"]]
        self.held_out = [families.get(name)() for name in resolved["families"]["held_out"]]
        if any(f.held_out for f in self.train_families):
            raise ValueError("a held-out family is in families.train: the loop never trains on one")
        self.level = resolved["families"].get("level")
        backend_name = resolved["gpu_backend"]["use"]
        self.backend = plugins.create("gpu_backends", backend_name, resolved["gpu_backend"].get(backend_name),
                                      workdir=run.dir / "backend")
        trainer_name = resolved["inner_trainer"]["use"]
        self.trainer = plugins.create("inner_trainers", trainer_name, resolved["inner_trainer"].get(trainer_name))
        policy_name = resolved["outer_trainer"]["use"]
        self.policy = plugins.create("outer_trainers", policy_name, resolved["outer_trainer"].get(policy_name),
                                     state_dir=run.dir / "policy")
        self.reward_spec = load_reward_spec(resolved["reward_spec"], plugins)
        every_family = [type(f) for f in self.train_families + self.held_out]
        self.context = EpisodeContext(
            run=run, trainer=self.trainer, backend=self.backend, reward_spec=self.reward_spec,
            baselines=Baselines(run.ledger, self.trainer, self.backend, run.dir / "baselines"),
            hide=private_paths(every_family) + [run.ledger.runs_dir],
            max_agent_turns=self.loop_config["max_agent_turns"])
        self.rng = random.Random(self.loop_config["seed"])
        self.counters = Counters()
        self.buffer: list[Group] = []
        self.trained_steps = 0
        self._family_cycle: list[Any] = []

    # -- public ----------------------------------------------------------------------------------------------------
    async def run_loop(self, resume: bool = False) -> dict[str, Any]:
        steps = self.loop_config["steps"]
        per_step = self.loop_config["groups_per_step"]
        max_groups = steps * per_step * self.loop_config["max_group_factor"]
        tasks: set[asyncio.Task] = set()
        await self.backend.start()
        try:
            if resume:
                tasks |= self._resume()
            while self.trained_steps < steps:
                needed = (steps - self.trained_steps) * per_step - len(self.buffer) - len(tasks)
                room = groups_in_flight(self.backend.capacity, self.loop_config["group_size"], per_step)
                while needed > 0 and len(tasks) < room and self.counters.launched < max_groups:
                    tasks.add(asyncio.ensure_future(self._play_group(self._next_group())))
                    needed -= 1
                if not tasks:
                    self.run.event("stopped", reason=f"{max_groups} groups launched without enough signal to train")
                    break
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._accept(task.result())
                while len(self.buffer) >= per_step and self.trained_steps < steps:
                    await self._train_step(self.buffer[:per_step])
                    self.buffer = self.buffer[per_step:]
                    every = self.loop_config["eval_every"]
                    if every and self.trained_steps % every == 0 and self.trained_steps < steps:
                        await self._evaluate()
            for task in tasks:
                task.cancel()
            if self.loop_config["eval_every"] or self.loop_config["final_eval"]:
                await self._evaluate()
        finally:
            await self.backend.close()
        summary = {"steps": self.trained_steps, "dropped": self.counters.dropped, "skipped": self.counters.skipped,
                   "launched": self.counters.launched}
        self.run.event("finished", **summary)
        return summary

    # -- groups ----------------------------------------------------------------------------------------------------
    def _next_group(self) -> Group:
        if not self._family_cycle:
            self._family_cycle = list(self.train_families)
            self.rng.shuffle(self._family_cycle)
        family = self._family_cycle.pop()
        index = self.counters.launched
        self.counters.launched += 1
        level = self.level if self.level in family.levels else family.default_level
        return Group(id=f"g{index:04d}", family=family.name, level=level)

    def _family(self, name: str):
        return next(f for f in self.train_families + self.held_out if f.name == name)

    async def _play_group(self, group: Group, eval_step: int | None = None) -> Group:
        family = self._family(group.family)
        episodes = [Episode(self.context, family, group.level, f"{group.id}-e{i}", step=self.trained_steps,
                            group_id=group.id) for i in range(self._group_size(eval_step))]
        self._report()
        results = await asyncio.gather(*(self._watched(e.play(self.policy)) for e in episodes))
        group.results = list(results)
        return group

    def _group_size(self, eval_step: int | None) -> int:
        return self.loop_config["eval_episodes"] if eval_step is not None else self.loop_config["group_size"]

    async def _watched(self, coroutine) -> EpisodeResult:
        self.counters.in_flight += 1
        self._report()
        try:
            result = await coroutine
        finally:
            self.counters.in_flight -= 1
        if result.status in ("done", "dead"):
            self.counters.jobs[result.status] += 1
        self._report()
        return result

    def _accept(self, group: Group) -> None:
        lag = staleness(self.policy.policy_version, group.policy_version)
        if lag > self.loop_config["max_steps_off_policy"]:
            self.counters.dropped += 1
            self.run.event("group_dropped", group=group.id, lag=lag)
        elif max(group.rewards) - min(group.rewards) <= 1e-9:
            self.counters.skipped += 1
            self.run.event("group_skipped", group=group.id, reward=group.rewards[0])
        else:
            self.buffer.append(group)
        self._report()

    async def _train_step(self, groups: list[Group]) -> None:
        started = time.monotonic()
        batch = [[(list(r.turns), r.reward) for r in g.results] for g in groups]
        metrics = await self.policy.update(batch)
        self.trained_steps += 1
        self.policy.save_state(self.run.dir / "policy")
        results = [r for g in groups for r in g.results]
        components: dict[str, float] = {}
        for r in results:
            for k, v in r.components.items():
                components[k] = components.get(k, 0.0) + v / len(results)
        self.run.event("outer_step", step=self.trained_steps, groups=[g.id for g in groups],
                       policy_version=self.policy.policy_version, seconds=time.monotonic() - started,
                       mean_reward=sum(r.reward for r in results) / len(results), components=components,
                       dropped=self.counters.dropped, skipped=self.counters.skipped, metrics=metrics,
                       base_choices=[_base_choice(r) for r in results])
        self._report(last_reward=sum(r.reward for r in results) / len(results), components=components)

    async def _evaluate(self) -> None:
        step = self.trained_steps
        families = self.held_out + self.train_families
        groups = [Group(id=f"eval{step}-{f.name}", family=f.name,
                        level=self.level if self.level in f.levels else f.default_level) for f in families]
        played = await asyncio.gather(*(self._play_group(g, eval_step=step) for g in groups))
        for group in played:
            family = self._family(group.family)
            trained = [r.train for r in group.results if r.train]
            self.run.event("eval", step=step, family=group.family, held_out=family.held_out,
                           mean_reward=sum(group.rewards) / len(group.rewards),
                           post=[t.post for t in trained], pre=[t.pre for t in trained],
                           uplift=[t.uplift for t in trained], base_choices=[_base_choice(r) for r in group.results])

    # -- resume ----------------------------------------------------------------------------------------------------
    def _resume(self) -> set[asyncio.Task]:
        """Restore the policy and the counters, rebuild finished groups, and finish or replay unfinished episodes."""
        policy_dir = self.run.dir / "policy"
        if any(policy_dir.glob("*")):
            self.policy.load_state(policy_dir)
        consumed: set[str] = set()
        for event in self.run.events():
            if event["kind"] == "outer_step":
                self.trained_steps = max(self.trained_steps, event["data"]["step"])
                consumed.update(event["data"]["groups"])
            elif event["kind"] in ("group_dropped", "group_skipped"):
                consumed.add(event["data"]["group"])
        by_group: dict[str, list[dict]] = {}
        for row in self.run.episodes():
            if row["group_id"] and not row["group_id"].startswith("eval"):
                by_group.setdefault(row["group_id"], []).append(row)
        self.counters.launched = len(by_group)
        tasks: set[asyncio.Task] = set()
        for group_id, rows in sorted(by_group.items()):
            if group_id in consumed:
                continue
            group = Group(id=group_id, family=rows[0]["family"], level=rows[0]["level"])
            tasks.add(asyncio.ensure_future(self._resume_group(group, rows)))
        self.run.event("resumed", trained_steps=self.trained_steps, groups_in_progress=len(tasks))
        return tasks

    async def _resume_group(self, group: Group, rows: list[dict]) -> Group:
        family = self._family(group.family)
        ids = sorted({r["id"] for r in rows} | {f"{group.id}-e{i}" for i in range(self.loop_config["group_size"])})
        by_id = {r["id"]: r for r in rows}

        async def one(episode_id: str) -> EpisodeResult:
            episode = Episode(self.context, family, group.level, episode_id, step=self.trained_steps,
                              group_id=group.id)
            row = by_id.get(episode_id)
            if row is not None and row["status"] in FINISHED:
                return _from_ledger(row)
            if row is not None and row["status"] == "training":
                return await episode.resume()
            return await episode.play(self.policy)

        group.results = list(await asyncio.gather(*(self._watched(one(i)) for i in ids)))
        return group

    def _report(self, **fields: Any) -> None:
        if self.progress is not None:
            self.progress.update(self, **fields)


def _from_ledger(row: dict) -> EpisodeResult:
    from aitrainsai.rewards import EpisodeRecord
    from aitrainsai.trainers import TrainResult

    data = row["data"]
    train = TrainResult.model_validate(data["train"]) if data.get("train") else None
    return EpisodeResult(row["id"], row["family"], row["reward"], data.get("components", {}),
                         EpisodeRecord.model_validate(data["record"]),
                         [AgentTurn.model_validate(t) for t in data.get("turns", [])], train, row["status"])


def _base_choice(result: EpisodeResult) -> dict[str, Any]:
    record = result.record
    scores = record.baseline_scores
    best = max(scores, key=scores.get) if scores else None
    return {"family": result.family, "base": record.base_model, "best_untrained": best,
            "picked_best": record.base_model is not None and best is not None and scores[record.base_model] >= scores[best]}


def run_loop(run: "Run", plugins: "Plugins", resolved: dict[str, Any], *, console: Any = None,
             resume: bool = False) -> dict[str, Any]:
    """Run (or resume) the nested loop with a live progress display; mark the run finished or failed."""
    from aitrainsai.progress import LoopProgress

    progress = LoopProgress(console, resolved)
    loop = NestedLoop(run, plugins, resolved, progress=progress)
    with run.hold():
        run.set_status("running")
        try:
            with progress:
                summary = asyncio.run(loop.run_loop(resume=resume))
        except BaseException:
            run.set_status("failed")
            raise
        run.set_status("finished")
    return summary
