"""The composition root: a resolved config, the loaded plugins and a run become the parts that play episodes.

Everything that runs episodes (the nested loop, ``aitrainsai job run``, the tests) builds them here and nowhere
else: the GPU backend, the inner trainer, the outer trainer (only when asked for: a single job trains no agent), the
reward spec, the baseline cache, the task families and the paths a job must never see. ::

    session = Session(resolve(load_config(presets=plugins.presets), plugins), plugins, run)
    async with session:  # starts the backend (and the outer trainer, if one was used), closes both after
        result = await session.episode("calc_chain", level=1, episode_id="e0").play(session.outer_trainer)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitrainsai.config import ResolvedConfig
from aitrainsai.run.baseline import Baselines
from aitrainsai.jobs.probe import SharedVerdicts
from aitrainsai.run.episode import Episode, EpisodeContext
from aitrainsai.run.record import BackendEvent
from aitrainsai.isolation.view import hidden_paths
from aitrainsai.plugins import SELECTION_VARIABLE, VERSIONS_VARIABLE

if TYPE_CHECKING:
    from aitrainsai.backends import GpuBackend
    from aitrainsai.families import TaskFamily
    from aitrainsai.run.ledger import Run
    from aitrainsai.plugins import Plugins
    from aitrainsai.reward_spec import RewardSpec
    from aitrainsai.trackers import Tracker
    from aitrainsai.trainers import InnerTrainer, OuterTrainer


class Session:
    """The parts of one run, each built once from ``config`` (see the module docstring)."""

    def __init__(self, config: ResolvedConfig, plugins: Plugins, run: Run):
        from aitrainsai.reward_spec import load_reward_spec

        self.config = config
        self.plugins = plugins
        self.run = run
        self.reward_spec: RewardSpec = load_reward_spec(config.reward_spec, plugins)
        chosen = config.gpu_backend
        self.backend: GpuBackend = plugins.gpu_backends.create(chosen.use, chosen.config, workdir=run.dir / "backend")
        self.backend.record = lambda kind, **data: run.record(BackendEvent.of(kind, **data))
        chosen = config.inner_trainer
        self.inner_trainer: InnerTrainer = plugins.inner_trainers.create(chosen.use, chosen.config)
        self.hidden: list[Path] = hidden_paths(run.ledger.runs_dir)
        # payload processes load the plugins this run loaded, at the versions it loaded, whatever their own
        # environment says (each payload only those its runtime names: aitrainsai.plugins.with_env)
        self.payload_env = {SELECTION_VARIABLE: plugins.selection_string(),
                            VERSIONS_VARIABLE: plugins.versions_string()}
        self.baselines = Baselines(run.ledger, self.inner_trainer, self.backend, run.dir / "baselines",
                                   payload_env=self.payload_env)
        self.context = EpisodeContext(run=run, trainer=self.inner_trainer, backend=self.backend,
                                      reward_spec=self.reward_spec, baselines=self.baselines, hide=self.hidden,
                                      max_agent_turns=config.loop.max_agent_turns, payload_env=self.payload_env,
                                      task_view=config.loop.task_view, train_jobs=config.loop.train_jobs,
                                      share_identical_jobs=config.loop.share_identical_jobs,
                                      probes=SharedVerdicts() if config.loop.share_identical_probes else None,
                                      job_format=config.families.job_format,
                                      job_formats=dict(config.families.job_formats))
        self._families: dict[str, TaskFamily] = {}
        self._outer: OuterTrainer | None = None

    def trackers(self) -> dict[str, Callable[[], Tracker]]:
        """The run's trackers (``trackers`` in the config), each as what makes it: the tracking thread makes them, so
        that one whose construction fails is one more tracker that failed (:mod:`aitrainsai.run.tracking`)."""
        return {name: functools.partial(self.plugins.trackers.create, name, options, run_dir=self.run.dir)
                for name, options in self.config.trackers.items()}

    @staticmethod
    def check(config: ResolvedConfig, plugins: Plugins) -> None:
        """What a session would refuse, checked before a run exists (or resumes): the reward spec
        (``RewardSpecError``), what the GPU backend's and the outer trainer's ``preflight`` say, then what the outer
        trainer's service would refuse (``service_problems``), then each tracker's ``preflight`` (``ConfigError``,
        the first line)."""
        from aitrainsai.config import ConfigError
        from aitrainsai.reward_spec import load_reward_spec

        load_reward_spec(config.reward_spec, plugins)
        backend = config.gpu_backend
        problems = plugins.gpu_backends.get(backend.use).preflight(backend.config)
        if problems:
            raise ConfigError([(f"gpu_backend.{backend.use}", problems[0])])
        chosen = config.outer_trainer
        if chosen is not None:
            trainer = plugins.outer_trainers.get(chosen.use)
            problems = trainer.preflight(chosen.config) or trainer.service_problems(chosen.config)
            if problems:
                raise ConfigError([(f"outer_trainer.{chosen.use}", problems[0])])
        for name, options in config.trackers.items():
            problems = plugins.trackers.get(name).preflight(options)
            if problems:
                raise ConfigError([(f"tracker.{name}", problems[0])])

    # -- parts -----------------------------------------------------------------------------------------------------
    @property
    def outer_trainer(self) -> OuterTrainer:
        """The agent's policy, created on first use (its state lives in the run's ``policy/`` folder)."""
        if self._outer is None:
            chosen = self.config.outer_trainer
            if chosen is None:
                raise RuntimeError("this session was resolved without an outer trainer (resolve(..., outer=True))")
            self._outer = self.plugins.outer_trainers.create(chosen.use, chosen.config,
                                                             state_dir=self.run.dir / "policy")
        return self._outer

    def family(self, name: str) -> TaskFamily:
        """The task family ``name``, with its options from the config (one instance per session)."""
        if name not in self._families:
            options = self.config.families.options.get(name)
            self._families[name] = self.plugins.task_families.create(name, options)
        return self._families[name]

    @cached_property
    def train_families(self) -> list[TaskFamily]:
        return [self.family(name) for name in self.config.families.train]

    @cached_property
    def held_out_families(self) -> list[TaskFamily]:
        return [self.family(name) for name in self.config.families.held_out]

    def level(self, family: TaskFamily) -> int:
        """The configured level where the family has it, else the family's default."""
        level = self.config.families.level
        return level if level in family.levels else family.default_level

    def episode(self, family: TaskFamily | str, level: int | None, episode_id: str, *, step: int | None = 0,
                group_id: str | None = None) -> Episode:
        family = self.family(family) if isinstance(family, str) else family
        return Episode(self.context, family, self.level(family) if level is None else level, episode_id, step=step,
                       group_id=group_id)

    # -- lifetime --------------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Session:
        try:
            await self.backend.start()
        except BaseException:  # a start that failed or was stopped (SIGTERM) may have started something: close it
            await self.backend.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """Close the outer trainer and the backend side by side (a stop is bounded: one slow close must not hold up
        the other, which may be what stops the billing); the first error of either is raised after both ended."""
        import asyncio

        closes = [self.backend.close()] + ([self._outer.close()] if self._outer is not None else [])
        errors = [r for r in await asyncio.gather(*closes, return_exceptions=True) if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
