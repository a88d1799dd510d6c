"""Inner trainers (train the small model a job describes) and outer trainers (the agent's policy and its update)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.backends import JobPayload, JobResult
from aitrainsai.components import Component, ComponentConfig
from aitrainsai.families import Constraints, TaskSpec


class Problem(BaseModel):
    """One thing wrong with a job: where, and what to change."""

    model_config = ConfigDict(extra="forbid")

    file: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


class TrainResult(BaseModel):
    """The hidden-eval outcome of a trained job."""

    model_config = ConfigDict(extra="forbid")

    base_model: str
    pre: float
    post: float
    uplift: float
    uplift_ci: tuple[float, float]
    eval_size: int
    train_seconds: float
    metrics: dict[str, Any] = Field(default_factory=dict)


class InnerTrainer(Component, ABC):
    """Owns a job's trainer config schema (``Config``), its base models, its part of the probe, the payload, and
    reading the payload's outputs back."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig
    base_models: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.Config()

    def constraints(self, defaults: Constraints) -> Constraints:
        """The family's constraints with this trainer's base models filled in."""
        return defaults.model_copy(update={"allowed_bases": list(self.base_models)})

    @abstractmethod
    def probe(self, job_dir: Path, spec: TaskSpec) -> list[Problem]:
        """This trainer's static checks of a job directory (config schema, budget). Empty means acceptable."""

    @abstractmethod
    def payload(self, job_dir: Path, spec: TaskSpec, job_id: str) -> JobPayload:
        """The backend payload that trains the job and runs the hidden eval before and after."""

    @abstractmethod
    def result(self, outcome: JobResult) -> TrainResult:
        """Read a finished payload's outputs."""


class AgentTurn(BaseModel):
    """One sampled agent message and what the trainer needs to learn from it."""

    model_config = ConfigDict(extra="forbid")

    message: dict[str, Any]
    prompt_tokens: list[int] = Field(default_factory=list)
    completion_tokens: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list, description="the sampler's log-prob of each completion token")
    policy_version: int = 0


class OuterTrainer(Component, ABC):
    """The agent's policy. ``__init__(self, config, *, state_dir)``."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig, *, state_dir: Path):
        self.config = config
        self.state_dir = Path(state_dir)

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Increases by one with every update."""

    @abstractmethod
    async def sample(self, messages: list[dict[str, Any]], tools: list[dict]) -> AgentTurn:
        """The next agent message (text and/or OpenAI tool calls) for a conversation."""

    @abstractmethod
    async def update(self, groups: list[list[tuple[list[AgentTurn], float]]]) -> dict[str, float]:
        """One update on groups of episodes, each a (turns, reward) pair; returns metrics."""

    @abstractmethod
    def save_state(self, path: Path) -> None:
        """Write everything needed to resume."""

    @abstractmethod
    def load_state(self, path: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
