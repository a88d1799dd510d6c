"""The local backend: payloads run as subprocesses of this machine, a few at a time. The default GPU backend."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from aitrainsai import hookimpl
from aitrainsai.backends import (PYTHON, DeadReason, GpuBackend, JobHandle, JobPayload, JobResult, MissingArtifacts,
                                 TaskPerJob, blank_secrets)
from aitrainsai.components import ComponentConfig
from aitrainsai.scheduler import JobQueue

LOG_NAME = "job.log"
LOG_TAIL_CHARS = 4_000
PID_FILE = ".job_pid"
STATUS_FILE = ".job_status"
GPUS_FILE = ".job_gpus"  # the GPU ids a pinned payload runs on (a reattached one holds their slots)
# Runs the payload and records how it ended, so that a restarted orchestrator can reattach: the pid file's and the
# status file's modification times are the start and the end; the status file holds the exit code (128+N: signal N).
# A runner killed before it records anything (its worker vanished) leaves no status file: the job is lost.
RUNNER = ('echo $$ > "$0/.job_pid"; "$@"; code=$?; echo $code > "$0/.job_status.partial"; '
          'mv "$0/.job_status.partial" "$0/.job_status"; exit $code')
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


class LocalBackendConfig(ComponentConfig):
    """The local backend's options: how many payloads run at once, and how they share this machine's GPUs."""

    workers: int = Field(1, ge=1, le=64, description="payloads that run at once (on a machine without GPUs, or "
                                                       "when slots_per_gpu is unset)")
    slots_per_gpu: int | None = Field(
        None, ge=1, le=32, description="on a machine with GPUs: payloads that share one GPU at once; the pool then "
                                       "runs GPUs x slots_per_gpu payloads, each pinned to its GPUs by "
                                       "CUDA_VISIBLE_DEVICES (the least loaded first). None: workers payloads, "
                                       "each seeing every GPU")
    threads_per_payload: int | None = Field(
        None, ge=1, le=1024, description="CPU threads each payload may use (its OMP_NUM_THREADS). None: this "
                                         "machine's cores shared among the payloads that may run at once when that "
                                         "is more than one and OMP_NUM_THREADS is not set here; else torch's default")
    kill_grace_s: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL on a timeout")


class LocalBackend(TaskPerJob, GpuBackend):
    """Runs each payload as a subprocess in its own process group, in the payload's workdir (on this machine the
    workdir is the worker's copy, and its artifacts are fetched where they lie); ``python`` is this backend's own
    interpreter. A crash, a non-zero exit, a timeout or a missing artifact is dead.

    A payload whose requirements this machine cannot meet (a distribution missing or at an incompatible version in
    this environment, a container image, more GPUs than ``/proc/driver/nvidia`` or ``nvidia-smi`` show or none of
    the asked type, more memory than the machine has, more disk than is free, more ``/dev/shm`` than it holds) is
    refused: ``wait`` returns it dead with reason ``infra``, and nothing runs.

    Queued payloads start longest-expected first (``JobPayload.expected_s``), which keeps the pool's makespan close
    to the ideal. Payloads outlive the orchestrator: a restarted run reattaches to one still running (or already
    finished) through the pid and status files the runner writes into the payload's directory.
    """

    name = "local"
    description = "worker subprocesses on this machine (CPU, or its GPU when torch sees one)"
    Config = LocalBackendConfig
    config: LocalBackendConfig

    def __init__(self, config: LocalBackendConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._queue: JobQueue[int, list[str]] = JobQueue(self._fits, self._grant)  # GPUs wanted -> GPU ids
        self._running = 0
        self._closed = False
        # GPU id -> payloads running on it; empty: no pinning (no GPU here, or slots_per_gpu unset)
        self._gpu_load: dict[str, int] = {}
        if config.slots_per_gpu is not None:
            self._gpu_load = {gpu: 0 for gpu, _ in visible_gpus()}

    @property
    def capacity(self) -> int:
        slots = self.config.slots_per_gpu
        return len(self._gpu_load) * slots if self._gpu_load and slots is not None else self.config.workers

    def _threads(self) -> dict[str, str]:
        """OMP_NUM_THREADS for a payload: payloads that run at once split the cores instead of each starting one
        thread per core (which oversubscribes them)."""
        if self.config.threads_per_payload is not None:
            return {"OMP_NUM_THREADS": str(self.config.threads_per_payload)}
        if self.capacity <= 1 or "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // self.capacity))}

    def payload_threads(self) -> int | None:
        """The thread count a payload computes with (its OMP_NUM_THREADS, this backend's or inherited from this
        process), unless the payload sets its own; None: torch's default (the machine's cores)."""
        threads = self._threads().get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS", "")
        return int(threads) if threads.isdigit() and int(threads) > 0 else None

    def sandbox_cpus(self) -> dict[str, str]:
        """The CPU share of each sandbox a payload runs job code in (``AITRAINSAI_SANDBOX_CPUS``): this machine's
        cores split among the payloads that may run at once, and at most half of them (the probe's sandboxes' share:
        nothing there tells training from the probe, and the trainer beside it keeps the rest), at least half a
        core, so that one job cannot take the host's CPU; as set where this process has the variable (an operator's
        choice)."""
        from aitrainsai.isolation.contract import CPUS_VARIABLE, MIN_CPUS, default_cpus

        if CPUS_VARIABLE in os.environ:
            return {CPUS_VARIABLE: os.environ[CPUS_VARIABLE]}
        probe = default_cpus()  # unset here: half the cores, at least MIN_CPUS
        assert probe is not None
        return {CPUS_VARIABLE: f"{min(probe, max(MIN_CPUS, len(os.sched_getaffinity(0)) / self.capacity)):g}"}

    def gpus(self) -> list[str]:
        """The GPUs a payload here may see, by model name (none: payloads run on the CPU alone)."""
        return gpu_names()

    async def submit(self, payload: JobPayload) -> JobHandle:
        """Queue ``payload``. A job id may come again once its earlier run has ended (a lost job is rerun)."""
        self._admit(payload.job_id)
        workdir = Path(payload.workdir).resolve()
        data = {"workdir": str(workdir), "timeout_s": payload.timeout_s, "artifacts": payload.artifacts,
                "submitted_at": time.time()}
        refusal = unmet_requirements(payload, workdir)
        if refusal:
            data["refused"] = refusal
            self._refuse(payload.job_id, refusal)
        else:
            self._follow_in_task(payload.job_id, self._run(payload, workdir))
        return JobHandle(backend=self.name, job_id=payload.job_id, data=data)

    async def cancel(self, handle: JobHandle) -> None:
        job_id = handle.job_id
        if not self._note_cancel(job_id):
            return
        self._queue.cancel(job_id)  # still queued: it never starts
        process = self._processes.get(job_id)
        if process is not None and process.returncode is None:
            _kill_group(process.pid, signal.SIGKILL)
        elif handle.data.get("workdir"):  # started by an earlier process
            workdir = Path(handle.data["workdir"])
            pid = _read_int(workdir / PID_FILE)
            if pid is not None and _is_runner(pid, workdir):
                _kill_group(pid, signal.SIGKILL)

    async def close(self) -> None:
        """Stop everything: queued payloads never start, running ones are killed, and their waiters get
        ``CancelledError`` (the run is stopping; a resumed run finds them lost and reruns them)."""
        self._closed = True
        self._queue.close()
        for job_id, process in list(self._processes.items()):
            if process.returncode is None:
                _kill_group(process.pid, signal.SIGKILL)
            task = self._tasks.get(job_id)
            if task is not None and not task.done():
                task.cancel()

    # -- scheduling (JobQueue: the room is a worker, and with pinning a slot on each of its GPUs) ------------------
    def _free_gpus(self) -> list[str]:
        """The GPUs with a free slot, the least loaded first."""
        slots = self.config.slots_per_gpu or 0  # GPUs are pinned only when it is set
        return [gpu for _, gpu in sorted((load, gpu) for gpu, load in self._gpu_load.items() if load < slots)]

    def _fits(self, wanted: int) -> bool:
        if not self._gpu_load:
            return self._running < self.config.workers
        return len(self._free_gpus()) >= wanted

    def _grant(self, wanted: int) -> list[str]:
        """Take a worker; the GPU ids the payload is pinned to (none without pinning)."""
        chosen: list[str] = []
        if self._gpu_load:
            picked = set(self._free_gpus()[:wanted])
            chosen = [gpu for gpu in self._gpu_load if gpu in picked]  # in the GPUs' order
        self._take(chosen)
        return chosen

    def _take(self, gpus: list[str]) -> None:
        self._running += 1
        for gpu in gpus:
            if gpu in self._gpu_load:
                self._gpu_load[gpu] += 1

    def _release(self, gpus: Sequence[str] = ()) -> None:
        self._running -= 1
        for gpu in gpus:
            if gpu in self._gpu_load:
                self._gpu_load[gpu] = max(0, self._gpu_load[gpu] - 1)
        self._queue.dispatch()

    async def _run(self, payload: JobPayload, workdir: Path) -> JobResult:
        try:
            gpus = await self._queue.wait(payload.job_id, payload.expected_s, max(payload.gpus, 1))
        except asyncio.CancelledError:
            if payload.job_id in self._cancelled and not self._closed:
                return JobResult.dead(payload.job_id, "cancelled", "cancelled while queued")
            raise
        if self._closed:
            self._release(gpus)
            raise asyncio.CancelledError
        try:
            return await self._execute(payload, workdir, gpus)
        finally:
            self._release(gpus)

    async def _execute(self, payload: JobPayload, workdir: Path, gpus: Sequence[str] = ()) -> JobResult:
        if payload.job_id in self._cancelled:
            return JobResult.dead(payload.job_id, "cancelled", "cancelled before it started")
        workdir.mkdir(parents=True, exist_ok=True)
        for stale in (workdir / STATUS_FILE, workdir / PID_FILE, workdir / GPUS_FILE):
            stale.unlink(missing_ok=True)
        start = time.monotonic()
        env = {**_base_env(), **self._threads(), **payload.env, **self.sandbox_cpus(), **payload.secrets}
        if self._gpu_load:  # pinned: its GPUs, and how many payloads share each (a trainer may size its memory)
            env.update(CUDA_VISIBLE_DEVICES=",".join(gpus), AITRAINSAI_GPU_SLOTS=str(self.config.slots_per_gpu))
            (workdir / GPUS_FILE).write_text(",".join(gpus))
        command = [sys.executable, *payload.command[1:]] if payload.command[0] == PYTHON else payload.command
        secrets = list(payload.secrets.values())
        with open(workdir / LOG_NAME, "ab") as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    "/bin/sh", "-c", RUNNER, str(workdir), *command, cwd=workdir, env=env,
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True)
            except OSError as exc:
                return JobResult.dead(payload.job_id, "infra", f"could not start: {exc}")
            self._processes[payload.job_id] = process
            killed: DeadReason | None = None
            detail = ""
            try:
                await asyncio.wait_for(process.wait(), timeout=payload.timeout_s)
            except TimeoutError:
                killed, detail = "timeout", f"timed out after {payload.timeout_s:g} s"
                _kill_group(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), timeout=self.config.kill_grace_s)
                except TimeoutError:
                    _kill_group(process.pid, signal.SIGKILL)
                    await process.wait()
            except asyncio.CancelledError:
                _kill_group(process.pid, signal.SIGKILL)
                raise
            finally:
                self._processes.pop(payload.job_id, None)
            _kill_group(process.pid, signal.SIGKILL)  # leftovers the payload forked
        wall_s = time.monotonic() - start
        if payload.job_id in self._cancelled:
            killed, detail = "cancelled", "cancelled while running"
        if killed:
            return JobResult.dead(payload.job_id, killed, detail, wall_s=wall_s,
                                  log_tail=_tail(workdir / LOG_NAME, secrets))
        return _result(payload.job_id, workdir, _read_int(workdir / STATUS_FILE), wall_s, payload.artifacts, secrets)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        if handle.data.get("refused"):
            return JobResult.dead(handle.job_id, "infra", handle.data["refused"])
        workdir = Path(handle.data.get("workdir", ""))
        status_path, pid_path = workdir / STATUS_FILE, workdir / PID_FILE
        pid = _read_int(pid_path)
        if pid is not None and not status_path.exists() and _is_runner(pid, workdir):
            # Still running: it holds a worker (and its GPUs), so the pool starts no more than it has; its timeout
            # counts from its start (the pid file), not from its submission, which may have waited in the queue.
            gpus = list(dict.fromkeys(g for g in (_read_text(workdir / GPUS_FILE) or "").split(",") if g))
            self._take(gpus)
            try:
                deadline = _mtime(pid_path, handle.data.get("submitted_at", time.time())) + \
                    handle.data.get("timeout_s", 0) + 60
                while not status_path.exists() and _is_runner(pid, workdir):
                    if time.time() > deadline:
                        _kill_group(pid, signal.SIGKILL)
                        return JobResult.dead(handle.job_id, "timeout", "timed out (reattached)",
                                              log_tail=_tail(workdir / LOG_NAME))
                    await asyncio.sleep(0.5)
            finally:
                self._release(gpus)
        if handle.job_id in self._cancelled:
            return JobResult.dead(handle.job_id, "cancelled", "cancelled while running (reattached)",
                                  log_tail=_tail(workdir / LOG_NAME))
        wall_s = status_path.stat().st_mtime - pid_path.stat().st_mtime if status_path.exists() and \
            pid_path.exists() else 0.0
        return _result(handle.job_id, workdir, _read_int(status_path), wall_s, handle.data.get("artifacts", {}), [])


def _result(job_id: str, workdir: Path, code: int | None, wall_s: float, artifacts: dict[str, str],
            secrets: list[str]) -> JobResult:
    """The outcome the runner recorded (``code`` None: it recorded none, so its worker vanished)."""
    tail = _tail(workdir / LOG_NAME, secrets)
    if code is None:
        return JobResult.dead(job_id, "lost", "no record of how the job ended: its worker vanished, or it never "
                                              "started", wall_s=wall_s, log_tail=tail)
    if 128 < code < 192:
        code = 128 - code  # the shell reports death by signal N as 128 + N
    if code != 0:
        reason: DeadReason
        if code == -signal.SIGKILL:
            reason, detail = "oom", "killed by SIGKILL (most likely out of memory)"
        else:
            reason = "failed"
            detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        said = _last_line(tail) if code > 0 else ""  # its own reason (a sandbox that could not start, a plugin)
        return JobResult.dead(job_id, reason, f"{detail}: {said}" if said else detail, exit_code=code, wall_s=wall_s,
                              log_tail=tail)
    found: dict[str, Path] = {}
    missing: list[tuple[str, str]] = []
    root = workdir.resolve()
    for name, relative in artifacts.items():
        path = (workdir / relative).resolve()
        if path.is_relative_to(root) and path.exists():
            found[name] = path
        else:
            missing.append((name, relative))
    if missing:
        return MissingArtifacts.absent(missing).result(job_id, exit_code=code, wall_s=wall_s, log_tail=tail)
    return JobResult(job_id=job_id, status="done", exit_code=code, wall_s=wall_s, log_tail=tail, artifacts=found)


# -- requirements ----------------------------------------------------------------------------------------------------
def unmet_requirements(payload: JobPayload, workdir: Path) -> str:
    """Why this machine cannot run ``payload`` (one line), or ``""``."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    runtime = payload.runtime
    if runtime.image:
        return f"the local backend runs no container images (runtime.image {runtime.image!r})"
    for name, spec in runtime.distributions.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"distribution {name} is not installed in the local backend's environment ({sys.prefix})"
        if not SpecifierSet(spec).contains(version, prereleases=True):
            return f"distribution {name} {version} is installed here; the payload needs {name}{spec}"
    if payload.gpus or payload.gpu_type:
        names = gpu_names()
        matching = [n for n in names if not payload.gpu_type or payload.gpu_type.lower() in n.lower()]
        wanted = max(payload.gpus, 1)
        if len(matching) < wanted:
            kind = f" {payload.gpu_type}" if payload.gpu_type else ""
            have = ", ".join(names) if names else "none"
            return f"the payload needs {wanted}{kind} GPU(s); this machine has {have}"
    if payload.memory_gb is not None and payload.memory_gb > memory_gb():
        return f"the payload needs {payload.memory_gb:g} GB of memory; this machine has {memory_gb():.1f} GB"
    if payload.disk_gb is not None:
        free = shutil.disk_usage(_existing(workdir)).free / 2**30
        if payload.disk_gb > free:
            return f"the payload needs {payload.disk_gb:g} GB of free disk; {free:.1f} GB are free at {workdir}"
    if payload.shm_gb is not None:
        shm = shm_gb()
        if payload.shm_gb > shm:
            return f"the payload needs {payload.shm_gb:g} GB of /dev/shm; this machine has {shm:.1f} GB"
    return ""


def gpu_names() -> list[str]:
    """The NVIDIA GPUs this process may use, by model name, found without importing torch: ``/proc/driver/nvidia``,
    else ``nvidia-smi``; ``CUDA_VISIBLE_DEVICES`` (indices) narrows them."""
    return [name for _, name in visible_gpus()]


def visible_gpus() -> list[tuple[str, str]]:
    """(the id a child's ``CUDA_VISIBLE_DEVICES`` names it by, model name) of each GPU this process may use."""
    names: list[str] = []
    for info in sorted(NVIDIA_GPUS.glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    if not names and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False,
                                 capture_output=True, text=True, timeout=20)
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            names = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(str(i), name) for i, name in enumerate(names)]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if all(e.lstrip("-").isdigit() for e in entries):
        chosen = []
        for e in entries:
            if int(e) < 0:
                break  # an invalid index hides it and every later one
            if int(e) < len(names):
                chosen.append((e, names[int(e)]))
        return chosen
    return list(zip(entries, names))  # UUIDs or MIG ids, in the order given


def memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def shm_gb() -> float:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return 0.0
    return stats.f_frsize * stats.f_blocks / 2**30


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# -- helpers ---------------------------------------------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()[:1_000]
    except OSError:
        return None


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default


def _is_runner(pid: int, workdir: Path) -> bool:
    """Whether ``pid`` is still the runner of ``workdir`` (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return RUNNER.encode() in cmdline and str(workdir).encode() in cmdline


def _base_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "OMP_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
            "AITRAINSAI_ISOLATION")  # this machine is the worker: its isolation strategy is the payload's
    return {k: v for k, v in os.environ.items() if k in keep}


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(tail: str, limit: int = 300) -> str:
    """The log's last non-empty line, shortened to ``limit`` characters."""
    line = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _tail(path: Path, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """The log's last characters, with any known secret value blanked out."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_CHARS))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return blank_secrets(text, secrets)


@hookimpl
def register_gpu_backends(register):
    register(LocalBackend)
