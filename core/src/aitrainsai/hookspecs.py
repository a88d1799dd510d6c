"""The hooks an aitrainsai plugin implements; these docstrings are the reference documentation.

A plugin is a module named by an entry point in the ``aitrainsai`` group. It implements any of the hooks below with
``@aitrainsai.hookimpl``. Each ``register_*`` hook receives a ``register`` callable; call it once per component class.
A component class carries a unique ``name`` and, where it takes options, a pydantic ``Config`` model; keep the
plugin module light and import heavy dependencies (torch, SDKs) inside the component's methods.
"""

from typing import Any
from collections.abc import Callable

import click
from pluggy import HookimplMarker, HookspecMarker

hookspec = HookspecMarker("aitrainsai")
hookimpl = HookimplMarker("aitrainsai")


@hookspec
def register_task_families(register: Callable[[type[Any]], None]) -> None:
    """Register task families: ``register(MyFamily)`` with a subclass of :class:`aitrainsai.TaskFamily`.

    A family defines what the outer agent is asked to teach: its task spec, a seeded generator, tools, a hidden eval
    set, an overlap check, a scorer and a reference solver. A family whose ``held_out`` is true is only evaluated,
    never trained on.
    """


@hookspec
def register_reward_components(register: Callable[[type[Any]], None]) -> None:
    """Register reward components: ``register(MyComponent)`` with a subclass of
    :class:`aitrainsai.RewardComponent`.

    A component is a pure function of a finished :class:`aitrainsai.EpisodeOutcome` returning a float. Reward
    specs (``reward_specs/*.toml``) name components and weight them; a component also describes itself in words, and
    that text is what the agent is told.
    """


@hookspec
def register_gpu_backends(register: Callable[[type[Any]], None]) -> None:
    """Register GPU backends: ``register(MyBackend)`` with a subclass of :class:`aitrainsai.GpuBackend`.

    A backend runs :class:`aitrainsai.JobPayload` objects somewhere (a local process pool, pods reached over
    SSH, a Ray cluster) and reports each as done or dead, with its cost, wall time and log tail. It may take minutes
    to start a worker and may lose one mid-job; it never decides rewards.
    """


@hookspec
def register_inner_trainers(register: Callable[[type[Any]], None]) -> None:
    """Register inner trainers: ``register(MyTrainer)`` with a subclass of :class:`aitrainsai.InnerTrainer`.

    An inner trainer owns the schema of a job's trainer config, the base models it offers, its part of the validation
    probe, how a job turns into a backend payload, and how a finished payload's outputs turn into pre/post scores.
    """


@hookspec
def register_outer_trainers(register: Callable[[type[Any]], None]) -> None:
    """Register outer trainers: ``register(MyTrainer)`` with a subclass of :class:`aitrainsai.OuterTrainer`.

    An outer trainer is the agent's policy and its update rule: it samples agent turns (with the log-probs it sampled
    them at), trains on groups of scored episodes, and saves and restores its state for resume.
    """


@hookspec
def register_trackers(register: Callable[[type[Any]], None]) -> None:
    """Register experiment trackers: ``register(MyTracker)`` with a subclass of :class:`aitrainsai.Tracker`.

    A tracker receives the run's typed records as the run makes them (:mod:`aitrainsai.trackers`): the run's start,
    each outer step with its update's metrics, each finished episode and trained job, each evaluation, the end. The
    run config's ``trackers`` list selects any number; ``[tracker.NAME]`` holds one's options. A tracker is fed from
    the ledger on a thread of its own: one that fails is named once in the log and never stops or changes the run.
    """


@hookspec
def register_presets(register: Callable[[str, Any], None]) -> None:
    """Register run-config presets: ``register(name, path)`` with the path of a TOML run config the distribution
    ships (package data). ``aitrainsai run --preset NAME`` starts from it; a preset named ``default`` is what every
    run starts from, so the distribution that ships it chooses the default components (the core names none).
    A top-level ``about`` string describes the preset in ``aitrainsai presets``.
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add commands to the ``aitrainsai`` command line: ``cli`` is the root :class:`click.Group`.

    Example: ``@cli.command() def hello(): click.echo("hi")``.
    """
