"""GPU backends: where a job's payload runs. A backend reports done or dead, cost and logs; it never decides rewards.

The orchestrator submits a :class:`JobPayload`, keeps the returned :class:`JobHandle` in the run ledger, and waits.
After a restart it may call :meth:`GpuBackend.wait` again with a handle from the ledger: a backend that can reattach
(a pod still running) does, and one that cannot reports the job dead with reason ``"lost"`` so that it is rerun.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai.components import Component, ComponentConfig

JobStatus = Literal["queued", "running", "done", "dead"]


class JobPayload(BaseModel):
    """What to run: a command in a directory of files, with the outputs to bring back."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    workdir: Path = Field(description="directory shipped to the worker; the command runs inside it")
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    outputs: list[str] = Field(default_factory=list, description="paths under workdir to bring back")
    timeout_s: float = 1_800.0
    expected_s: float | None = Field(None, description="estimated run time; backends start longer jobs first")
    gpus: int = 0
    memory_gb: float | None = None


class JobHandle(BaseModel):
    """A reference to a submitted payload that survives a restart (stored in the ledger)."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    job_id: str
    data: dict[str, Any] = Field(default_factory=dict)


class JobResult(BaseModel):
    """How a payload ended."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    status: Literal["done", "dead"]
    reason: str = ""
    exit_code: int | None = None
    wall_s: float = 0.0
    cost_usd: float = 0.0
    log_tail: str = ""
    output_dir: Path | None = None


class GpuBackend(Component, ABC):
    """Runs payloads. ``__init__(self, config, *, workdir)``; ``workdir`` is the run's directory for local state."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig, *, workdir: Path):
        self.config = config
        self.workdir = Path(workdir)

    @property
    @abstractmethod
    def capacity(self) -> int:
        """How many payloads can run at once."""

    async def start(self) -> None:
        """Acquire workers (boot pods, connect to a cluster). May take minutes; called once before submitting."""

    async def close(self) -> None:
        """Release workers. Called once at the end of a run, also after errors."""

    @abstractmethod
    async def submit(self, payload: JobPayload) -> JobHandle:
        """Queue ``payload``; return at once with a handle."""

    @abstractmethod
    async def wait(self, handle: JobHandle) -> JobResult:
        """Wait for the payload to end. Never raises for a job's own failure: that is a ``dead`` result."""

    @abstractmethod
    async def cancel(self, handle: JobHandle) -> None:
        """Stop the payload if it is queued or running."""

    async def run(self, payload: JobPayload) -> JobResult:
        return await self.wait(await self.submit(payload))
