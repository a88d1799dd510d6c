"""GPU backends: where a job's payload runs. A backend reports done or dead, cost and logs; it never decides rewards.

A :class:`JobPayload` travels: its ``workdir`` is everything a worker receives, its command runs inside the worker's
copy of it on the worker's own interpreter (``python``, :data:`PYTHON`), and nothing in it names a path outside it.
What the worker must have (a :class:`Runtime`, GPUs, memory, disk, shared memory) is part of the payload; a backend
that cannot meet it refuses the payload with a ``dead`` result of reason ``"infra"`` and one line saying why (from
:meth:`GpuBackend.wait`; ``submit`` raises only for a caller's mistake, such as one job id submitted twice at once).
Secrets travel in :attr:`JobPayload.secrets`, which no serialisation of a payload includes. Results come back as
named artifacts, fetched by the backend into local paths (:attr:`JobResult.artifacts`).

The orchestrator submits a payload, keeps the returned :class:`JobHandle` in the run ledger, and waits. After a
restart it may call :meth:`GpuBackend.wait` again with a handle from the ledger: a backend that can reattach (a pod
still running) does, and one that cannot reports the job dead with reason ``"lost"`` so that it is rerun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aitrainsai.components import Component, ComponentConfig
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    import asyncio

JobStatus = Literal["queued", "running", "done", "dead"]

PYTHON = "python"
"""A command whose first element is this runs on the worker's own Python interpreter (the backend maps it)."""

DeadReason = Literal["failed", "timeout", "oom", "lost", "infra", "budget", "cancelled", "artifact"]
"""Why a job is dead. ``failed``: it exited non-zero or by a signal of its own; ``timeout``: it ran past its
``timeout_s``; ``oom``: it was killed for memory; ``lost``: its worker vanished, or the backend cannot reattach to it
(the loop reruns it); ``infra``: the backend could not run it (refused requirements, a worker that would not start);
``budget``: the backend's spending limit; ``cancelled``: :meth:`GpuBackend.cancel`; ``artifact``: it finished but an
artifact is missing or unreadable. :attr:`JobResult.detail` says more, in words."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DISTRIBUTION = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


def relative_path(value: str, what: str) -> str:
    """``value`` as a normalised path inside a workdir; ``ValueError`` for an absolute path or one that climbs out."""
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or str(path) == ".":
        raise ValueError(f"{what} {value!r} is not a path inside the workdir (relative, without '..')")
    return str(path)


class BackendUnavailable(RuntimeError, AitrainsaiError):
    """A backend cannot start or reach its workers (a cluster that does not answer, an account with no capacity at
    all). The message is one line; the CLI shows it as such and the run can be resumed once the cause is fixed."""


class Runtime(BaseModel):
    """The software a worker must have: distributions at compatible versions, or a container image (or both)."""

    model_config = ConfigDict(extra="forbid")

    distributions: dict[str, str] = Field(
        default_factory=dict, description="distribution name -> version specifier (PEP 440, e.g. '==0.1.0', '>=2.2'; "
                                          "'' for any version)")
    image: str | None = Field(None, description="a container image the payload runs in, e.g. 'org/trainer:1.2'")
    no_deps: list[str] = Field(default_factory=list, description="names among `distributions` a worker installs "
                                                                  "without their declared dependencies")

    @field_validator("distributions")
    @classmethod
    def _valid_specifiers(cls, value: dict[str, str]) -> dict[str, str]:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        for name, spec in value.items():
            if not _DISTRIBUTION.match(name):
                raise ValueError(f"{name!r} is not a distribution name")
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                raise ValueError(f"{name}: {spec!r} is not a version specifier (e.g. '==1.2', '>=2,<3')") from None
        return value

    @model_validator(mode="after")
    def _no_deps_are_distributions(self) -> Runtime:
        unknown = sorted(set(self.no_deps) - set(self.distributions))
        if unknown:
            raise ValueError(f"no_deps names {', '.join(unknown)}, which distributions does not")
        return self


class JobPayload(BaseModel):
    """What to run: a command inside a directory of files, what the worker must have, and the artifacts to fetch."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    workdir: Path = Field(description="the directory shipped to the worker, the payload's only files; the command runs "
                                      "inside the worker's copy of it")
    command: list[str] = Field(min_length=1, description=f"argv; a first element {PYTHON!r} is the worker's "
                                                         "interpreter; no element is an absolute path")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables (stored in the ledger)")
    secrets: dict[str, str] = Field(default_factory=dict, exclude=True, repr=False,
                                    description="environment variables never serialised or stored: API keys")
    artifacts: dict[str, str] = Field(default_factory=dict, description="name -> file or folder under workdir that "
                                                                        "the backend fetches once the job is done")
    timeout_s: float = Field(1_800.0, gt=0)
    expected_s: float | None = Field(None, description="estimated run time; backends start longer jobs first")
    runtime: Runtime = Field(default_factory=Runtime)
    gpus: int = Field(0, ge=0)
    gpu_type: str | None = Field(None, description="a GPU model the worker must have, e.g. 'H100' (matched as a "
                                                   "case-insensitive part of the device name); None: any")
    memory_gb: float | None = Field(None, gt=0, description="host memory the job needs")
    disk_gb: float | None = Field(None, gt=0, description="free disk the job needs next to its workdir")
    shm_gb: float | None = Field(None, gt=0, description="shared memory (/dev/shm) the job needs")

    @field_validator("command")
    @classmethod
    def _travels(cls, value: list[str]) -> list[str]:
        for part in value:
            if part.startswith("/"):
                raise ValueError(f"command element {part!r} is an absolute path; a payload runs on another machine: "
                                 f"start it with {PYTHON!r} or a program on the worker's PATH, and name its files "
                                 "relative to the workdir")
        return value

    @field_validator("artifacts")
    @classmethod
    def _artifact_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _NAME.match(name):
                raise ValueError(f"artifact name {name!r}: letters, digits, '_', '-' and '.', at most 64")
        return {name: relative_path(path, f"artifact {name}:") for name, path in value.items()}

    @model_validator(mode="after")
    def _no_secret_in_env(self) -> JobPayload:
        both = sorted(set(self.env) & set(self.secrets))
        if both:
            raise ValueError(f"{', '.join(both)} is both in env and in secrets")
        return self


class JobHandle(BaseModel):
    """A reference to a submitted payload that survives a restart (stored in the ledger; never holds a secret)."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    job_id: str
    data: dict[str, Any] = Field(default_factory=dict)


class JobResult(BaseModel):
    """How a payload ended."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    status: Literal["done", "dead"]
    reason: DeadReason | None = Field(None, description="why a dead job died; None when done")
    detail: str = Field("", description="in words: the exit code, the refused requirement, the missing artifact")
    exit_code: int | None = None
    wall_s: float = 0.0
    cost_usd: float = 0.0
    log_tail: str = ""
    artifacts: dict[str, Path] = Field(default_factory=dict, description="name -> local path of each fetched artifact")

    @model_validator(mode="after")
    def _reason_iff_dead(self) -> JobResult:
        if (self.status == "dead") != (self.reason is not None):
            raise ValueError("a dead result names its reason, a done one none")
        return self

    @classmethod
    def dead(cls, job_id: str, reason: DeadReason, detail: str, **fields: Any) -> JobResult:
        """A dead result: why (``reason``, ``detail`` in words) and any other field (``wall_s``, ``log_tail``...)."""
        return cls(job_id=job_id, status="dead", reason=reason, detail=detail, **fields)

    @property
    def why(self) -> str:
        """One line: the reason and its detail (empty when done)."""
        return f"{self.reason}: {self.detail}" if self.reason and self.detail else (self.reason or "")


REDACTED = "[secret]"


def blank_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` (a job's log tail) with every value of ``secrets`` replaced by ``[secret]``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


class GpuBackend(Component, ABC):
    """Runs payloads. ``__init__(self, config, *, workdir)``; ``workdir`` is the backend's state directory (the run's),
    the same after a restart, so that a new object reattaches to jobs an earlier one submitted."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig, *, workdir: Path):
        self.config = config
        self.workdir = Path(workdir)
        self.record: Callable[..., None] | None = None
        """Set by the session: ``record(kind, **data)`` writes an event ``backend_<kind>`` into the run's ledger at
        once (call it from the event loop's thread), for what must never be unknown to the run, such as a billed
        worker's id the moment it exists."""

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        """What this backend would refuse before a run exists (a missing API key, a tool it needs that is not
        installed), one line each. Checked by ``Session.check`` for new and resumed runs; must not contact a service
        or print a secret. Default: nothing."""
        return []

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
        """Queue ``payload``; return at once with a handle that lets a later process reattach."""

    @abstractmethod
    async def wait(self, handle: JobHandle) -> JobResult:
        """Wait for the payload to end. Never raises for a job's own failure, nor for a payload this backend cannot
        run (reason ``"infra"``): those are ``dead`` results."""

    @abstractmethod
    async def cancel(self, handle: JobHandle) -> None:
        """Stop the payload if it is queued or running; its ``wait`` then returns ``dead``, reason ``"cancelled"``."""

    def costs(self) -> dict[str, float]:
        """What the workers have cost so far beyond the jobs' own ``cost_usd``, where the backend knows: e.g.
        ``{"pool_usd": ..., "idle_usd": ...}`` for a pool that bills while it boots or waits. Recorded with every
        outer step and shown in the progress display and the report; empty (the default) shows nothing."""
        return {}

    async def run(self, payload: JobPayload) -> JobResult:
        return await self.wait(await self.submit(payload))


class TaskPerJob:
    """For a backend that follows each job in an asyncio task kept in ``_tasks`` (job id -> task): ``wait`` awaits
    that task, or, for a job an earlier process submitted, starts ``_reattach(handle)`` in its place. Mix it in
    before :class:`GpuBackend`. ``_cancelled`` holds the job ids :meth:`GpuBackend.cancel` was called for. A job's task
    starts with ``_follow_in_task`` (or ``_refuse``, settled at once); ``close`` ends them with ``_cancel_tasks``."""

    _tasks: dict[str, asyncio.Task[JobResult]]
    _cancelled: set[str]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tasks = {}
        self._cancelled = set()

    def _admit(self, job_id: str) -> None:
        """Before a submission: ``ValueError`` while ``job_id``'s earlier run has not ended; else forget its cancel."""
        earlier = self._tasks.get(job_id)
        if earlier is not None and not earlier.done():
            raise ValueError(f"job {job_id} was already submitted and has not ended")
        self._cancelled.discard(job_id)

    def _follow_in_task(self, job_id: str, work: Coroutine[Any, Any, JobResult]) -> None:
        """Run ``work`` (the job's life, to its result) as ``job_id``'s task, which ``wait`` awaits."""
        import asyncio

        self._tasks[job_id] = asyncio.ensure_future(work)

    def _note_cancel(self, job_id: str) -> bool:
        """At a cancel: note it, unless the job has ended already (then False: nothing to stop)."""
        task = self._tasks.get(job_id)
        if task is not None and task.done():
            return False
        self._cancelled.add(job_id)
        return True

    def _refuse(self, job_id: str, detail: str) -> None:
        """Settle ``job_id`` at once: dead, reason ``infra`` (a payload this backend cannot run never queues)."""

        async def refused() -> JobResult:
            return JobResult.dead(job_id, "infra", detail)

        self._follow_in_task(job_id, refused())

    def _cancel_tasks(self) -> list[asyncio.Task[JobResult]]:
        """At close: cancel every job's task that has not ended; returns those (their waiters get ``CancelledError``:
        the run is stopping, and a resumed run reattaches or reruns)."""
        running = [task for task in self._tasks.values() if not task.done()]
        for task in running:
            task.cancel()
        return running

    @abstractmethod
    async def _reattach(self, handle: JobHandle) -> JobResult:
        """Follow a job an earlier process submitted, from its handle, to its result."""

    async def wait(self, handle: JobHandle) -> JobResult:
        import asyncio

        task = self._tasks.get(handle.job_id)
        if task is None:  # submitted by an earlier process
            task = self._tasks[handle.job_id] = asyncio.ensure_future(self._reattach(handle))
        return await asyncio.shield(task)


class MissingArtifacts(AitrainsaiError):
    """A finished job's artifacts are missing, unreadable or refused (one line: which, and why): the job is dead,
    reason ``"artifact"``. A backend raises it where it fetches them and turns it into the job's result with
    :meth:`result`."""

    @classmethod
    def absent(cls, missing: Iterable[tuple[str, str]]) -> MissingArtifacts:
        """The artifacts the job did not leave, as (name, path) pairs."""
        return cls("finished without its artifacts: " + ", ".join(f"{name} ({path})" for name, path in missing))

    def result(self, job_id: str, **fields: Any) -> JobResult:
        """The job's dead result: reason ``artifact``, this error's line as the detail, and ``fields`` (``exit_code``,
        ``wall_s``, ``log_tail``...)."""
        return JobResult.dead(job_id, "artifact", str(self), **fields)


def place_artifact(source: Path, target: Path) -> Path:
    """Move a fetched artifact (a file or folder, checked already) from a scratch folder to ``target`` in the
    payload's workdir, replacing whatever is there; returns ``target``."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(target))
    return target


def append_journal(path: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` as a JSON line to ``path`` and flush it to disk before returning: a backend's journal of
    what must never be unknown to the run (a billed worker's id, a submission id), read back by
    :func:`read_journal`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The entries :func:`append_journal` wrote to ``path``, in order; a line cut by a kill, or one that is not an
    object, is skipped; a missing file has none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries
