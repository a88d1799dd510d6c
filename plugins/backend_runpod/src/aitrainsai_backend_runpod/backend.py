"""The Runpod backend: a warm pool of GPU pods, one job at a time on each, jobs over SSH.

Pods are created with the real ``runpod`` SDK (:mod:`.api`) and named ``<prefix>-<run id>-pNNN``; every pod id is
appended to ``pods.jsonl`` in the backend's folder (and recorded as a ledger event) the moment the API returns it, so
no pod is ever unknown to the run. A pod counts as ready only once an SSH command succeeds on it; one that is not
ready within ``boot_timeout_s`` is terminated and replaced. Payloads queue longest-expected first and each runs on an
idle pod: its workdir goes up as a tar over SSH, its runtime is installed once per pod (a virtual environment keyed by
the runtime), its command runs under ``timeout`` with ``nohup`` in a process group, and one ``get_pods`` listing per
tick plus an SSH poll per running job watch it. Artifacts come back as a tar that is checked member by member.

A pod that vanishes, is outbid or stops answering SSH during a job has the job retried once on another pod (an
infrastructure failure; never because of a score); a second loss is a dead job. ``close()`` terminates every pod of
the run, in parallel and within :data:`CLOSE_TIMEOUT_S` whatever the API or a pod's SSH does, also after errors,
SIGINT and SIGTERM; a killed orchestrator leaves its pods running, and a resumed run adopts them and reattaches to
their jobs; a pod whose orchestrator never returns deletes itself (:mod:`.keeper`).

What comes back from a pod is data, never instructions: how a job ended is read from its own files (the exit record,
which artifacts exist) in fixed-format fields ahead of the log's tail, so nothing the job prints can pass for them,
and fetched artifacts are unpacked member by member (:func:`.ssh.unpack`).

The rooms: :mod:`.config` (the options), :mod:`.pool` (the pods and the queue), :mod:`.follow` (a job on a pod:
launch, follow, reattach), :mod:`.artifacts` (fetching them); this module wires them into the :class:`GpuBackend`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

from aitrainsai import (BackendUnavailable, ComponentConfig, GpuBackend, JobHandle, JobPayload, JobResult, TaskPerJob,
                        WheelCache)

from aitrainsai_backend_runpod import api as runpod_api
from aitrainsai_backend_runpod.config import RunpodConfig
from aitrainsai_backend_runpod.follow import Jobs
from aitrainsai_backend_runpod.pool import PodGone, Pool, Refusal
from aitrainsai_backend_runpod.ssh import make_key


class RunpodBackend(TaskPerJob, GpuBackend):
    """Jobs on a warm pool of Runpod pods over SSH (see the module docstring)."""

    name = "runpod"
    description = "a warm pool of Runpod GPU pods; jobs over SSH; no pod left billing"
    Config = RunpodConfig

    def __init__(self, config: RunpodConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self.config: RunpodConfig = config
        self.pool = Pool(config, self.workdir, has_jobs=lambda: bool(self._tasks), on_record=self._record_pod)
        self.jobs = Jobs(config, self.pool, self._cancelled,
                         wheels=WheelCache(self.workdir / "wheels", enabled=config.ship_local_wheels))

    # -- the GpuBackend interface -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_pods

    @property
    def run_tag(self) -> str:
        """The run's id (the backend folder's parent), part of every pod name."""
        return self.pool.run_tag

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        assert isinstance(config, RunpodConfig)
        problems = []
        if not os.environ.get(config.api_key_env, "").strip():
            problems.append(f"no Runpod API key: set {config.api_key_env}")
        for tool in ("ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                problems.append(f"the Runpod backend runs jobs over SSH: install OpenSSH's client ({tool})")
        return problems

    async def start(self) -> None:
        """Reap orphans, adopt this run's pods, check the GPU types and boot the pool. A start that fails or is
        interrupted terminates whatever it created (the session closes only a started backend)."""
        if self.pool.started:
            return
        key = os.environ.get(self.config.api_key_env, "").strip()
        if not key:
            raise BackendUnavailable(f"no Runpod API key: set {self.config.api_key_env}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pool.public_key = make_key(self.workdir / "ssh" / "id_ed25519")
        self.pool.api = runpod_api.RunpodApi(key, base_url=self.config.api_base_url, retries=self.config.api_retries,
                                             backoff_s=self.config.backoff_s)
        try:
            await self.pool.boot()
        except runpod_api.ApiError as exc:
            await self.close()
            raise BackendUnavailable(str(exc)) from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Terminate every pod of the run: those in memory and in ``pods.jsonl``, those whose creation was in flight,
        and any the API lists under the run's pod names; all at once, within :data:`.pool.CLOSE_TIMEOUT_S` however
        slow the API or a pod's SSH. Queued and running jobs end (a resumed run reruns them)."""
        self.pool.halt()
        self._cancel_tasks()
        await self.pool.terminate_all()

    async def submit(self, payload: JobPayload) -> JobHandle:
        self._admit(payload.job_id)
        data = {"workdir": str(Path(payload.workdir).resolve()), "timeout_s": payload.timeout_s,
                "artifacts": payload.artifacts, "submitted_at": time.time()}
        refusal = self._unmet(payload)
        if refusal:
            data["refused"] = refusal
        handle = JobHandle(backend=self.name, job_id=payload.job_id, data=data)
        if refusal:
            self._refuse(payload.job_id, refusal)
        else:
            self._follow_in_task(payload.job_id, self._run(payload, handle))
        return handle

    async def cancel(self, handle: JobHandle) -> None:
        job_id = handle.job_id
        if not self._note_cancel(job_id):
            return
        self.pool.queue.cancel(job_id)
        pod = next((p for p in self.pool.pods.values() if p.job == job_id), None)
        if pod is not None:  # the exit record ends the job's long poll at once
            await self.pool.kill(pod, job_id, then="echo cancelled > rc; true")

    # -- cost ----------------------------------------------------------------------------------------------------------
    def spent_usd(self) -> float:
        """What the run's pods have cost so far (held seconds times their hourly price)."""
        return self.pool.spent_usd()

    def costs(self) -> dict[str, float]:
        """The pool's dollars in all, and idle (booting, waiting, between jobs): held time not spent in a job."""
        total = self.pool.spent_usd()
        return {"pool_usd": total, "idle_usd": max(0.0, total - self.pool.job_cost)}

    # -- jobs ----------------------------------------------------------------------------------------------------------
    def _unmet(self, payload: JobPayload) -> str:
        if payload.runtime.image and payload.runtime.image != self.config.image:
            return (f"the Runpod pool runs image {self.config.image}; the payload needs {payload.runtime.image} "
                    "(set gpu_backend.runpod.image)")
        if payload.gpus > 1:
            return f"the payload needs {payload.gpus} GPUs; the pool's pods have one each"
        if payload.gpu_type and not any(payload.gpu_type.lower() in t.lower() for t in self.config.gpu_types):
            return (f"the payload needs a {payload.gpu_type} GPU; the pool asks for "
                    f"{', '.join(self.config.gpu_types)}")
        if payload.memory_gb and payload.memory_gb > self.config.memory_gb:
            return (f"the payload needs {payload.memory_gb:g} GB of memory; the pool's pods have "
                    f"{self.config.memory_gb} GB")
        if payload.shm_gb and payload.shm_gb > self.config.memory_gb:
            return (f"the payload needs {payload.shm_gb:g} GB of shared memory; the pool's pods have at most "
                    f"{self.config.memory_gb} GB")
        if payload.disk_gb and payload.disk_gb > self.config.container_disk_gb:
            return (f"the payload needs {payload.disk_gb:g} GB of disk; the pool's pods have "
                    f"{self.config.container_disk_gb} GB")
        return ""

    async def _run(self, payload: JobPayload, handle: JobHandle) -> JobResult:
        losses = 0
        while True:
            try:
                pod = await self.pool.slot(payload)
            except Refusal as exc:
                return JobResult.dead(payload.job_id, exc.reason, str(exc))
            except asyncio.CancelledError:
                if payload.job_id in self._cancelled and not self.pool.closed:
                    return JobResult.dead(payload.job_id, "cancelled", "cancelled while queued")
                raise
            try:
                return await self.jobs.execute(pod, payload, handle)
            except PodGone as exc:
                losses += 1
                if losses > self.config.lost_retries:
                    runs = f" (run {losses} times)" if losses > 1 else ""
                    return JobResult.dead(payload.job_id, "lost", f"{exc}{runs}")
            finally:
                self.pool.release(pod)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        return await self.jobs.reattach(handle)

    def _record_pod(self, entry: dict[str, Any]) -> None:
        """A ``pods.jsonl`` entry, in the run's ledger as well (``backend_pod`` events)."""
        if self.record is not None:
            self.record("pod", **entry)
