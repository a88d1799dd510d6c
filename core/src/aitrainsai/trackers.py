"""Experiment trackers: the contract a tracker plugin implements, and every record a tracker receives.

A tracker (``register_trackers``) gets the run's typed records as the run makes them: the run's start, each outer
step (its policy update's metrics with it), each finished episode, each trained job, each evaluation, the end. The
core reads them from the run's ledger on a thread per tracker (:mod:`aitrainsai.run.tracking`), so a tracker never
stops, slows or changes a run, nor another tracker: one that raises (anything, ``SystemExit`` too) is named once in
the log and fed nothing more this run; one that hangs holds up only itself.

Every record but the start and the end is a point on one **axis** (``step``: outer steps; ``episode`` and ``job``:
finished episodes and trained jobs in the order they finished, from 1; ``eval/<family>``: the outer step whose
policy was evaluated). Along an axis ``x`` strictly increases, so ``(axis, x)`` names a point once: on resume the
core feeds only points it has not fed before, and a tracker whose store may hold a point the core did not see
written (a kill between the write and the core's cursor) drops or replaces it by ``(axis, x)``.
:meth:`Point.scalars` gives a point's numbers under stable names (``reward``, ``component/validation``, ...) for
trackers that log scalars; its typed fields carry the rest.

A point's numbers are finite or absent: a value that is inf, -inf or NaN (a reward, a score or an update may compute
one) becomes None (out of its dict or list) when the point is made, and :attr:`Point.nonfinite` names it
(``{"mean_reward": "inf", "components/validation": "nan"}``), so no tracker writes a token its format's strict reader
refuses. A run's config names such a value as the string ``"inf"``, ``"-inf"`` or ``"nan"``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aitrainsai.components import Component, ComponentConfig


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


NonFinite = Literal["inf", "-inf", "nan"]


def _nonfinite(value: Any) -> NonFinite | None:
    """What ``value`` is when it is a float that is not finite (None otherwise)."""
    if not isinstance(value, float) or math.isfinite(value):
        return None
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def _named(value: Any) -> Any:
    """``value`` (a config: dicts, lists, scalars) with each float that is not finite as its name."""
    if isinstance(value, dict):
        return {key: _named(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_named(item) for item in value]
    return _nonfinite(value) or value


class TrackedRun(_Frozen):
    """The run a tracker opens (``resumed``: reopens: it was tracked before, under the same ``run_id``)."""

    run_id: str
    name: str | None = None
    run_dir: Path
    config: dict[str, Any] = Field(default_factory=dict, description="the resolved config, as the ledger holds it")
    plugins: dict[str, str] = Field(default_factory=dict, description="distribution -> version")
    created_at: float = 0.0
    resumed: bool = False

    @field_validator("config", mode="before")
    @classmethod
    def _config_named(cls, config: Any) -> Any:
        return _named(config)


class Point(_Frozen):
    """A record on one axis. ``seq``: the ledger event it was read from (the core's cursor). Its numbers are finite
    or absent; ``nonfinite`` names each value that was not (see the module's doc)."""

    model_config = ConfigDict(allow_inf_nan=False)

    kind: str
    seq: int
    axis: str
    x: int
    at: float = Field(0.0, description="when the ledger recorded it (unix seconds)")
    nonfinite: dict[str, NonFinite] = Field(
        default_factory=dict, description="each value left out for not being finite, by field (``mean_reward``, "
                                          "``components/validation``, ``train_rewards/2``, ``uplift_ci/1``)")

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        """Each float that is not finite out: a field's value becomes None, a dict's or a list's item is dropped, an
        interval (a tuple) with such an end becomes None; each is named in ``nonfinite``."""
        if not isinstance(data, dict):
            return data
        given = data.get("nonfinite")
        named: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
        finite: dict[str, Any] = {"nonfinite": given} if given is not None else {}  # not a dict: refused next
        for field, value in data.items():
            if field == "nonfinite":
                continue
            if isinstance(value, dict):
                items = [(f"{field}/{key}", key, item) for key, item in value.items()]
            elif isinstance(value, list | tuple):
                items = [(f"{field}/{index}", index, item) for index, item in enumerate(value)]
            else:
                items = [(field, None, value)]
            bad = {name: kind for name, _, item in items if (kind := _nonfinite(item)) is not None}
            named |= bad
            if not bad:
                finite[field] = value
            elif isinstance(value, dict):
                finite[field] = {key: item for name, key, item in items if name not in bad}
            elif isinstance(value, list):
                finite[field] = [item for name, _, item in items if name not in bad]
            else:  # the value itself, or an interval missing an end
                finite[field] = None
        if named:
            finite["nonfinite"] = named
        return finite

    def scalars(self) -> dict[str, float]:
        """The point's numbers by name (all finite: absent values are left out)."""
        return {}


def _numbers(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    numbers = {}
    for key, value in values.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond a double
                continue
            if math.isfinite(number):
                numbers[f"{prefix}{key}"] = number
    return numbers


class StepPoint(Point):
    """One outer step: the agent's mean reward and its components, what its jobs did, the update's metrics."""

    kind: Literal["step"] = "step"
    axis: Literal["step"] = "step"
    mean_reward: float | None
    components: dict[str, float] = Field(default_factory=dict, description="mean per reward component")
    jobs_trained: int = 0
    mean_uplift: float | None = None
    cost_usd: float | None = 0.0
    seconds: float | None = 0.0
    policy_version: int = 0
    dropped: int = 0
    skipped: int = 0
    update: dict[str, float] = Field(default_factory=dict, description="the outer trainer's numeric metrics")

    def scalars(self) -> dict[str, float]:
        values = {"reward": self.mean_reward, "jobs_trained": self.jobs_trained, "cost_usd": self.cost_usd,
                  "seconds": self.seconds, "policy_version": self.policy_version, "groups_dropped": self.dropped,
                  "groups_skipped": self.skipped}
        if self.mean_uplift is not None:
            values["mean_uplift"] = self.mean_uplift
        return _numbers("", values) | _numbers("component/", self.components) | _numbers("update/", self.update)


class EpisodePoint(Point):
    """A finished episode (training or evaluation): what the agent got, and how its submissions went."""

    kind: Literal["episode"] = "episode"
    axis: Literal["episode"] = "episode"
    episode: str
    group: str | None = None
    family: str
    step: int | None = Field(None, description="the outer step whose policy sampled it")
    evaluation: bool = False
    status: str
    reward: float | None
    components: dict[str, float] = Field(default_factory=dict)
    attempts: int = 0
    accepted_attempt: int | None = None

    def scalars(self) -> dict[str, float]:
        return _numbers("", {"reward": self.reward, "attempts": self.attempts}) | _numbers("component/",
                                                                                             self.components)


class JobPoint(Point):
    """A trained job's outcome: the hidden eval before and after, the uplift and its 95% interval, the training
    reward per inner step, timings; a dead job has ``dead_reason`` and no scores."""

    kind: Literal["job"] = "job"
    axis: Literal["job"] = "job"
    job: str
    episode: str
    family: str
    status: Literal["done", "dead"]
    base_model: str | None = None
    pre: float | None = None
    post: float | None = None
    uplift: float | None = None
    uplift_ci: tuple[float, float] | None = None
    eval_size: int | None = None
    train_rewards: list[float] = Field(default_factory=list, description="mean reward per inner training step")
    train_seconds: float | None = None
    wall_seconds: float | None = None
    cost_usd: float | None = 0.0
    dead_reason: str | None = None

    def scalars(self) -> dict[str, float]:
        values: dict[str, Any] = {"pre": self.pre, "post": self.post, "uplift": self.uplift,
                                  "train_seconds": self.train_seconds, "wall_seconds": self.wall_seconds,
                                  "cost_usd": self.cost_usd, "dead": float(self.status == "dead")}
        if self.uplift_ci is not None:
            values |= {"uplift_low": self.uplift_ci[0], "uplift_high": self.uplift_ci[1]}
        if self.train_rewards:
            values |= {"train_reward_first": self.train_rewards[0], "train_reward_last": self.train_rewards[-1]}
        return _numbers("", values)


class EvalPoint(Point):
    """The policy of outer step ``x`` evaluated on one family, with no update (axis ``eval/<family>``)."""

    kind: Literal["eval"] = "eval"
    family: str
    held_out: bool
    mean_reward: float | None
    mean_uplift: float | None = None
    jobs: int = 0

    def scalars(self) -> dict[str, float]:
        values = {"reward": self.mean_reward, "jobs": self.jobs}
        if self.mean_uplift is not None:
            values["mean_uplift"] = self.mean_uplift
        return _numbers("", values)


AnyPoint = Annotated[StepPoint | EpisodePoint | JobPoint | EvalPoint, Field(discriminator="kind")]


class RunEnd(_Frozen):
    """How the run ended this time: ``finished``, or ``stopped`` (a signal, an error, no signal to train on)."""

    status: Literal["finished", "stopped"]
    reason: str | None = None
    steps: int = 0


class Tracker(Component, ABC):
    """Receives a run's records. ``__init__(self, config, *, run_dir)``: ``run_dir`` is the run's folder (a tracker
    that writes files keeps them under ``run_dir / "trackers" / name`` unless its options say where).

    Calls come from one thread, this tracker's own (the constructor too), in this order: :meth:`start` once,
    :meth:`log` with each batch of new points (oldest first), :meth:`finish` when the run ends (not when it is
    killed), :meth:`close` always last. Anything a call raises (``BaseException``: ``SystemExit`` too) turns the
    tracker off for the rest of the run; it never reaches the run. A call that does not return holds up this tracker
    only; at the end of the run it is left behind (named, never closed) once the run has waited its bound."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig | None = None, *, run_dir: Path):
        self.config = config if config is not None else self.Config()
        self.run_dir = Path(run_dir)

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        """What this tracker would refuse before a run exists (its library not installed, a bad option), one line
        each; must not contact a service. Default: nothing."""
        return []

    @abstractmethod
    def start(self, run: TrackedRun) -> None:
        """Open the tracked run ``run.run_id`` (reopen it when ``run.resumed``)."""

    @abstractmethod
    def log(self, points: list[StepPoint | EpisodePoint | JobPoint | EvalPoint]) -> None:
        """Record ``points``, oldest first; write them through before returning (the core moves
        its cursor past them next)."""

    def finish(self, end: RunEnd) -> None:
        """The run ended (finished or stopped); a killed run gets no call. Default: nothing."""

    def close(self) -> None:
        """Release files and connections; called once, last, also after an error. Default: nothing."""

    @property
    def folder(self) -> Path:
        """Where this tracker's own files go by default: ``run_dir/trackers/<name>``."""
        return self.run_dir / "trackers" / self.name

