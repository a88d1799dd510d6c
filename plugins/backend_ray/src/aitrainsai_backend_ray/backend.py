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

The rooms: :mod:`.config` (the options), :mod:`.pool` (the cluster's clients, nodes and the local queue),
:mod:`.submission` (a job's folder, runtime env and submission), :mod:`.follow` (following and reattaching a job,
how it ended), :mod:`.artifacts` (copying artifacts out of shared storage); this module wires them into the
:class:`GpuBackend`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitrainsai import ComponentConfig, GpuBackend, JobHandle, JobPayload, JobResult, TaskPerJob

from aitrainsai_backend_ray.config import RayConfig
from aitrainsai_backend_ray.follow import Follower, recorded_result
from aitrainsai_backend_ray.pool import Pool, Refused, line
from aitrainsai_backend_ray.submission import Submissions, forget_env

if TYPE_CHECKING:
    from aitrainsai_backend_ray.cluster import LocalCluster

CLOSE_STEP_S = 10.0  # close() waits at most this long for the jobs' stop requests, and again for their followers


class RayBackend(TaskPerJob, GpuBackend):
    """Payloads as Ray jobs through the job submission API (see the module docstring)."""

    name = "ray"
    description = "Ray jobs on a Ray cluster (or on a head it starts here); files through a shared folder"
    Config = RayConfig

    def __init__(self, config: RayConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self.config: RayConfig = config
        self.cluster: LocalCluster | None = None  # the LocalCluster this backend started
        self.pool = Pool(config)
        self.submissions = Submissions(config, self.pool, workdir=self.workdir, shared_dir=self.shared_dir,
                                       record=self._record_submission)
        self.follower = Follower(config, self.pool, self._cancelled)
        self._live: dict[str, tuple[str, Path]] = {}  # job id -> (submission id, job folder) of followed jobs
        self._closed = False
        self._started = False

    # -- the GpuBackend interface -------------------------------------------------------------------------------------
    @property
    def shared_dir(self) -> Path:
        return Path(self.config.shared_dir or self.workdir / "jobs").resolve()

    @property
    def url(self) -> str:
        """The cluster's dashboard (once started)."""
        return self.pool.url

    @property
    def capacity(self) -> int:
        """The cluster's GPUs where it has any (one GPU payload each), else its CPUs // ``cpus_per_job``; 1 before
        ``start()``."""
        return self.pool.capacity

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
            url = cluster.url
            if self.config.runtime_env == "none":
                self.submissions.python = self.config.python or sys.executable  # the head's workers run this
        else:
            url = await asyncio.to_thread(dashboard_url, self.config.address, self.config.dashboard_port)
        try:
            await self.pool.connect(url)
        except Exception as exc:
            await self.close()
            if isinstance(exc, ClusterError):
                raise
            raise ClusterError(f"the Ray cluster at {self.url} does not answer: {line(exc)}") from None
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
        self.pool.queue.close()
        if self._live:
            # the head this backend started goes below with its jobs: only note why they stopped
            ask_ray = self.pool.client is not None and self.cluster is None
            stops = [self.follower.stop(sid, job_dir, "closed", ask_ray=ask_ray)
                     for sid, job_dir in self._live.values()]
            await asyncio.wait([asyncio.ensure_future(stop) for stop in stops], timeout=CLOSE_STEP_S)
        cancelled = self._cancel_tasks()
        if cancelled:
            await asyncio.wait(cancelled, timeout=CLOSE_STEP_S)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
            self.cluster = None

    async def submit(self, payload: JobPayload) -> JobHandle:
        """Queue ``payload``. A job id may come again once its earlier run has ended; it gets a new submission id."""
        self._admit(payload.job_id)
        sid = self.submissions.new_id(payload.job_id)
        need = self.pool.need(payload)
        data = {"submission_id": sid, "job_dir": str(self.shared_dir / sid),
                "workdir": str(Path(payload.workdir).resolve()), "timeout_s": payload.timeout_s,
                "artifacts": payload.artifacts, "need": need, "submitted_at": time.time()}
        handle = JobHandle(backend=self.name, job_id=payload.job_id, data=data)
        self._follow_in_task(payload.job_id, self._run(payload, handle))
        return handle

    async def cancel(self, handle: JobHandle) -> None:
        job_id = handle.job_id
        if not self._note_cancel(job_id):
            return
        self.pool.queue.cancel(job_id)  # still queued here: it never reaches Ray
        sid, job_dir = self._live.get(job_id) or (handle.data.get("submission_id"), handle.data.get("job_dir"))
        if sid and job_dir and self.pool.client is not None:
            await self.follower.stop(sid, Path(job_dir), "cancelled")

    # -- jobs ----------------------------------------------------------------------------------------------------------
    async def _run(self, payload: JobPayload, handle: JobHandle) -> JobResult:
        job_id, sid = payload.job_id, handle.data["submission_id"]
        job_dir = Path(handle.data["job_dir"])
        need = handle.data["need"]
        try:
            try:
                entrypoint_resources = await self.pool.feasible(payload)
            except Refused as exc:
                return JobResult.dead(job_id, "infra", str(exc))
            if job_id in self._cancelled:
                return JobResult.dead(job_id, "cancelled", "cancelled while queued")
            try:
                await self.pool.queue.wait(job_id, payload.expected_s, need)
            except asyncio.CancelledError:
                if job_id in self._cancelled and not self._closed:
                    return JobResult.dead(job_id, "cancelled", "cancelled while queued")
                raise
            try:
                if job_id in self._cancelled:
                    return JobResult.dead(job_id, "cancelled", "cancelled before it started")
                try:
                    runtime_env, wheels = await self.submissions.runtime_env(payload)
                except Refused as exc:
                    return JobResult.dead(job_id, "infra", str(exc))
                try:
                    await asyncio.to_thread(self.submissions.prepare, payload, job_dir, wheels)
                except (OSError, ValueError) as exc:
                    return JobResult.dead(job_id, "infra", f"the workdir cannot be shipped to {job_dir}: {line(exc)}")
                self._live[job_id] = (sid, job_dir)
                try:
                    await asyncio.to_thread(self.submissions.submit, payload, sid, job_dir, entrypoint_resources,
                                            runtime_env)
                except Exception as exc:  # noqa: BLE001 - refused by Ray or the network: one line
                    return JobResult.dead(job_id, "infra", f"Ray refused the job: {line(exc)}")
                return await self.follower.follow(handle, list(payload.secrets.values()))
            finally:
                self._live.pop(job_id, None)
                self.pool.release(need)
        finally:
            forget_env(job_dir)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        data = handle.data
        sid = data.get("submission_id")
        if not sid or not data.get("job_dir") or self.pool.client is None:
            return JobResult.dead(handle.job_id, "lost", "this backend never issued the handle")
        need = data.get("need", {})
        job_dir = Path(data["job_dir"])
        recorded = recorded_result(job_dir)
        if recorded is not None:  # it ended and was collected before: its result stands
            return recorded
        self.pool.take(need)  # a running job holds its share of the cluster
        self._live[handle.job_id] = (sid, job_dir)
        try:
            return await self.follower.follow(handle, [], reattached=True)
        finally:
            self._live.pop(handle.job_id, None)
            self.pool.release(need)
            forget_env(job_dir)

    def _record_submission(self, entry: dict[str, Any]) -> None:
        """A submission id, in the run's ledger as well as ``submissions.jsonl``: never unknown to the run."""
        if self.record is not None:
            self.record("ray_job", **entry)
