"""Reward components: pure functions of a finished episode, combined with weights by a reward spec."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.components import Component, ComponentConfig


class ProbeAttempt(BaseModel):
    """One ``submit_job`` of an episode: its number, whether the probe accepted the job, and the problems it named."""

    model_config = ConfigDict(extra="forbid")

    attempt: int
    ok: bool
    problems: list[str] = Field(default_factory=list)


class EpisodeOutcome(BaseModel):
    """What a reward is computed from: the probe attempts, and the training outcome of the accepted job."""

    model_config = ConfigDict(extra="forbid")

    family: str
    level: int
    parsed_submission: bool = Field(description="the agent made at least one parseable submit_job call")
    attempts: list[ProbeAttempt] = Field(default_factory=list)
    max_attempts: int = 3
    job_status: Literal["none", "done", "dead", "infra"] = Field("none", description=(
        "infra: the job died of the infrastructure (the machine, the backend), not of anything the agent wrote"))
    base_model: str | None = None
    baseline_scores: dict[str, float] = Field(default_factory=dict, description="untrained score per allowed base")
    pre: float | None = None
    post: float | None = None
    train_seconds: float | None = None
    train_budget_seconds: float = 1_800.0
    train_work: float | None = None
    train_work_budget: float | None = Field(None, description="the task's max_train_tokens, where it has one")

    @property
    def first_valid_attempt(self) -> int | None:
        """1-based number of the first accepted attempt, or None."""
        return next((a.attempt for a in self.attempts if a.ok), None)

    @property
    def best_pre(self) -> float | None:
        return max(self.baseline_scores.values()) if self.baseline_scores else self.pre


class RewardComponent(Component, ABC):
    """``__init__(self, config)``; :meth:`score` must be pure: the same outcome always gives the same float."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.Config()

    @abstractmethod
    def score(self, episode: EpisodeOutcome) -> float:
        """The component's value for a finished episode."""

    @abstractmethod
    def explain(self) -> str:
        """One or two sentences for the agent: how this component is computed, with the configured numbers."""
