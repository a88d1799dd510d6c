"""``job.json``, what a local payload's driver is told: :class:`JobSpec`, a training (:class:`TrainSpec`) or an
evaluation (:class:`EvalSpec`) by its ``mode``. The trainer writes it with ``model_dump_json()``
(:mod:`aitrainsai_trainer_local.inner`), the driver reads it with :func:`read_spec`
(:mod:`aitrainsai_trainer_local.job`). Paths are relative to the folder of ``job.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

import aitrainsai
from aitrainsai import Constraints
from aitrainsai_trainer_local.config import LocalTrainerConfig


class TrainSpec(BaseModel):
    """Train the frozen job in ``job_dir`` (checked against ``digest``, then against ``constraints``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["train"] = "train"
    family: str
    level: int
    job_dir: str = Field(description="the copy of the frozen job that travelled with the payload")
    digest: str = Field(description="the frozen job's content hash, as the probe accepted it")
    constraints: Constraints
    trainer: LocalTrainerConfig
    wall_s: int = Field(ge=1, description="the training wall-clock limit (the sandbox's too)")


class EvalSpec(BaseModel):
    """Score ``checkpoint`` (None: the untrained ``base_model``) on the family's hidden eval."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["eval"] = "eval"
    family: str
    distribution: str = Field(description="the installed distribution that ships the family: the driver loads it "
                                          "alone (aitrainsai.load_family)")
    level: int
    base_model: str
    checkpoint: str | None = Field(description="the adapter folder that travelled with the payload")
    eval_size: int = Field(ge=1)
    trainer: LocalTrainerConfig


class JobSpec(RootModel[Annotated[TrainSpec | EvalSpec, Field(discriminator="mode")]]):
    """``job.json``: one of the two, by ``mode``."""


def read_spec(path: Path) -> TrainSpec | EvalSpec:
    """``path`` as a :class:`JobSpec`, or a :class:`~aitrainsai.SpecError` naming the first problem and where it is."""
    return aitrainsai.read_spec(path, JobSpec, "a local trainer's job spec").root
