"""``job.json``, what a prime-rl payload's driver is told: :class:`JobSpec`, a training (:class:`TrainSpec`) or an
evaluation (:class:`EvalSpec`) by its ``mode``. The trainer writes it with ``model_dump_json()``
(:mod:`aitrainsai_trainer_prime_rl.inner`), the driver reads it with :func:`read_spec`
(:mod:`aitrainsai_trainer_prime_rl.job`). Paths are relative to the folder of ``job.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

import aitrainsai
from aitrainsai import EngineSpec, Message

from aitrainsai_trainer_prime_rl.pins import Stack


class WorkerSpec(BaseModel):
    """What both drivers need to find or install prime-rl on the worker."""

    model_config = ConfigDict(extra="forbid")

    stack: Stack = Field(description="the pinned prime-rl release or commit")
    source: str = Field(description="where prime-rl is cloned from")
    uv: str = Field(description="the uv executable (installed with pip when missing)")


class TrainSpec(WorkerSpec):
    """Train the job's environment package with prime-rl on the ``rl_toml`` this trainer generated."""

    mode: Literal["train"] = "train"
    env_id: str = Field(description="the job's environment package's name")
    package: str = Field(description="the folder of the job's environment package")
    wheels: str = Field(description="a folder of wheels the package depends on (the core's)")
    rl_toml: str
    steps: int = Field(ge=1)
    gpus: int = Field(ge=0)
    wall_s: int = Field(ge=1, description="the training wall-clock limit")
    launcher: list[str] = Field(default_factory=list, description="a stand-in for prime-rl's rl (tests)")


class Conversation(BaseModel):
    """One hidden item's opening messages and its tool world (never its answer)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[Message]
    world: dict[str, Any]


class EvalSpec(WorkerSpec):
    """Play the hidden eval's conversations through vLLM serving ``base_model`` (and ``checkpoint``, if any)."""

    mode: Literal["eval"] = "eval"
    base_model: str
    checkpoint: str | None = Field(description="the adapter folder that travelled with the payload")
    conversations: list[Conversation]
    schemas: list[dict[str, Any]] = Field(description="the family's tool schemas")
    turn_limit: int = Field(ge=1)
    public: str = Field(description="the folder of the family's public modules")
    tools_module: str = Field(description="the public module whose TOOLS are the family's tools")
    tool_names: list[str]
    engine: EngineSpec
    tool_parser: str = Field("hermes", pattern=r"^[a-z0-9_]+$", description="vLLM's tool-call parser for the base "
                                                                            "(Qwen3: hermes; Qwen3.5: qwen3_coder)")
    max_model_len: int = Field(ge=1)
    gpu_memory: float = Field(gt=0, le=1)
    server: list[str] = Field(default_factory=list, description="a stand-in for 'vllm serve' (tests)")
    ready_s: float = Field(1800.0, gt=0, description="how long vLLM may take to start")


class JobSpec(RootModel[Annotated[TrainSpec | EvalSpec, Field(discriminator="mode")]]):
    """``job.json``: one of the two, by ``mode``."""


def read_spec(path: Path) -> TrainSpec | EvalSpec:
    """``path`` as a :class:`JobSpec`, or a :class:`~aitrainsai.SpecError` naming the first problem and where it is."""
    return aitrainsai.read_spec(path, JobSpec, "a prime-rl trainer's job spec").root
