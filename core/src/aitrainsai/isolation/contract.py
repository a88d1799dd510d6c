"""The contract of a sandbox, as plain types: its limits, its result, what a strategy states it guarantees, and
the one error that says this machine cannot isolate agent code."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from aitrainsai.errors import AitrainsaiError

JOB_MOUNT = "/tmp/job"
OUT_MOUNT = "/tmp/out"
SIGNAL_BASE = 128
NOBODY = 65534
UID_BASE = 1_900_000_000  # per-sandbox uids: no file on a host belongs to them
UID_SLOTS = 10_000
SAFE_VARIABLES = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE",
                  "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES")
CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")  # PID 1's, as root, to drop to the uid and kill everything
STREAM_HEAD = 20_000
STREAM_TAIL = 200_000
CGROUP_PREFIX = "aitrainsai-"
MB = 2**20
NETWORKS = ("none", "loopback")
SHARED_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable folders a container shares
CPUS_VARIABLE = "AITRAINSAI_SANDBOX_CPUS"  # a backend sets it for its payloads: each sandbox's CPU share
MIN_CPUS = 0.5  # the least CPU share a backend gives a sandbox


def default_cpus() -> float | None:
    """The CPU share (cores) of a sandbox whose limits name none: ``AITRAINSAI_SANDBOX_CPUS`` (cores; ``none``: no
    cap), which a backend sets for its payloads from its slots; unset (the orchestrator's own sandboxes, such as the
    probe's), half of this process's cores, at least :data:`MIN_CPUS`."""
    value = os.environ.get(CPUS_VARIABLE, "").strip().lower()
    if not value:
        return max(MIN_CPUS, len(os.sched_getaffinity(0)) / 2)
    if value == "none":
        return None
    try:
        cpus = float(value)
    except ValueError:
        cpus = math.nan
    if not (math.isfinite(cpus) and cpus > 0):
        raise ValueError(f"{CPUS_VARIABLE}={os.environ[CPUS_VARIABLE][:40]!r} is not a CPU share: give a number of "
                         "cores above 0 (such as 0.5 or 2), or none for no cap")
    return cpus


class SandboxUnavailable(RuntimeError, AitrainsaiError):
    """This machine cannot isolate agent code by the chosen strategy (no bubblewrap, namespaces forbidden, not root
    in a container, a path it must hide is readable, an unknown strategy)."""


@dataclass
class Limits:
    """Per sandbox. ``shm_mb``: the size of ``/dev/shm`` (data loaders' workers pass tensors through it; a memory
    cgroup counts its pages). ``network``: ``none`` (no network; under namespaces as root its own loopback is down
    too) or ``loopback`` (its own loopback up, for a trainer and an inference server it runs in the same sandbox; the
    host's loopback stays out of reach). The memory limit is a cgroup's where one can be made; else an address-space
    limit per process, never with a GPU (CUDA reserves far more address space than it uses). ``cpus``: the cores'
    worth of CPU time the whole sandbox may use (a CPU cgroup's quota, every process and thread together; None: no
    cap); by default :func:`default_cpus`. Where no CPU cgroup can be made it is not enforced, and the sandbox's
    processes run at a lower priority (nice) instead. ``cpu_s`` is each process's own CPU time limit."""

    wall_s: float = 120.0
    cpu_s: int = 120
    memory_mb: int = 4_096
    file_size_mb: int = 64
    processes: int = 256
    open_files: int = 256
    tmp_mb: int = 128
    out_mb: int = 256
    out_files: int = 2_000
    shm_mb: int = 256
    network: Literal["none", "loopback"] = "none"
    cpus: float | None = field(default_factory=default_cpus)


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    out_of_memory: bool = False
    exported: list[str] = field(default_factory=list)
    export_problems: list[str] = field(default_factory=list)
    cpu_used_s: float | None = None  # CPU seconds of all its processes, from its CPU cgroup (None: none was made)

    @property
    def reason(self) -> str:
        """Why the command failed, in words, or '' when it exited 0."""
        if self.timed_out:
            return "ran out of wall-clock time"
        if self.out_of_memory:
            return "out of memory (the sandbox's memory limit)"
        if self.returncode == 0:
            return ""
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            extra = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: memory or time)",
                     "SIGXFSZ": " (file size limit)", "SIGSEGV": " (crashed)"}.get(name, "")
            return f"killed by {name}{extra}"
        if "MemoryError" in self.stderr[-2000:]:
            return f"exit code {self.returncode} (out of memory)"
        return f"exit code {self.returncode}"



# -- isolation strategies -------------------------------------------------------------------------------------------
class IsolationStatement(BaseModel):
    """What a strategy guarantees on this machine, and what it does not, in plain words."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str
    guarantees: tuple[str, ...]
    not_guaranteed: tuple[str, ...]

    def text(self) -> str:
        return "\n".join([f"isolation: {self.strategy}", "guarantees:", *(f"  - {g}" for g in self.guarantees),
                          "does not guarantee:", *(f"  - {n}" for n in self.not_guaranteed)])
