"""The local backend: payloads run as subprocesses of this machine, a few at a time. The default GPU backend."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import signal
import time
from pathlib import Path

from pydantic import Field

from aitrainsai import hookimpl
from aitrainsai.backends import GpuBackend, JobHandle, JobPayload, JobResult
from aitrainsai.components import ComponentConfig

LOG_NAME = "job.log"
LOG_TAIL_CHARS = 4_000
PID_FILE = ".job_pid"
STATUS_FILE = ".job_status"
# Runs the payload and records how it ended, so that a restarted orchestrator can reattach: the pid file's and the
# status file's modification times are the start and the end; the status file holds the exit code (128+N: signal N).
RUNNER = ('echo $$ > "$0/.job_pid"; "$@"; code=$?; echo $code > "$0/.job_status.partial"; '
          'mv "$0/.job_status.partial" "$0/.job_status"; exit $code')


class LocalBackendConfig(ComponentConfig):
    workers: int = Field(1, ge=1, le=64, description="payloads that run at once")
    kill_grace_s: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL on a timeout")


class LocalBackend(GpuBackend):
    """Runs each payload as a subprocess in its own process group; a crash, a non-zero exit or a timeout is dead.

    Queued payloads start longest-expected first (``JobPayload.expected_s``), which keeps the pool's makespan close
    to the ideal. Payloads outlive the orchestrator: a restarted run reattaches to one still running (or already
    finished) through the pid and status files the runner writes into the payload's directory.
    """

    name = "local"
    description = "worker subprocesses on this machine (CPU, or its GPU when torch sees one)"
    Config = LocalBackendConfig

    def __init__(self, config: LocalBackendConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self._tasks: dict[str, asyncio.Task] = {}
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._queue: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._running = 0
        self._dispatch_pending = False
        self._closed = False

    @property
    def capacity(self) -> int:
        return self.config.workers

    async def submit(self, payload: JobPayload) -> JobHandle:
        """Queue ``payload``. A job id may come again once its earlier run has ended (a lost job is rerun)."""
        earlier = self._tasks.get(payload.job_id)
        if earlier is not None and not earlier.done():
            raise ValueError(f"job {payload.job_id} was already submitted and has not ended")
        self._tasks[payload.job_id] = asyncio.ensure_future(self._run(payload))
        return JobHandle(backend=self.name, job_id=payload.job_id,
                         data={"workdir": str(Path(payload.workdir).resolve()), "timeout_s": payload.timeout_s,
                               "outputs": payload.outputs, "submitted_at": time.time()})

    async def wait(self, handle: JobHandle) -> JobResult:
        task = self._tasks.get(handle.job_id)
        if task is None:  # submitted by an earlier process
            task = self._tasks[handle.job_id] = asyncio.ensure_future(self._reattach(handle))
        return await asyncio.shield(task)

    async def cancel(self, handle: JobHandle) -> None:
        process = self._processes.get(handle.job_id)
        if process is not None and process.returncode is None:
            _kill_group(process.pid, signal.SIGKILL)
        task = self._tasks.get(handle.job_id)
        if task is not None and not task.done():
            task.cancel()

    async def close(self) -> None:
        self._closed = True  # queued payloads never start: a stopping run must not launch new work
        for _, _, ticket in self._queue:
            ticket.cancel()
        self._queue.clear()
        for job_id in list(self._processes):
            await self.cancel(JobHandle(backend=self.name, job_id=job_id))

    # -- scheduling --------------------------------------------------------------------------------------------------
    async def _slot(self, expected_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        ticket = loop.create_future()
        heapq.heappush(self._queue, (-(expected_s or 0.0), next(self._order), ticket))
        if not self._dispatch_pending:  # dispatch once the whole burst is queued, so it starts longest first
            self._dispatch_pending = True
            loop.call_soon(self._dispatch)
        await ticket

    def _dispatch(self) -> None:
        self._dispatch_pending = False
        while not self._closed and self._running < self.config.workers and self._queue:
            _, _, ticket = heapq.heappop(self._queue)
            if not ticket.done():
                self._running += 1
                ticket.set_result(None)

    def _release(self) -> None:
        self._running -= 1
        self._dispatch()

    async def _run(self, payload: JobPayload) -> JobResult:
        await self._slot(payload.expected_s)
        if self._closed:
            raise asyncio.CancelledError
        try:
            return await self._execute(payload)
        finally:
            self._release()

    async def _execute(self, payload: JobPayload) -> JobResult:
        workdir = Path(payload.workdir).resolve()  # the runner writes its status files from inside it
        workdir.mkdir(parents=True, exist_ok=True)
        for stale in (workdir / STATUS_FILE, workdir / PID_FILE):
            stale.unlink(missing_ok=True)
        start = time.monotonic()
        env = {**_base_env(), **payload.env}
        with open(workdir / LOG_NAME, "ab") as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    "/bin/sh", "-c", RUNNER, str(workdir), *payload.command, cwd=workdir, env=env,
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True)
            except OSError as exc:
                return JobResult(job_id=payload.job_id, status="dead", reason=f"could not start: {exc}",
                                 log_tail=str(exc), output_dir=workdir)
            self._processes[payload.job_id] = process
            reason = ""
            try:
                await asyncio.wait_for(process.wait(), timeout=payload.timeout_s)
            except asyncio.TimeoutError:
                reason = f"timed out after {payload.timeout_s:g} s"
                _kill_group(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), timeout=self.config.kill_grace_s)
                except asyncio.TimeoutError:
                    _kill_group(process.pid, signal.SIGKILL)
                    await process.wait()
            except asyncio.CancelledError:
                _kill_group(process.pid, signal.SIGKILL)
                raise
            finally:
                self._processes.pop(payload.job_id, None)
            _kill_group(process.pid, signal.SIGKILL)  # leftovers the payload forked
        return _result(payload.job_id, workdir, process.returncode, time.monotonic() - start, reason, payload.outputs)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        workdir = Path(handle.data.get("workdir", ""))
        status_path, pid_path = workdir / STATUS_FILE, workdir / PID_FILE
        pid = _read_int(pid_path)
        if pid is not None and not status_path.exists() and _is_runner(pid, workdir):
            # Still running: it holds a worker, so the pool starts no more than it has; its timeout counts from
            # its start (the pid file), not from its submission, which may have waited in the queue.
            self._running += 1
            try:
                deadline = _mtime(pid_path, handle.data.get("submitted_at", time.time())) + \
                    handle.data.get("timeout_s", 0) + 60
                while not status_path.exists() and _is_runner(pid, workdir):
                    if time.time() > deadline:
                        _kill_group(pid, signal.SIGKILL)
                        return JobResult(job_id=handle.job_id, status="dead", reason="timed out (reattached)",
                                         log_tail=_tail(workdir / LOG_NAME), output_dir=workdir)
                    await asyncio.sleep(0.5)
            finally:
                self._release()
        code = _read_int(status_path)
        if code is None:
            return JobResult(job_id=handle.job_id, status="dead", reason="lost", log_tail=_tail(workdir / LOG_NAME))
        wall_s = status_path.stat().st_mtime - pid_path.stat().st_mtime if pid_path.exists() else 0.0
        return _result(handle.job_id, workdir, code, wall_s, "", handle.data.get("outputs", []))


def _result(job_id: str, workdir: Path, code: int | None, wall_s: float, reason: str, outputs: list[str]) -> JobResult:
    if code is not None and 128 < code < 192:
        code = 128 - code  # the shell reports death by signal N as 128 + N
    if not reason and code != 0:
        reason = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if code in (-signal.SIGKILL, 137):
            reason += " (out of memory or killed)"
    missing = [p for p in outputs if not (workdir / p).exists()] if not reason else []
    if missing:
        reason = f"finished without its outputs: {', '.join(missing)}"
    return JobResult(job_id=job_id, status="dead" if reason else "done", reason=reason, exit_code=code, wall_s=wall_s,
                     log_tail=_tail(workdir / LOG_NAME), output_dir=workdir)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
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
            "CUDA_VISIBLE_DEVICES", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    return {k: v for k, v in os.environ.items() if k in keep}


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_CHARS))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


@hookimpl
def register_gpu_backends(register):
    register(LocalBackend)
