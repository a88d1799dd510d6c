"""Following a Ray job to its end, also one an earlier orchestrator submitted (from its handle): polls of the job API,
a stop when it is cancelled or long past its time, then how it ended, read from the job API and the runner's
``outcome.json``, and its artifacts. The result is recorded in the job's folder (``result.json``): a later wait
returns it, and a finished job never runs again."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from aitrainsai import DeadReason, JobHandle, JobResult, MissingArtifacts, blank_secrets

from aitrainsai_backend_ray.artifacts import fetch
from aitrainsai_backend_ray.config import RayConfig
from aitrainsai_backend_ray.pool import Pool, line
from aitrainsai_backend_ray.submission import NO_FOLDER

LOG_TAIL_CHARS = 4_000
MAX_RECORD_BYTES = 65_536  # outcome.json, result.json: an exit code, times, a reason
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Ray's error types for a job whose supervisor (and so its node) went away, and for one Ray could not start
LOST_ERRORS = ("JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE")
INFRA_ERRORS = ("RUNTIME_ENV_SETUP_FAILURE", "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
                "JOB_SUPERVISOR_ACTOR_START_FAILURE", "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE",
                "JOB_ENTRYPOINT_COMMAND_START_ERROR")


class Follower:
    """Follows the pool's jobs; ``cancelled`` is the backend's set of the job ids it was asked to cancel, and
    ``stopping`` notes why the backend stopped a submission (submission id -> "cancelled", "timeout", "closed")."""

    def __init__(self, config: RayConfig, pool: Pool, cancelled: set[str]):
        self.config = config
        self.pool = pool
        self.cancelled = cancelled
        self.stopping: dict[str, str] = {}

    async def follow(self, handle: JobHandle, secrets: list[str], *, reattached: bool = False) -> JobResult:
        """Poll the job until it ends; stop it when cancelled or long past its time; then say how it ended."""
        job_id, data = handle.job_id, handle.data
        sid, job_dir = data["submission_id"], Path(data["job_dir"])
        timeout_s = float(data.get("timeout_s", 0.0))
        silent_since: float | None = None
        while True:
            if job_id in self.cancelled and sid not in self.stopping:
                await self.stop(sid, job_dir, "cancelled")
            try:
                assert self.pool.client is not None  # set by start()
                info = await asyncio.to_thread(self.pool.client.get_job_info, sid)
                silent_since = None
            except RuntimeError as exc:
                if "status code 404" in str(exc):
                    return JobResult.dead(job_id, "lost", f"the cluster has no job {sid} (its head restarted, or it "
                                                          "was never submitted)")
                info = None
            except OSError:  # the dashboard does not answer: its head may be restarting
                info = None
            if info is None:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > self.config.unreachable_s:
                    return JobResult.dead(job_id, "lost", f"the Ray cluster at {self.pool.url} did not answer for "
                                                          f"{self.config.unreachable_s:g} s")
                await asyncio.sleep(self.config.poll_s)
                continue
            status = str(getattr(info.status, "value", info.status))
            if status in TERMINAL:
                break
            started = _mtime(job_dir / "pid")
            if (status == "RUNNING" and started is not None and sid not in self.stopping
                    and time.time() > started + timeout_s + self.config.timeout_grace_s):
                await self.stop(sid, job_dir, "timeout")
            await asyncio.sleep(self.config.poll_s)
        result = await self.ended(handle, info, status, secrets, reattached)
        await asyncio.to_thread(self.settle, job_dir, result)
        return result

    def settle(self, job_dir: Path, result: JobResult) -> None:
        """Record the result in the job's folder (a later wait returns it: a finished job never runs again) and drop
        the workdir's copy, unless ``keep_job_folders``."""
        with contextlib.suppress(OSError):
            partial = job_dir / "result.json.partial"
            partial.write_text(result.model_dump_json())
            partial.replace(job_dir / "result.json")
        if not self.config.keep_job_folders:
            shutil.rmtree(job_dir / "work", ignore_errors=True)
            for name in ("runner.py", "spec.json", "env.json"):
                with contextlib.suppress(OSError):
                    (job_dir / name).unlink()

    async def ended(self, handle: JobHandle, info: Any, status: str, secrets: list[str],
                    reattached: bool) -> JobResult:
        job_id, data = handle.job_id, handle.data
        sid, job_dir = data["submission_id"], Path(data["job_dir"])
        outcome = _read_json(job_dir / "outcome.json")
        tail = await self.log_tail(sid, secrets)
        started = _mtime(job_dir / "pid")
        ended = outcome.get("ended") or (info.end_time / 1000 if info.end_time else time.time())
        wall_s = max(0.0, ended - (outcome.get("started") or started or ended))
        code = outcome.get("code", info.driver_exit_code)
        if isinstance(code, int) and 128 < code < 192 and "code" not in outcome:
            code = 128 - code  # the runner's own death by signal N
        common = {"exit_code": code, "wall_s": wall_s, "log_tail": tail}
        suffix = " (reattached)" if reattached else ""
        stopped = self.stopping.pop(sid, None) or _read_text(job_dir / "stopped_by")
        if job_id in self.cancelled:
            return JobResult.dead(job_id, "cancelled", f"cancelled while running{suffix}", **common)
        if outcome.get("timeout") or (status == "STOPPED" and stopped == "timeout"):
            return JobResult.dead(job_id, "timeout", f"timed out after {data.get('timeout_s', 0):g} s{suffix}",
                                  **common)
        if status == "STOPPED":
            if stopped == "closed":
                return JobResult.dead(job_id, "lost", "stopped when the run that started it closed", **common)
            if stopped == "cancelled":
                return JobResult.dead(job_id, "cancelled", f"cancelled while running{suffix}", **common)
            return JobResult.dead(job_id, "cancelled", f"stopped outside this run (ray job stop {sid})", **common)
        if outcome.get("refused"):
            return JobResult.dead(job_id, "infra", outcome["refused"], **common)
        if status == "FAILED":
            error = str(getattr(info.error_type, "value", info.error_type) or "")
            if error in LOST_ERRORS or await self.pool.node_died(info):
                return JobResult.dead(job_id, "lost", f"its worker vanished: {line(info.message or error)[:300]}",
                                      **common)
            if error in INFRA_ERRORS:
                return JobResult.dead(job_id, "infra", f"Ray could not run it: {line(info.message or error)[:300]}",
                                      **common)
            if code == NO_FOLDER and not outcome:
                return JobResult.dead(job_id, "infra", f"its folder {job_dir} is not on the node: set "
                                                       "gpu_backend.ray.shared_dir to a folder every node shares",
                                      **common)
            return JobResult.dead(job_id, *_failure(code), **common)
        try:
            found = await asyncio.to_thread(fetch, job_dir / "work", data.get("artifacts", {}), Path(data["workdir"]),
                                            max_bytes=int(self.config.max_artifact_mb * 2**20),
                                            max_files=self.config.max_artifact_files)
        except MissingArtifacts as exc:
            return exc.result(job_id, **common)
        return JobResult(job_id=job_id, status="done", artifacts=found, **common)

    async def stop(self, sid: str, job_dir: Path, why: str, *, ask_ray: bool = True) -> None:
        """Ask Ray to stop the job (SIGTERM, SIGKILL 3 s later), noting why in its folder for a later reader."""
        self.stopping.setdefault(sid, why)
        with contextlib.suppress(OSError):
            if job_dir.is_dir() and not (job_dir / "stopped_by").exists():
                (job_dir / "stopped_by").write_text(why)
        if not ask_ray or self.pool.client is None:
            return
        with contextlib.suppress(Exception):  # gone already, or the cluster is away: the poll says which
            await asyncio.to_thread(self.pool.client.stop_job, sid)

    async def log_tail(self, sid: str, secrets: list[str]) -> str:
        try:
            assert self.pool.client is not None  # set by start()
            text = await asyncio.to_thread(self.pool.client.get_job_logs, sid)
        except Exception:  # noqa: BLE001 - a log that cannot be read is no reason to lose the result
            return ""
        return blank_secrets(text[-LOG_TAIL_CHARS:], secrets)


def recorded_result(job_dir: Path) -> JobResult | None:
    """The result :meth:`Follower.settle` recorded in the job's folder: it ended and was collected before."""
    recorded = _read_json(job_dir / "result.json")
    return JobResult.model_validate(recorded) if recorded else None


def _failure(code: int | None) -> tuple[DeadReason, str]:
    if code is None:
        return "failed", "failed without an exit code"
    if code == -9:
        return "oom", "killed by SIGKILL (most likely out of memory)"
    if code < 0:
        return "failed", f"killed by signal {-code}"
    return "failed", f"exit code {code}"


def _read_json(path: Path) -> dict[str, Any]:
    """A small record in a job's folder (shared storage: anything that can write there may have written it), read
    capped, no link followed, depth-checked; {} for anything else."""
    from aitrainsai import read_json

    try:
        value = read_json(path, max_bytes=MAX_RECORD_BYTES)
    except ValueError:  # UntrustedInputError included: missing, a link, too big, too deep, not JSON
        return {}
    return value if isinstance(value, dict) else {}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
