"""The Ray backend: each payload is a Ray job, submitted through the job submission API of a cluster's dashboard.

The cluster is the one at ``address``, or a head this backend starts on this machine (loopback only) and stops at
``close()``. Payloads travel by a shared file system, not by Ray's ``working_dir`` upload: each job's folder
``<shared_dir>/<submission id>/`` holds a copy of the payload's workdir (``work/``), the runner (:mod:`.runner`),
the job's spec and, until the runner has read it, its environment with the secrets (mode 0600). The job's
entrypoint starts the runner in ``work/``; the backend reads how it ended from the job API and the runner's
``outcome.json``, checks the artifacts there (plain files and folders, no links, size caps) and copies them into the
payload's workdir here, where the caller finds them, as with the local backend.

Payloads queue here, longest expected first, and go to Ray only while the cluster has the CPUs, GPUs and memory for
them (Ray never holds a queue of ours). A job's submission id is derived from the backend's folder (the run's) and
the job id, and goes into the handle and ``submissions.jsonl`` before Ray hears of it: a restarted orchestrator
reattaches to the job by its handle and never runs a finished one again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from aitrainsai import (ComponentConfig, DeadReason, GpuBackend, JobHandle, JobPayload, JobQueue, JobResult,
                        TaskPerJob, WheelCache, WheelError, blank_secrets)
from pydantic import Field

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import StateApiClient

    from aitrainsai_backend_ray.cluster import LocalCluster

LOG_TAIL_CHARS = 4_000
CLOSE_STEP_S = 10.0  # close() waits at most this long for the jobs' stop requests, and again for their followers
REQUEST_TIMEOUT_S = (5.0, 30.0)  # connect, read: a request to the dashboard that takes longer is a silent poll
RUNNER = Path(__file__).with_name("runner.py")
NO_FOLDER = 96  # the entrypoint found no job folder: the node does not share shared_dir
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Ray's error types for a job whose supervisor (and so its node) went away, and for one Ray could not start
LOST_ERRORS = ("JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE")
INFRA_ERRORS = ("RUNTIME_ENV_SETUP_FAILURE", "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
                "JOB_SUPERVISOR_ACTOR_START_FAILURE", "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE",
                "JOB_ENTRYPOINT_COMMAND_START_ERROR")


class RayConfig(ComponentConfig):
    address: str | None = Field(
        None, description="the cluster: its dashboard's job submission address 'http://head:8265'; "
                          "'ray://head:10001' (taken as http://head:<dashboard_port>); 'auto' or a GCS address "
                          "'head:6379' (Ray asks that cluster's GCS for its dashboard); None: start a Ray head on "
                          "this machine for the run (loopback only) and stop it at the end")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="the dashboard's port for a ray:// address")
    shared_dir: Path | None = Field(
        None, description="a folder at the same path here and on every node (NFS, a cluster file system): jobs run "
                          "in copies of their workdirs there and their artifacts are read back from there; None: the "
                          "backend's folder of the run, which only a cluster on this machine sees")
    python: str | None = Field(
        None, description="the program that runs a payload's 'python' and the runner on the nodes; None: 'python' "
                          "on the nodes' PATH (Ray's images: Ray's own interpreter), or this interpreter for the "
                          "head the backend starts")
    cpus_per_job: float = Field(1.0, gt=0, description="CPUs each payload reserves (entrypoint_num_cpus); a cluster "
                                                       "without GPUs runs its CPUs // cpus_per_job payloads at once")
    poll_s: float = Field(1.0, gt=0, description="seconds between two status requests for a running job")
    kill_grace_s: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL when a job times out")
    timeout_grace_s: float = Field(60.0, ge=0, description="a job still running this long past its timeout_s (its "
                                                           "runner did not end it) is stopped by the backend")
    unreachable_s: float = Field(300.0, gt=0, description="a job whose cluster does not answer this long is lost")
    max_artifact_mb: float = Field(2048.0, gt=0, description="the most a job's artifacts may hold, in all")
    max_artifact_files: int = Field(10_000, ge=1, description="the most files a job's artifacts may hold, in all")
    keep_job_folders: bool = Field(False, description="keep each job's folder under shared_dir once it has ended")
    runtime_env: Literal["none", "pip"] = Field(
        "none", description="'none': the nodes have the payload's distributions already (the runner checks them "
                            "before the payload runs); 'pip': Ray's pip runtime env installs them into a virtualenv "
                            "per distinct runtime on each node (kept by Ray for later jobs); distributions installed "
                            "here from a folder travel as wheels built into shared_dir/wheels")
    pip_args: list[str] = Field(default_factory=list, description="extra pip options for runtime_env='pip', e.g. "
                                                                  "['--index-url', 'https://mirror/simple']")
    ship_local_wheels: bool = Field(True, description="with runtime_env='pip': build wheels of distributions "
                                                      "installed here from a local folder (on no index)")
    local_num_cpus: int | None = Field(None, ge=1, description="CPUs of the head the backend starts; None: Ray "
                                                               "counts this machine's")
    local_num_gpus: int | None = Field(None, ge=0, description="GPUs of the head the backend starts; None: Ray "
                                                               "detects them")
    local_object_store_mb: int = Field(256, ge=80, description="object store of the head the backend starts "
                                                               "(payloads rarely use it)")
    start_timeout_s: float = Field(120.0, gt=0, description="how long the head the backend starts may take")
    keeper_grace_s: float = Field(
        300.0, gt=0, description="the head the backend starts is stopped by its keeper once the orchestrator has been "
                                 "gone (killed) this long; a run resumed before that adopts the head and its jobs")


class _Refused(Exception):
    """The cluster cannot run the payload (one line): a dead job, reason ``infra``."""


class RayBackend(TaskPerJob, GpuBackend):
    """Payloads as Ray jobs through the job submission API (see the module docstring)."""

    name = "ray"
    description = "Ray jobs on a Ray cluster (or on a head it starts here); files through a shared folder"
    Config = RayConfig

    def __init__(self, config: RayConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self.config: RayConfig = config
        self.url = ""
        self.cluster: LocalCluster | None = None  # the LocalCluster this backend started
        self._client: JobSubmissionClient | None = None
        self._state: StateApiClient | None = None
        self._nodes: list[dict[str, float]] = []  # alive nodes' resources
        self._python = config.python or "python"
        self._queue: JobQueue[dict[str, float], None] = JobQueue(self._fits, self._take)
        self._used: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        self._live: dict[str, tuple[str, Path]] = {}  # job id -> (submission id, job folder) of followed jobs
        self._stopping: dict[str, str] = {}  # submission id -> why the backend stopped it
        self._attempts: dict[str, int] | None = None  # job id -> submissions so far (submissions.jsonl)
        self._closed = False
        self._started = False
        self._wheels = WheelCache(self.shared_dir / "wheels", enabled=config.ship_local_wheels)

    # -- the GpuBackend interface -------------------------------------------------------------------------------------
    @property
    def shared_dir(self) -> Path:
        return Path(self.config.shared_dir or self.workdir / "jobs").resolve()

    @property
    def capacity(self) -> int:
        """The cluster's GPUs where it has any (one GPU payload each), else its CPUs // ``cpus_per_job``; 1 before
        ``start()``."""
        totals = self._totals()
        if totals.get("GPU", 0) >= 1:
            return int(totals["GPU"])
        return max(1, int(totals.get("CPU", 0) // self.config.cpus_per_job))

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        assert isinstance(config, RayConfig)
        problems = []
        try:
            import ray
        except ImportError as exc:
            return [f"the Ray backend needs ray: pip install 'ray[default]==2.60.0' ({exc})"]
        try:
            import ray.job_submission  # the dashboard's client, from ray[default]
        except ImportError:
            problems.append("the Ray backend needs the job submission client: pip install 'ray[default]==2.60.0'")
        if ray.__version__ != "2.60.0":
            problems.append(f"the Ray backend is built for ray 2.60.0; ray {ray.__version__} is installed")
        if config.address is not None and not config.address.strip():
            problems.append("gpu_backend.ray.address is empty: give the dashboard's address (http://head:8265) "
                            "or leave it unset to start a head on this machine")
        if config.runtime_env != "none" and config.python:
            problems.append("gpu_backend.ray.python and runtime_env='pip' exclude each other: a job of a runtime env "
                            "runs the python of the virtualenv Ray builds for it")
        if config.shared_dir is not None and not Path(config.shared_dir).is_absolute():
            problems.append(f"gpu_backend.ray.shared_dir {str(config.shared_dir)!r} must be an absolute path (the "
                            "same on every node)")
        return problems

    async def start(self) -> None:
        if self._started:
            return
        from aitrainsai_backend_ray.cluster import ClusterError, LocalCluster, dashboard_url

        if self.config.address is None:
            abort = threading.Event()
            starting = asyncio.ensure_future(asyncio.to_thread(self._local_cluster, LocalCluster, abort))
            try:
                cluster, events = await asyncio.shield(starting)
            except asyncio.CancelledError:  # the run stops while the head starts: that start stops it
                abort.set()
                await asyncio.wait([starting], timeout=CLOSE_STEP_S)
                if starting.done() and not starting.cancelled() and starting.exception() is None:
                    await asyncio.to_thread(starting.result()[0].stop)  # it was up (or adopted) before it noticed
                raise
            for action, detail in events:
                if self.record is not None:
                    self.record("head", action=action, detail=detail)
            self.cluster = cluster
            self.url = cluster.url
            if self.config.runtime_env == "none":
                self._python = self.config.python or sys.executable  # the head's workers run this interpreter
        else:
            self.url = await asyncio.to_thread(dashboard_url, self.config.address, self.config.dashboard_port)
        try:
            self._client, self._state = await asyncio.to_thread(_clients, self.url)
            await self._refresh_nodes()
        except Exception as exc:
            await self.close()
            if isinstance(exc, ClusterError):
                raise
            raise ClusterError(f"the Ray cluster at {self.url} does not answer: {_line(exc)}") from None
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self._started = True

    def _local_cluster(self, local_cluster: type[LocalCluster],
                       abort: threading.Event) -> tuple[LocalCluster, list[tuple[str, str]]]:
        """The head an earlier orchestrator of this run started, if it still runs (adopted: its jobs are followed
        again), else a new one; both watched by a keeper (``keeper_grace_s``). Also what was done, for the ledger."""
        adopted, what = local_cluster.adopt(self.workdir, keeper_grace_s=self.config.keeper_grace_s)
        events = [("adopted" if adopted else "swept", what)] if what else []
        if adopted is not None:
            return adopted, events
        cluster = local_cluster(num_cpus=self.config.local_num_cpus, num_gpus=self.config.local_num_gpus,
                                object_store_mb=self.config.local_object_store_mb, keeper_dir=self.workdir,
                                keeper_grace_s=self.config.keeper_grace_s)
        cluster.start(self.config.start_timeout_s, abort=abort)
        assert cluster.root is not None  # start() names the ray start process
        events.append(("started", f"a head in {cluster.temp_dir} (ray start pid {cluster.root.pid}) after "
                                  f"{cluster.started_s:.1f} s"))
        return cluster, events

    async def close(self) -> None:
        """Stop every job this object runs or follows; queued ones never start, and their waiters get
        ``CancelledError`` (the run is stopping; a resumed run finds them lost and reruns them). A head the backend
        started is stopped. Bounded: about 10 s for the jobs, 7 s for the head."""
        self._closed = True
        self._queue.close()
        if self._live:
            # the head this backend started goes below with its jobs: only note why they stopped
            ask_ray = self._client is not None and self.cluster is None
            stops = [self._stop(sid, job_dir, "closed", ask_ray=ask_ray) for sid, job_dir in self._live.values()]
            await asyncio.wait([asyncio.ensure_future(stop) for stop in stops], timeout=CLOSE_STEP_S)
        for task in self._tasks.values():
            if not task.done():
                task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=CLOSE_STEP_S)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
            self.cluster = None

    async def submit(self, payload: JobPayload) -> JobHandle:
        """Queue ``payload``. A job id may come again once its earlier run has ended; it gets a new submission id."""
        self._admit(payload.job_id)
        sid = self._new_submission_id(payload.job_id)
        need = self._need(payload)
        data = {"submission_id": sid, "job_dir": str(self.shared_dir / sid),
                "workdir": str(Path(payload.workdir).resolve()), "timeout_s": payload.timeout_s,
                "artifacts": payload.artifacts, "need": need, "submitted_at": time.time()}
        handle = JobHandle(backend=self.name, job_id=payload.job_id, data=data)
        self._tasks[payload.job_id] = asyncio.ensure_future(self._run(payload, handle))
        return handle

    async def cancel(self, handle: JobHandle) -> None:
        job_id = handle.job_id
        if not self._note_cancel(job_id):
            return
        self._queue.cancel(job_id)  # still queued here: it never reaches Ray
        sid, job_dir = self._live.get(job_id) or (handle.data.get("submission_id"), handle.data.get("job_dir"))
        if sid and job_dir and self._client is not None:
            await self._stop(sid, Path(job_dir), "cancelled")

    # -- jobs ----------------------------------------------------------------------------------------------------------
    def _need(self, payload: JobPayload) -> dict[str, float]:
        need = {"CPU": self.config.cpus_per_job, "GPU": float(payload.gpus)}
        if payload.memory_gb:
            need["memory"] = payload.memory_gb * 2**30
        return need

    def _new_submission_id(self, job_id: str) -> str:
        """``aitrainsai-<run>-<job>-<attempt>``, recorded at once: the run is a digest of the backend's folder, the
        attempt counts the job's earlier submissions in ``submissions.jsonl`` (Ray refuses a submission id twice)."""
        run = hashlib.sha256(str(self.workdir.resolve()).encode()).hexdigest()[:10]
        slug = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)
        if slug != job_id or len(slug) > 48:
            slug = f"{slug[:40]}-{hashlib.sha256(job_id.encode()).hexdigest()[:7]}"
        if self._attempts is None:
            self._attempts = {}
            for entry in self._journal_entries():
                key = str(entry.get("job_id"))
                self._attempts[key] = self._attempts.get(key, 0) + 1
        attempt = self._attempts[job_id] = self._attempts.get(job_id, 0) + 1
        sid = f"aitrainsai-{run}-{slug}-{attempt}"
        self._journal({"job_id": job_id, "submission_id": sid, "at": time.time()})
        return sid

    async def _run(self, payload: JobPayload, handle: JobHandle) -> JobResult:
        job_id, sid = payload.job_id, handle.data["submission_id"]
        job_dir = Path(handle.data["job_dir"])
        need = handle.data["need"]
        try:
            try:
                entrypoint_resources = await self._feasible(payload)
            except _Refused as exc:
                return JobResult.dead(job_id, "infra", str(exc))
            if job_id in self._cancelled:
                return JobResult.dead(job_id, "cancelled", "cancelled while queued")
            try:
                await self._queue.wait(job_id, payload.expected_s, need)
            except asyncio.CancelledError:
                if job_id in self._cancelled and not self._closed:
                    return JobResult.dead(job_id, "cancelled", "cancelled while queued")
                raise
            try:
                if job_id in self._cancelled:
                    return JobResult.dead(job_id, "cancelled", "cancelled before it started")
                try:
                    runtime_env, wheels = await self._runtime_env(payload)
                except _Refused as exc:
                    return JobResult.dead(job_id, "infra", str(exc))
                try:
                    await asyncio.to_thread(self._prepare, payload, job_dir, wheels)
                except (OSError, ValueError) as exc:
                    return JobResult.dead(job_id, "infra", f"the workdir cannot be shipped to {job_dir}: {_line(exc)}")
                self._live[job_id] = (sid, job_dir)
                try:
                    await asyncio.to_thread(self._submit_job, payload, sid, job_dir, entrypoint_resources,
                                            runtime_env)
                except Exception as exc:  # noqa: BLE001 - refused by Ray or the network: one line
                    return JobResult.dead(job_id, "infra", f"Ray refused the job: {_line(exc)}")
                return await self._follow(handle, list(payload.secrets.values()))
            finally:
                self._live.pop(job_id, None)
                self._release(need)
        finally:
            _forget_env(job_dir)

    async def _runtime_env(self, payload: JobPayload) -> tuple[dict[str, Any] | None, Path | None]:
        """Ray's runtime env for the payload's distributions (``runtime_env='pip'``), and the folder of the wheels
        built here for those installed from a local folder (once per runtime). Distributions in ``no_deps`` are not
        in it: the runner installs them into the runtime env's virtualenv without their dependencies."""
        runtime = payload.runtime
        if self.config.runtime_env == "none" or not runtime.distributions:
            return None, None
        try:
            folder = (await self._wheels.get(runtime)).folder
        except (WheelError, OSError, subprocess.SubprocessError) as exc:
            raise _Refused(f"the runtime's wheels could not be built here: {_line(exc)}") from None
        packages = [f"{name}{spec}" for name, spec in sorted(runtime.distributions.items())
                    if name not in runtime.no_deps]
        # a virtualenv needs one package to install; pip is in it already
        options = ["--disable-pip-version-check", "--find-links", str(folder), *self.config.pip_args]
        return {"pip": {"packages": packages or ["pip"], "pip_install_options": options}}, folder

    def _prepare(self, payload: JobPayload, job_dir: Path, wheels: Path | None = None) -> None:
        """The job's folder on shared storage: the workdir's copy, the runner, the spec and the environment."""
        source = Path(payload.workdir)
        source.mkdir(parents=True, exist_ok=True)  # as the local backend: none means empty
        for path in source.rglob("*"):
            if path.is_symlink():
                raise ValueError(f"{path.relative_to(source)} is a symbolic link: a payload's files travel as files")
        if job_dir.exists():
            shutil.rmtree(job_dir)
        job_dir.mkdir(parents=True)
        shutil.copytree(source, job_dir / "work")
        shutil.copyfile(RUNNER, job_dir / "runner.py")
        spec = {"command": payload.command, "timeout_s": payload.timeout_s, "kill_grace_s": self.config.kill_grace_s,
                "distributions": payload.runtime.distributions, "disk_gb": payload.disk_gb, "shm_gb": payload.shm_gb}
        if wheels is not None and payload.runtime.no_deps:
            spec["install_no_deps"] = {name: payload.runtime.distributions[name] for name in payload.runtime.no_deps}
            spec["pip_options"] = ["--find-links", str(wheels), *self.config.pip_args]
        (job_dir / "spec.json").write_text(json.dumps(spec))
        env = {**payload.env, **payload.secrets}
        descriptor = os.open(job_dir / "env.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(env, handle)

    def _entrypoint(self, job_dir: Path) -> str:
        work = shlex.quote(str(job_dir / "work"))
        missing = shlex.quote(f"aitrainsai: {job_dir} is not on this node: set gpu_backend.ray.shared_dir to a "
                              "folder that every node and the orchestrator share")
        python = shlex.join(shlex.split(self._python))
        return f"cd {work} 2>/dev/null || {{ echo {missing}; exit {NO_FOLDER}; }}; exec {python} ../runner.py"

    def _submit_job(self, payload: JobPayload, sid: str, job_dir: Path, resources: dict[str, float],
                    runtime_env: dict[str, Any] | None = None) -> None:
        assert self._client is not None
        self._client.submit_job(
            entrypoint=self._entrypoint(job_dir), submission_id=sid, runtime_env=runtime_env,
            metadata={"aitrainsai_job_id": payload.job_id[:200]},
            entrypoint_num_cpus=self.config.cpus_per_job, entrypoint_num_gpus=payload.gpus,
            entrypoint_memory=int(payload.memory_gb * 2**30) if payload.memory_gb else None,
            entrypoint_resources=resources or None)

    async def _follow(self, handle: JobHandle, secrets: list[str], *, reattached: bool = False) -> JobResult:
        """Poll the job until it ends; stop it when cancelled or long past its time; then say how it ended."""
        job_id, data = handle.job_id, handle.data
        sid, job_dir = data["submission_id"], Path(data["job_dir"])
        timeout_s = float(data.get("timeout_s", 0.0))
        silent_since: float | None = None
        while True:
            if job_id in self._cancelled and sid not in self._stopping:
                await self._stop(sid, job_dir, "cancelled")
            try:
                assert self._client is not None  # set by start()
                info = await asyncio.to_thread(self._client.get_job_info, sid)
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
                    return JobResult.dead(job_id, "lost", f"the Ray cluster at {self.url} did not answer for "
                                                          f"{self.config.unreachable_s:g} s")
                await asyncio.sleep(self.config.poll_s)
                continue
            status = str(getattr(info.status, "value", info.status))
            if status in TERMINAL:
                break
            started = _mtime(job_dir / "pid")
            if (status == "RUNNING" and started is not None and sid not in self._stopping
                    and time.time() > started + timeout_s + self.config.timeout_grace_s):
                await self._stop(sid, job_dir, "timeout")
            await asyncio.sleep(self.config.poll_s)
        result = await self._ended(handle, info, status, secrets, reattached)
        await asyncio.to_thread(self._settle, job_dir, result)
        return result

    def _settle(self, job_dir: Path, result: JobResult) -> None:
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

    async def _ended(self, handle: JobHandle, info: Any, status: str, secrets: list[str],
                     reattached: bool) -> JobResult:
        job_id, data = handle.job_id, handle.data
        sid, job_dir = data["submission_id"], Path(data["job_dir"])
        outcome = _read_json(job_dir / "outcome.json")
        tail = await self._log_tail(sid, secrets)
        started = _mtime(job_dir / "pid")
        ended = outcome.get("ended") or (info.end_time / 1000 if info.end_time else time.time())
        wall_s = max(0.0, ended - (outcome.get("started") or started or ended))
        code = outcome.get("code", info.driver_exit_code)
        if isinstance(code, int) and 128 < code < 192 and "code" not in outcome:
            code = 128 - code  # the runner's own death by signal N
        common = {"exit_code": code, "wall_s": wall_s, "log_tail": tail}
        suffix = " (reattached)" if reattached else ""
        stopped = self._stopping.pop(sid, None) or _read_text(job_dir / "stopped_by")
        if job_id in self._cancelled:
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
            if error in LOST_ERRORS or await self._node_died(info):
                return JobResult.dead(job_id, "lost", f"its worker vanished: {_line(info.message or error)[:300]}",
                                      **common)
            if error in INFRA_ERRORS:
                return JobResult.dead(job_id, "infra", f"Ray could not run it: {_line(info.message or error)[:300]}",
                                      **common)
            if code == NO_FOLDER and not outcome:
                return JobResult.dead(job_id, "infra", f"its folder {job_dir} is not on the node: set "
                                                       "gpu_backend.ray.shared_dir to a folder every node shares",
                                      **common)
            return JobResult.dead(job_id, *_failure(code), **common)
        try:
            found = await asyncio.to_thread(self._fetch, job_dir / "work", data.get("artifacts", {}),
                                            Path(data["workdir"]))
        except _Missing as exc:
            return JobResult.dead(job_id, "artifact", str(exc), **common)
        return JobResult(job_id=job_id, status="done", artifacts=found, **common)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        data = handle.data
        sid = data.get("submission_id")
        if not sid or not data.get("job_dir") or self._client is None:
            return JobResult.dead(handle.job_id, "lost", "this backend never issued the handle")
        need = data.get("need", {})
        job_dir = Path(data["job_dir"])
        recorded = _read_json(job_dir / "result.json")
        if recorded:  # it ended and was collected before: its result stands
            return JobResult.model_validate(recorded)
        self._take(need)  # a running job holds its share of the cluster
        self._live[handle.job_id] = (sid, job_dir)
        try:
            return await self._follow(handle, [], reattached=True)
        finally:
            self._live.pop(handle.job_id, None)
            self._release(need)
            _forget_env(job_dir)

    async def _stop(self, sid: str, job_dir: Path, why: str, *, ask_ray: bool = True) -> None:
        """Ask Ray to stop the job (SIGTERM, SIGKILL 3 s later), noting why in its folder for a later reader."""
        self._stopping.setdefault(sid, why)
        with contextlib.suppress(OSError):
            if job_dir.is_dir() and not (job_dir / "stopped_by").exists():
                (job_dir / "stopped_by").write_text(why)
        if not ask_ray or self._client is None:
            return
        with contextlib.suppress(Exception):  # gone already, or the cluster is away: the poll says which
            await asyncio.to_thread(self._client.stop_job, sid)

    async def _log_tail(self, sid: str, secrets: list[str]) -> str:
        try:
            assert self._client is not None  # set by start()
            text = await asyncio.to_thread(self._client.get_job_logs, sid)
        except Exception:  # noqa: BLE001 - a log that cannot be read is no reason to lose the result
            return ""
        return blank_secrets(text[-LOG_TAIL_CHARS:], secrets)

    async def _node_died(self, info: Any) -> bool:
        node_id = getattr(info, "driver_node_id", None)
        if not node_id or self._state is None:
            return False
        with contextlib.suppress(Exception):
            nodes = await asyncio.to_thread(_list_nodes, self._state)
            return any(n.node_id == node_id and n.state != "ALIVE" for n in nodes)
        return False

    def _fetch(self, work: Path, artifacts: dict[str, str], local: Path) -> dict[str, Path]:
        """Copy the job's artifacts into the payload's workdir here. Agent code wrote them, and whatever can write
        the job's folder may change them meanwhile: they are copied by file descriptor, no link followed at any
        level, regular files and folders only, within the caps (:mod:`.artifacts`), into a scratch folder here, and
        only then moved into place."""
        from aitrainsai_backend_ray.artifacts import Refused, copy_artifacts

        local.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".ray-artifacts-", dir=local.parent))
        try:
            try:
                copy_artifacts(work, artifacts, scratch, max_bytes=int(self.config.max_artifact_mb * 2**20),
                               max_files=self.config.max_artifact_files)
            except Refused as exc:
                raise _Missing(str(exc)) from None
            found = {}
            for index, (name, relative) in enumerate(artifacts.items()):
                target = local / relative
                if target.is_symlink() or target.is_file():
                    target.unlink()
                elif target.is_dir():
                    shutil.rmtree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(scratch / str(index) / relative, target)
                found[name] = target
            return found
        except OSError as exc:
            raise _Missing(f"the artifacts could not be copied: {_line(exc)}") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # -- the cluster and the local queue -------------------------------------------------------------------------------
    async def _refresh_nodes(self) -> None:
        nodes = await asyncio.to_thread(_list_nodes, self._state)
        self._nodes = [dict(n.resources_total or {}) for n in nodes if n.state == "ALIVE"]

    def _totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for node in self._nodes:
            for key in ("CPU", "GPU", "memory"):
                totals[key] = totals.get(key, 0.0) + node.get(key, 0.0)
        return totals

    async def _feasible(self, payload: JobPayload) -> dict[str, float]:
        """The custom resources the job asks Ray for (a GPU model); ``_Refused`` when no node could run it."""
        if payload.runtime.image:
            raise _Refused(f"the Ray backend runs no container images yet (runtime.image {payload.runtime.image!r})")
        problem, resources = self._unmet(payload)
        if problem:  # nodes may have joined since: look once more
            with contextlib.suppress(Exception):
                await self._refresh_nodes()
            problem, resources = self._unmet(payload)
        if problem:
            raise _Refused(problem)
        return resources

    def _unmet(self, payload: JobPayload) -> tuple[str, dict[str, float]]:
        if not self._nodes:
            return "the Ray cluster has no live node", {}
        need = self._need(payload)
        wanted_type = (payload.gpu_type or "").lower()
        for node in self._nodes:
            if any(node.get(key, 0.0) < value for key, value in need.items()):
                continue
            if not wanted_type:
                return "", {}
            types = sorted(k for k in node if k.startswith("accelerator_type:") and wanted_type in k.lower())
            if types:
                return "", {types[0]: 0.001}  # Ray's way to ask for a GPU model
        most = {key: max(node.get(key, 0.0) for node in self._nodes) for key in ("CPU", "GPU", "memory")}
        if payload.gpus > most["GPU"] or (payload.gpu_type and payload.gpus == 0):
            kind = f" {payload.gpu_type}" if payload.gpu_type else ""
            return (f"the payload needs {max(payload.gpus, 1)}{kind} GPU(s); no node of the Ray cluster has them "
                    f"(the largest has {most['GPU']:g} GPU(s))"), {}
        if payload.gpu_type:
            types = sorted({k.split(":", 1)[1] for node in self._nodes for k in node if
                            k.startswith("accelerator_type:")})
            return f"the payload needs a {payload.gpu_type} GPU; the Ray cluster has {', '.join(types) or 'none'}", {}
        if payload.memory_gb and payload.memory_gb * 2**30 > most["memory"]:
            return (f"the payload needs {payload.memory_gb:g} GB of memory; no node of the Ray cluster has it (the "
                    f"largest has {most['memory'] / 2**30:.1f} GB for jobs)"), {}
        return (f"no node of the Ray cluster has {self.config.cpus_per_job:g} CPU(s) and the payload's other needs "
                f"(the largest has {most['CPU']:g} CPU(s))"), {}

    def _fits(self, need: dict[str, float]) -> bool:
        """Whether the cluster has room for ``need`` beside the jobs this backend runs; an idle cluster takes any
        job (one that fits no node was refused before it queued)."""
        totals = self._totals()
        busy = any(self._used.values())
        return not busy or all(self._used.get(k, 0.0) + v <= totals.get(k, 0.0) + 1e-9 for k, v in need.items())

    def _take(self, need: dict[str, float]) -> None:
        for key, value in need.items():
            self._used[key] = self._used.get(key, 0.0) + value

    def _release(self, need: dict[str, float]) -> None:
        for key, value in need.items():
            self._used[key] = max(0.0, self._used.get(key, 0.0) - value)
        self._queue.dispatch()

    # -- records -------------------------------------------------------------------------------------------------------
    def _journal(self, entry: dict[str, Any]) -> None:
        """Append to ``submissions.jsonl`` (flushed to disk) and the run's ledger: a submission id is never unknown
        to the run, nor reused."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "submissions.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self.record is not None:
            self.record("ray_job", **entry)

    def _journal_entries(self) -> list[dict[str, Any]]:
        try:
            lines = (self.workdir / "submissions.jsonl").read_text().splitlines()
        except OSError:
            return []
        entries = []
        for line in lines:
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
        return [e for e in entries if isinstance(e, dict)]


class _Missing(Exception):
    """An artifact is missing or refused: the job is dead, reason ``artifact``."""


def _clients(url: str) -> tuple[JobSubmissionClient, StateApiClient]:
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import StateApiClient

    from aitrainsai_backend_ray.cluster import without_address_variables

    class TimedClient(JobSubmissionClient):
        """Ray's client sends its requests with no timeout: one to a dashboard that accepted the connection and
        never answers (a head coming back up) would hang its poll for ever. A timeout is an ``OSError`` here."""

        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
            return super()._do_request(method, endpoint, **kwargs)

    with without_address_variables():
        return TimedClient(url), StateApiClient(address=url)


def _list_nodes(state) -> list:
    from ray.util.state.common import ListApiOptions, StateResource

    return state.list(StateResource.NODES, options=ListApiOptions(detail=False), raise_on_missing_output=False)


def _failure(code: int | None) -> tuple[DeadReason, str]:
    if code is None:
        return "failed", "failed without an exit code"
    if code == -9:
        return "oom", "killed by SIGKILL (most likely out of memory)"
    if code < 0:
        return "failed", f"killed by signal {-code}"
    return "failed", f"exit code {code}"


def _forget_env(job_dir: Path) -> None:
    """The secrets' file goes once the job has ended, whether or not its runner read it."""
    with contextlib.suppress(OSError):
        (job_dir / "env.json").unlink()


def _read_json(path: Path) -> dict[str, Any]:
    """A small record in a job's folder (shared storage: anything that can write there may have written it), read
    capped, no link followed, depth-checked; {} for anything else."""
    from aitrainsai import read_json

    try:
        value = read_json(path, max_bytes=MAX_RECORD_BYTES)
    except ValueError:  # UntrustedInputError included: missing, a link, too big, too deep, not JSON
        return {}
    return value if isinstance(value, dict) else {}


MAX_RECORD_BYTES = 65_536  # outcome.json, result.json: an exit code, times, a reason


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


def _line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())[:500]
