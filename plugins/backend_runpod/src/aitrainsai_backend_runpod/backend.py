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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from aitrainsai import (PYTHON, BackendUnavailable, ComponentConfig, DeadReason, GpuBackend, JobHandle, JobPayload,
                        JobQueue, JobResult, TaskPerJob, WheelCache, WheelError, blank_secrets)
from pydantic import Field, field_validator

from aitrainsai_backend_runpod import api as runpod_api
from aitrainsai_backend_runpod.keeper import start_command
from aitrainsai_backend_runpod.ssh import ArtifactError, Ssh, SshError, make_key, pack, unpack

LOG_TAIL_BYTES = 4_000
SSH_FAILURES_BEFORE_GONE = 3
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "MemoryError", "Killed process")
CLOSE_TIMEOUT_S = 15.0
"""The longest ``close()`` takes: terminate calls (in parallel, each request cut at CLOSE_REQUEST_TIMEOUT_S and
retried) until 3 s before it, then the SSH connections' ends. A pod it could not confirm terminated stays so in
``pods.jsonl``: the next start or ``aitrainsai runpod reap`` terminates it; it deletes itself after ``deadman_s``."""
CLOSE_REQUEST_TIMEOUT_S = 4.0
EXIT_RECORD = re.compile(rb"[0-9]{1,3}")


class RunpodConfig(ComponentConfig):
    api_key_env: str = Field("RUNPOD_API_KEY", description="the environment variable holding the API key")
    api_base_url: str | None = Field(None, description="GraphQL base URL; None: $RUNPOD_API_BASE_URL or the SDK's")
    rest_url: str = Field("https://rest.runpod.io/v1", description="REST API a pod calls to delete itself")
    gpu_types: list[str] = Field(["NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "NVIDIA A100 80GB PCIe"],
                                 min_length=1, description="GPU type ids, in order of preference")
    data_centers: list[str] = Field(default_factory=list, description="data centre ids in order; empty: any")
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    container_disk_gb: int = Field(50, ge=5)
    volume_gb: int = Field(0, ge=0)
    memory_gb: int = Field(32, ge=1, description="host memory a pod must have (its shared memory is at most this)")
    min_pods: int = Field(0, ge=0, description="pods kept however idle")
    max_pods: int = Field(16, ge=1, le=64, description="pods at most; start() boots this many")
    boot_timeout_s: float = Field(900.0, gt=0, description="a pod not answering SSH by then is replaced")
    boot_attempts: int = Field(3, ge=1, description="pod creations or boots that may fail per pod wanted")
    idle_timeout_s: float = Field(600.0, gt=0, description="an idle pod beyond min_pods is terminated after this")
    lost_retries: int = Field(1, ge=0, description="a job whose pod vanishes mid-job runs again on another pod this "
                                                   "many times (an infrastructure failure) before it is reported lost")
    ssh_user: str = "root"
    ssh_timeout_s: float = Field(10.0, gt=0, description="SSH connect timeout")
    remote_root: str = Field("aitrainsai", description="the backend's folder on a pod (relative: under its home)")
    python: str = Field("python3", description="the pod's interpreter for payloads without a runtime")
    pip_args: list[str] = Field(default_factory=list, description="extra pip arguments for runtime installs")
    ship_local_wheels: bool = Field(True, description="build wheels of a runtime's distributions installed here from "
                                                      "a local folder (not on an index) and install them from those")
    deadman_s: float = Field(900.0, ge=2, description="a pod with no heartbeat this long deletes itself")
    max_usd: float | None = Field(None, gt=0, description="stop launching jobs once the pool has cost this much")
    poll_s: float = Field(5.0, gt=0, description="seconds between pool ticks (one pod listing each)")
    wait_s: float = Field(30.0, gt=0, description="a job poll waits on the pod this long for the exit code")
    api_retries: int = Field(5, ge=0)
    backoff_s: float = Field(2.0, ge=0)
    max_artifact_mb: float = Field(2048.0, gt=0)
    name_prefix: str = Field("aitrainsai", pattern=r"^[a-z][a-z0-9-]{0,30}$")

    @field_validator("remote_root")
    @classmethod
    def _plain_root(cls, value: str) -> str:
        if not value or any(c in value for c in "'\"`$\\ \n;&|<>*?"):
            raise ValueError(f"remote_root {value!r}: a plain path (no spaces or shell characters)")
        return value.rstrip("/")


class PodGone(Exception):
    """The pod running a job vanished, was outbid or stopped answering."""


@dataclass
class Pod:
    id: str
    name: str
    created_at: float
    cost_per_hr: float = 0.0
    gpu: str = ""
    state: Literal["booting", "ready", "busy", "gone"] = "booting"
    ssh: Ssh | None = None
    job: str | None = None
    idle_since: float = field(default_factory=time.time)
    beat_at: float = 0.0
    ended_at: float | None = None
    why_gone: str = ""
    ssh_failures: int = 0
    runtimes: set[str] = field(default_factory=set)
    adopted: bool = False  # created by an earlier orchestrator of this run
    leftovers: dict[str, bool] = field(default_factory=dict)  # its jobs' folders here: job id -> finished
    reserved: set[str] = field(default_factory=set)  # those still running: the pod waits for their reattachment

    def held_s(self, now: float) -> float:
        return max(0.0, (self.ended_at or now) - self.created_at)


class RunpodBackend(TaskPerJob, GpuBackend):
    """Jobs on a warm pool of Runpod pods over SSH (see the module docstring)."""

    name = "runpod"
    description = "a warm pool of Runpod GPU pods; jobs over SSH; no pod left billing"
    Config = RunpodConfig

    def __init__(self, config: RunpodConfig, *, workdir: Path):
        super().__init__(config, workdir=workdir)
        self.config: RunpodConfig = config
        self.pods: dict[str, Pod] = {}
        self._api: runpod_api.RunpodApi | None = None
        self._public_key = ""
        # a job needs an idle pod (what it asks for is its job id) and gets that pod
        self._queue: JobQueue[str, Pod] = JobQueue(self._has_idle_pod, self._take_idle_pod, refusal=self._refusal)
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        self._monitor: asyncio.Task | None = None
        self._started = False
        self._closed = False
        self._create_failures = 0
        self._gave_up = ""
        self._job_cost = 0.0
        self._wake = asyncio.Event()
        self._next_index = 0
        self._creating: dict[asyncio.Future, str] = {}  # create calls in flight -> name (a thread outlives a cancel)
        self._wheels = WheelCache(self.workdir / "wheels", enabled=config.ship_local_wheels)

    # -- the GpuBackend interface -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_pods

    @property
    def run_tag(self) -> str:
        """The run's id (the backend folder's parent), part of every pod name."""
        return self.workdir.resolve().parent.name or "run"

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
        if self._started:
            return
        key = os.environ.get(self.config.api_key_env, "").strip()
        if not key:
            raise BackendUnavailable(f"no Runpod API key: set {self.config.api_key_env}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._public_key = make_key(self.workdir / "ssh" / "id_ed25519")
        self._api = runpod_api.RunpodApi(key, base_url=self.config.api_base_url, retries=self.config.api_retries,
                                         backoff_s=self.config.backoff_s)
        try:
            await self._boot()
        except runpod_api.ApiError as exc:
            await self.close()
            raise BackendUnavailable(str(exc)) from None
        except BaseException:
            await self.close()
            raise

    async def _boot(self) -> None:
        assert self._api is not None
        runs_dir = self.workdir.resolve().parent.parent
        if (runs_dir / "ledger.sqlite").exists():  # pods of this ledger's runs that no process runs any more
            from aitrainsai_backend_runpod.reaper import reap

            await self._call(reap, self._api, runs_dir, prefix=self.config.name_prefix)
        listed = {p.id: p for p in await self._call(self._api.list_pods)}  # also checks the key
        known = await self._call(self._api.gpu_type_ids)
        unknown = [gpu for gpu in self.config.gpu_types if gpu not in known]
        if unknown:  # a typo: one line now, not a pool that keeps failing to create pods
            raise runpod_api.UnknownGpuType(
                f"Runpod has no GPU type {', '.join(map(repr, unknown))} (gpu_backend.runpod.gpu_types); it lists: "
                f"{', '.join(known) or 'none'}")
        for record in self._records():  # pods an earlier orchestrator of this run created
            info = listed.get(record["pod_id"])
            if record.get("terminated") or info is None or info.gone:
                continue
            pod = Pod(id=info.id, name=info.name, created_at=record["created_at"], cost_per_hr=info.cost_per_hr,
                      gpu=info.gpu, adopted=True)
            self.pods[pod.id] = pod
        self._started = True
        await self._tick(listed=list(listed.values()))
        self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def close(self) -> None:
        """Terminate every pod of the run: those in memory and in ``pods.jsonl``, those whose creation was in flight,
        and any the API lists under the run's pod names; all at once, within :data:`CLOSE_TIMEOUT_S` however slow
        the API or a pod's SSH. Queued and running jobs end (a resumed run reruns them)."""
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
        self._queue.close()
        for task in self._tasks.values():
            if not task.done():
                task.cancel()
        if self._api is None:
            return
        api = self._api
        api.stop.set()  # other calls stop retrying
        began = time.monotonic()
        until = began + CLOSE_TIMEOUT_S - 3
        ended: set[str] = set()

        async def end(pod_id: str, name: str | None = None) -> None:
            if pod_id in ended:
                return
            ended.add(pod_id)
            if name is not None and pod_id not in self.pods and pod_id not in {r["pod_id"] for r in self._records()}:
                self._record({"pod_id": pod_id, "name": name, "created_at": time.time(), "found": "at close"})
            await self._terminate(pod_id, "the run closed the pool", until=until)

        async def stragglers() -> None:
            """Pods the run's records may not hold: created by a call still in flight, or by one whose answer was
            lost; the listing also catches a pod whose creation was cut by the cancel."""
            creating = [future for future in self._creating if not future.done()]
            listing = in_thread(functools.partial(api.list_pods_by, until, CLOSE_REQUEST_TIMEOUT_S))
            if creating:
                await asyncio.wait(creating, timeout=max(0.0, until - time.monotonic()))
            late = [(f.result(), name) for f, name in self._creating.items()
                    if f.done() and not f.cancelled() and f.exception() is None]
            await asyncio.gather(*(end(pod_id, name) for pod_id, name in late), return_exceptions=True)
            head = f"{self.config.name_prefix}-{self.run_tag}-p"
            listed = await listing
            await asyncio.gather(*(end(p.id, p.name) for p in listed if p.name.startswith(head)),
                                 return_exceptions=True)

        ids = {p.id for p in self.pods.values() if p.state != "gone"}
        ids |= {r["pod_id"] for r in self._records() if not r.get("terminated")}
        work = asyncio.gather(*(end(pod_id) for pod_id in ids), stragglers(), return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(work, CLOSE_TIMEOUT_S - (time.monotonic() - began))

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
            self._tasks[payload.job_id] = asyncio.ensure_future(self._run(payload, handle))
        return handle

    async def cancel(self, handle: JobHandle) -> None:
        job_id = handle.job_id
        if not self._note_cancel(job_id):
            return
        self._queue.cancel(job_id)
        pod = next((p for p in self.pods.values() if p.job == job_id), None)
        if pod is not None:  # the exit record ends the job's long poll at once
            await self._try(pod, f"{self._job_dir(job_id)} && kill -9 -- -$(cat pid) 2>/dev/null; "
                                 "echo cancelled > rc; true")

    # -- cost ----------------------------------------------------------------------------------------------------------
    def spent_usd(self) -> float:
        """What the run's pods have cost so far (held seconds times their hourly price)."""
        now = time.time()
        return sum(p.cost_per_hr * p.held_s(now) / 3600 for p in self.pods.values())

    def costs(self) -> dict[str, float]:
        """The pool's dollars in all, and idle (booting, waiting, between jobs): held time not spent in a job."""
        total = self.spent_usd()
        return {"pool_usd": total, "idle_usd": max(0.0, total - self._job_cost)}

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

    def _job_dir(self, job_id: str) -> str:
        return f"cd {self.config.remote_root}/jobs/{shlex.quote(job_id)}"

    async def _run(self, payload: JobPayload, handle: JobHandle) -> JobResult:
        losses = 0
        while True:
            try:
                pod = await self._slot(payload)
            except _Refused as exc:
                return JobResult.dead(payload.job_id, exc.reason, str(exc))
            except asyncio.CancelledError:
                if payload.job_id in self._cancelled and not self._closed:
                    return JobResult.dead(payload.job_id, "cancelled", "cancelled while queued")
                raise
            try:
                return await self._execute(pod, payload, handle)
            except PodGone as exc:
                losses += 1
                if losses > self.config.lost_retries:
                    runs = f" (run {losses} times)" if losses > 1 else ""
                    return JobResult.dead(payload.job_id, "lost", f"{exc}{runs}")
            finally:
                self._release(pod)

    async def _slot(self, payload: JobPayload) -> Pod:
        """Wait for an idle pod (:class:`JobQueue`: longer expected jobs first); the pool grows for the queue."""
        self._wake.set()
        return await self._queue.wait(payload.job_id, payload.expected_s, payload.job_id)

    def _idle_pods(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.state == "ready" and not p.reserved]

    def _has_idle_pod(self, job_id: str) -> bool:
        return bool(self._idle_pods())

    def _take_idle_pod(self, job_id: str) -> Pod:
        pod = self._idle_pods()[0]
        pod.state, pod.job = "busy", job_id
        return pod

    def _refusal(self) -> _Refused | None:
        """What ends every queued job at once: the budget spent, or no pod left after the pool gave up."""
        if self.config.max_usd is not None and self.spent_usd() >= self.config.max_usd:
            return _Refused("budget", f"the pool has spent ${self.spent_usd():.2f} of its max_usd "
                                      f"${self.config.max_usd:.2f}")
        if self._gave_up and not any(p.state in ("booting", "ready", "busy") for p in self.pods.values()):
            return _Refused("infra", self._gave_up)
        return None

    def _release(self, pod: Pod) -> None:
        if pod.state == "busy":
            pod.state, pod.job, pod.idle_since = "ready", None, time.time()
        self._queue.dispatch()

    async def _execute(self, pod: Pod, payload: JobPayload, handle: JobHandle) -> JobResult:
        """Ship, launch and follow one job: one SSH session uploads and starts it, long polls wait for its exit
        code, one session reads how it ended, one fetches its artifacts and cleans up (round trips cost more on a
        remote pod than anything else here)."""
        assert pod.ssh is not None
        job_id = payload.job_id
        if job_id in self._cancelled:
            return JobResult.dead(job_id, "cancelled", "cancelled before it started")
        started = time.monotonic()
        python = shlex.quote(self.config.python)
        env = {**payload.env, **payload.secrets}
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items() if _env_name(k))
        try:
            Path(payload.workdir).mkdir(parents=True, exist_ok=True)  # as the local backend: none means empty
            # the workdir under work/, and the environment (secrets too) in env.sh, mode 0600, which the runner
            # reads and deletes before the command starts
            files = pack(Path(payload.workdir), prefix="work", extra={"env.sh": exports.encode()})
        except (OSError, ValueError) as exc:
            return JobResult.dead(job_id, "infra", f"the workdir cannot be shipped: {exc}")
        try:
            if payload.runtime.distributions:
                runtime, problem = await self._install(pod, payload)
                if problem:
                    return JobResult.dead(job_id, "infra", problem, wall_s=time.monotonic() - started)
                python = f'"$AITRAINSAI_ROOT/envs/{runtime}/bin/python"'
            command = " ".join(python if i == 0 and part == PYTHON else shlex.quote(part)
                               for i, part in enumerate(payload.command))
            runner = (f"echo $$ > ../pid; set -a; . ../env.sh; rm -f ../env.sh; set +a; "
                      f"timeout -k 10 {payload.timeout_s:.0f} {command}; "
                      f"echo $? > ../rc.partial; mv ../rc.partial ../rc")
            job = shlex.quote(job_id)
            # only the runner goes to the background (braces): a background list reads its stdin from /dev/null
            launch = (f"mkdir -p {self.config.remote_root}/jobs && cd {self.config.remote_root} && "
                      f"export AITRAINSAI_ROOT=\"$(pwd)\" && rm -rf jobs/{job} && mkdir jobs/{job} && cd jobs/{job} "
                      f"&& tar -x && cd work && "
                      f"{{ setsid nohup sh -c {shlex.quote(runner)} > ../log 2>&1 < /dev/null & }}")
            await self._ssh(pod, launch, stdin=files, timeout_s=600)
            handle.data.update({"pod_id": pod.id, "pod_name": pod.name, "started_at": time.time(),
                                "cost_per_hr": pod.cost_per_hr})
            return await self._follow(pod, job_id, payload.timeout_s, payload.artifacts, Path(payload.workdir),
                                      started, list(payload.secrets.values()))
        except SshError as exc:
            raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None

    async def _follow(self, pod: Pod, job_id: str, timeout_s: float, artifacts: dict[str, str], local: Path,
                      started: float, secrets: list[str], reattached: bool = False) -> JobResult:
        """Wait for the job's exit code (long polls of up to ``wait_s``), then read how it ended, fetch its
        artifacts and clean its folder."""
        deadline = time.monotonic() + timeout_s + 60
        ticks = max(1, int(self.config.wait_s / 0.2))
        wait = (f"touch {self.config.remote_root}/heartbeat; {self._job_dir(job_id)} || {{ echo missing; exit; }}; "
                f"i=0; while [ ! -f rc ] && [ $i -lt {ticks} ]; do sleep 0.2; i=$((i+1)); done; "
                "if [ -f rc ]; then head -c 16 rc | tr -cd 'a-z0-9'; else echo running; fi")
        while True:
            if pod.state == "gone":
                raise PodGone(f"pod {pod.id} {pod.why_gone or 'vanished'} while running job {job_id}")
            if job_id in self._cancelled:
                await self._try(pod, f"{self._job_dir(job_id)} && kill -9 -- -$(cat pid) 2>/dev/null; true")
                tail = await self._log_tail(pod, job_id, secrets)
                await self._clean(pod, job_id)
                return JobResult.dead(job_id, "cancelled", "cancelled while running", wall_s=time.monotonic() - started,
                                      log_tail=tail)
            try:
                probe = await self._ssh(pod, wait, timeout_s=self.config.wait_s + 60)
                pod.ssh_failures = 0
            except SshError as exc:
                pod.ssh_failures += 1
                if pod.ssh_failures >= SSH_FAILURES_BEFORE_GONE:
                    with contextlib.suppress(runpod_api.ApiError):  # unconfirmed: close() or the next start tries again
                        await self._terminate(pod.id, f"stopped answering SSH ({exc})")
                    raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None
                await asyncio.sleep(self.config.poll_s)
                continue
            state = probe.stdout.decode(errors="replace").strip()
            if job_id in self._cancelled:
                continue  # ended by cancel(): the top of the loop reports it
            if state == "missing":
                return JobResult.dead(job_id, "lost",
                                      f"job {job_id} is not on pod {pod.id} (never started, or cleaned)")
            if state != "running":
                break
            if time.monotonic() > deadline:
                await self._try(pod, f"{self._job_dir(job_id)} && kill -9 -- -$(cat pid) 2>/dev/null; true")
                tail = await self._log_tail(pod, job_id, secrets)
                await self._clean(pod, job_id)
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s (killed by the backend)",
                                      wall_s=time.monotonic() - started, log_tail=tail)
        wall_s = time.monotonic() - started
        cost = pod.cost_per_hr * wall_s / 3600
        self._job_cost += cost
        try:  # how it ended, in one round trip, read from the job's files (never from its log)
            ended = await self._ssh(pod, self._ended_command(job_id, list(artifacts.values())), timeout_s=60)
        except SshError as exc:
            raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None
        code, present, tail = parse_ended(ended.stdout, len(artifacts))
        tail = blank_secrets(tail, secrets)
        if code is None or present is None:
            await self._clean(pod, job_id)
            first = ended.stdout.split(b"\n", 1)[0][:40].decode("utf-8", "replace")
            return JobResult.dead(job_id, "lost", f"unreadable exit record {first!r}", wall_s=wall_s, log_tail=tail,
                                  cost_usd=cost)
        common = {"exit_code": code, "wall_s": wall_s, "log_tail": tail, "cost_usd": cost}
        if code != 0:
            await self._clean(pod, job_id)
            if code == 124:
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s", **common)
            if code == 137 and wall_s >= timeout_s:
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s (killed)", **common)
            if code == 137 or any(marker in tail for marker in OOM_MARKERS):
                return JobResult.dead(job_id, "oom", f"exit code {code}: out of memory", **common)
            return JobResult.dead(job_id, "failed", f"exit code {code}" + (" (reattached)" if reattached else ""),
                                  **common)
        missing = [f"{name} ({path})" for (name, path), here in zip(artifacts.items(), present) if not here]
        if missing:
            await self._clean(pod, job_id)
            return JobResult.dead(job_id, "artifact", f"finished without its artifacts: {', '.join(missing)}", **common)
        try:
            found = await self._fetch(pod, job_id, artifacts, local)
        except _Missing as exc:
            return JobResult.dead(job_id, "artifact", str(exc), **common)
        return JobResult(job_id=job_id, status="done", artifacts=found, **common)

    def _ended_command(self, job_id: str, paths: list[str]) -> str:
        """A shell line printing, in fixed-format fields: the exit record (digits, at most 3; the file is cut at 8
        bytes and stripped of anything else), a line; one 0/1 per artifact path (there, and not a link), a line;
        then the log's last LOG_TAIL_BYTES. The log comes last, so nothing in it can pass for the fields."""
        checks = "".join(f"if [ -e {shlex.quote('work/' + p)} ] && [ ! -L {shlex.quote('work/' + p)} ]; "
                         "then printf 1; else printf 0; fi; " for p in paths)
        return (f"{self._job_dir(job_id)} && {{ head -c 8 rc 2>/dev/null | tr -cd '0-9'; echo; {checks}echo; "
                f"tail -c {LOG_TAIL_BYTES} log 2>/dev/null; }}")

    async def _clean(self, pod: Pod, job_id: str) -> None:
        await self._try(pod, f"rm -rf {self.config.remote_root}/jobs/{shlex.quote(job_id)}")

    async def _fetch(self, pod: Pod, job_id: str, artifacts: dict[str, str], local: Path) -> dict[str, Path]:
        """Fetch the artifacts as one tar and clean the job's folder in the same round trip; check every member
        (agent code wrote them) before anything lands in ``local``."""
        job = shlex.quote(job_id)
        if not artifacts:
            await self._clean(pod, job_id)
            return {}
        paths = " ".join(shlex.quote(p) for p in artifacts.values())
        cap = int(self.config.max_artifact_mb * 2**20)
        try:
            archive = await self._ssh(pod, f"cd {self.config.remote_root}/jobs/{job}/work && tar -cf - -- {paths}; "
                                           f"code=$?; cd ../.. && rm -rf {job}; exit $code", timeout_s=3600, cap=cap)
        except SshError as exc:
            await self._clean(pod, job_id)
            raise _Missing(f"artifacts could not be fetched: {exc}") from None
        if archive.code != 0:
            raise _Missing(f"artifacts could not be read on the pod: {' '.join(archive.stderr.split())[-300:]}")
        allowed = [PurePosixPath(p) for p in artifacts.values()]
        try:
            with tempfile.TemporaryDirectory(dir=local.parent if local.parent.exists() else None) as scratch:
                unpack(archive.stdout, Path(scratch), max_bytes=cap, allowed=allowed)
                found = {}
                for name, relative in artifacts.items():
                    source, target = Path(scratch) / relative, local / relative
                    if not source.exists() or source.is_symlink():
                        raise _Missing(f"finished without its artifacts: {name} ({relative})")
                    _replace(source, target)
                    found[name] = target
        except ArtifactError as exc:
            raise _Missing(f"artifacts refused: {exc}") from None
        except OSError as exc:
            raise _Missing(f"artifacts could not be stored here: {' '.join(str(exc).split())[:300]}") from None
        return found

    async def _install(self, pod: Pod, payload: JobPayload) -> tuple[str, str]:
        """Install the payload's distributions into a virtual environment on the pod, once per pod and runtime:
        those in ``no_deps`` without their dependencies, the wheels built here from local folders shipped along.
        Returns the runtime's key and a problem ("" when installed)."""
        try:
            built = await self._wheels.get(payload.runtime)
        except (WheelError, OSError, subprocess.SubprocessError) as exc:
            return "", f"the runtime's wheels could not be built here: {exc}"
        runtime, wheels = built.key, built.wheels
        if runtime in pod.runtimes:
            return runtime, ""
        distributions = payload.runtime.distributions
        no_deps = set(payload.runtime.no_deps)

        def specs(names) -> str:
            return " ".join(shlex.quote(f"{name}{distributions[name]}") for name in sorted(names))

        env = f"{self.config.remote_root}/envs/{runtime}"
        pip = f"{env}/bin/python -m pip install -q --find-links {env}.wheels " + " ".join(
            shlex.quote(a) for a in self.config.pip_args)
        installs = [f"{pip} --no-deps {specs(no_deps)}"] if no_deps else []
        if set(distributions) - no_deps:
            installs.append(f"{pip} {specs(set(distributions) - no_deps)}")
        # the wheels come on stdin, read (or discarded, when the runtime is there already) in the same session
        command = (f"set -o pipefail; if test -f {env}/.ready; then cat > /dev/null; exit 0; fi; "
                   f"rm -rf {env} {env}.wheels && mkdir -p {env}.wheels && tar -x -C {env}.wheels && "
                   f"{shlex.quote(self.config.python)} -m venv --system-site-packages {env} && "
                   f"{{ {' && '.join(installs)}; }} 2>&1 | tail -c 2000 && {env}/bin/python -c pass && "
                   f"touch {env}/.ready")
        result = await self._ssh(pod, f"bash -c {shlex.quote(command)}", stdin=_tar(list(wheels.values())),
                                 timeout_s=3600)
        if result.code != 0:
            text = " ".join((result.stdout.decode(errors="replace") + result.stderr).split())[-500:]
            return runtime, (f"the runtime ({specs(distributions)}) could not be installed on pod {pod.id}: "
                             f"{text or 'exit ' + str(result.code)}")
        pod.runtimes.add(runtime)
        return runtime, ""

    async def _log_tail(self, pod: Pod, job_id: str, secrets: list[str]) -> str:
        try:
            out = await self._ssh(pod, f"{self._job_dir(job_id)} && tail -c {LOG_TAIL_BYTES} log", timeout_s=60)
        except SshError:
            return ""
        return blank_secrets(out.stdout.decode("utf-8", "replace"), secrets)

    async def _reattach(self, handle: JobHandle) -> JobResult:
        data = handle.data
        if data.get("refused"):
            return JobResult.dead(handle.job_id, "infra", data["refused"])
        # The handle was stored when the job was submitted, before it had a pod: find the pod that holds it, once
        # every adopted pod has answered SSH (or been given up).
        while any(p.adopted and p.state == "booting" for p in self.pods.values()):
            await asyncio.sleep(self.config.poll_s / 2)
        pod = next((p for p in self.pods.values() if p.state != "gone" and handle.job_id in p.leftovers), None)
        if pod is None:
            return JobResult.dead(handle.job_id, "lost", "no pod of the run holds the job (its pod is gone, or it "
                                                         "never started)")
        while pod.state == "busy":  # the leftover's pod is reserved for it; a moment's overlap with a release
            await asyncio.sleep(self.config.poll_s / 2)
        pod.state, pod.job = "busy", handle.job_id
        pod.reserved.discard(handle.job_id)
        started = time.monotonic() - max(0.0, time.time() - data.get("started_at", time.time()))
        try:
            return await self._follow(pod, handle.job_id, data.get("timeout_s", 0.0), data.get("artifacts", {}),
                                      Path(data.get("workdir", self.workdir / "jobs" / handle.job_id)), started, [],
                                      reattached=True)
        except PodGone as exc:
            return JobResult.dead(handle.job_id, "lost", str(exc))
        finally:
            self._release(pod)

    async def _find_leftover_jobs(self, pod: Pod) -> None:
        """Jobs an earlier orchestrator left on an adopted pod; the pod runs nothing new while one still runs."""
        try:
            out = await self._ssh(pod, f"cd {self.config.remote_root}/jobs 2>/dev/null && for d in *; do "
                                       "[ -f \"$d/pid\" ] && "
                                       "{ [ -f \"$d/rc\" ] && echo \"$d done\" || echo \"$d running\"; }; "
                                       "done; true", timeout_s=60)
        except SshError:
            return
        pod.leftovers = {}
        for line in out.stdout.decode(errors="replace").splitlines():
            job_id, _, state = line.partition(" ")
            if job_id and state in ("done", "running"):
                pod.leftovers[job_id] = state == "done"
        pod.reserved = {job_id for job_id, finished in pod.leftovers.items() if not finished and job_id != pod.job}

    # -- the pool ------------------------------------------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)
            self._wake.clear()
            try:
                await self._tick()
            except runpod_api.ApiError:
                continue  # retried inside; the next tick tries again

    async def _tick(self, listed: list[runpod_api.PodInfo] | None = None) -> None:
        """One listing of the account's pods; boot deadlines, vanished pods, idle pods, heartbeats, growth."""
        assert self._api is not None
        if listed is None:
            listed = await self._call(self._api.list_pods)
        infos = {p.id: p for p in listed}
        now = time.time()
        over_budget = self.config.max_usd is not None and self.spent_usd() >= self.config.max_usd
        for pod in list(self.pods.values()):
            if pod.state == "gone":
                continue
            info = infos.get(pod.id)
            if info is None or info.gone:
                why = (info.last_status_change.split(":")[0].lower() if info and info.last_status_change
                       else "vanished")
                await self._terminate(pod.id, why)
                continue
            pod.cost_per_hr = info.cost_per_hr or pod.cost_per_hr
            pod.gpu = info.gpu or pod.gpu
            if pod.state == "booting":
                if info.ssh is not None:
                    await self._probe(pod, info.ssh)
                if pod.state == "booting" and now - pod.created_at > self.config.boot_timeout_s:
                    self._create_failures += 1
                    await self._terminate(pod.id, f"not reachable over SSH within {self.config.boot_timeout_s:g} s")
            elif pod.state == "ready":
                live = [p for p in self.pods.values() if p.state in ("booting", "ready", "busy")]
                if over_budget and not pod.reserved:
                    await self._terminate(pod.id, f"the pool reached max_usd ${self.config.max_usd:.2f}")
                elif (not self._queue and not pod.reserved and len(live) > self.config.min_pods
                        and now - pod.idle_since > self.config.idle_timeout_s):
                    await self._terminate(pod.id, "idle")
                elif now - pod.beat_at > self.config.deadman_s / 4:
                    await self._try(pod, f"touch {self.config.remote_root}/heartbeat")
                    pod.beat_at = now
                if pod.reserved:
                    await self._find_leftover_jobs(pod)
        await self._grow(infos)
        self._queue.dispatch()

    async def _grow(self, infos: dict[str, runpod_api.PodInfo]) -> None:
        """Create pods up to what is wanted: ``max_pods`` at start, then as many as queued work needs."""
        if self._closed or self._gave_up:
            return
        if self.config.max_usd is not None and self.spent_usd() >= self.config.max_usd:
            return
        live = [p for p in self.pods.values() if p.state in ("booting", "ready", "busy")]
        if self._tasks or self._queue:
            wanted = min(self.config.max_pods, max(self.config.min_pods, len(live) + len(self._queue)))
        else:
            wanted = self.config.max_pods if not any(True for _ in self._records()) else self.config.min_pods
        missing = wanted - len(live)
        if missing <= 0:
            return
        results = await asyncio.gather(*(self._create() for _ in range(missing)), return_exceptions=True)
        problems = [str(r) for r in results if isinstance(r, BaseException)]
        unknown = [r for r in results if isinstance(r, runpod_api.UnknownGpuType)]
        if unknown:  # not worth another try: queued jobs end with the reason
            self._gave_up = str(unknown[0])
        elif problems and self._create_failures >= self.config.boot_attempts * self.config.max_pods:
            self._gave_up = (f"could not get a Runpod pod after {self._create_failures} attempts "
                             f"(GPU types {', '.join(self.config.gpu_types)}; last: {problems[-1]})")

    async def _create(self) -> Pod:
        assert self._api is not None
        self._next_index = max(self._next_index, len(self._records()))
        name = f"{self.config.name_prefix}-{self.run_tag}-p{self._next_index:03d}"
        self._next_index += 1
        env = {"PUBLIC_KEY": self._public_key}
        docker_args = start_command(remote_root=self.config.remote_root, rest_url=self.config.rest_url,
                                    deadman_s=self.config.deadman_s)
        last: Exception | None = None
        data_centers: list[str | None] = [*self.config.data_centers] or [None]  # None: any
        for gpu_type in self.config.gpu_types:
            for data_center in data_centers:
                # the call's thread outlives a cancel: close() waits for it and terminates what it created
                creating = in_thread(functools.partial(
                    self._api.create_pod, name=name, image=self.config.image, gpu_type=gpu_type,
                    cloud_type=self.config.cloud_type, data_center=data_center,
                    container_disk_gb=self.config.container_disk_gb, volume_gb=self.config.volume_gb, env=env,
                    docker_args=docker_args))
                self._creating[creating] = name
                try:
                    pod_id = await asyncio.shield(creating)
                except asyncio.CancelledError:
                    raise  # left in _creating: close() terminates what the call created
                except runpod_api.NoCapacity as exc:
                    self._creating.pop(creating, None)
                    last = exc
                    continue
                except Exception as exc:
                    self._creating.pop(creating, None)
                    if isinstance(exc, runpod_api.ApiError) and not isinstance(exc, runpod_api.UnknownGpuType):
                        self._create_failures += 1
                    raise
                self._creating.pop(creating, None)
                pod = Pod(id=pod_id, name=name, created_at=time.time(), gpu=gpu_type)
                self.pods[pod_id] = pod
                self._record({"pod_id": pod_id, "name": name, "created_at": pod.created_at, "gpu_type": gpu_type,
                              "data_center": data_center})
                return pod
        self._create_failures += 1
        raise runpod_api.NoCapacity(f"no capacity for {', '.join(self.config.gpu_types)}: {last}")

    async def _probe(self, pod: Pod, address: tuple[str, int]) -> None:
        pod.ssh = Ssh(address[0], address[1], user=self.config.ssh_user, key=self.workdir / "ssh" / "id_ed25519",
                      known_hosts=self.workdir / "ssh" / f"known_hosts-{pod.id}",
                      connect_timeout_s=self.config.ssh_timeout_s)
        try:
            root = self.config.remote_root
            result = await pod.ssh.run(f"mkdir -p {root} && touch {root}/heartbeat",
                                       timeout_s=self.config.ssh_timeout_s + 20)
        except SshError:
            return
        if result.code == 0:
            if pod.adopted:
                await self._find_leftover_jobs(pod)
            pod.state, pod.idle_since, pod.beat_at = "ready", time.time(), time.time()

    async def _terminate(self, pod_id: str, why: str, *, until: float | None = None) -> None:
        """Terminate a pod through the API (``until``: a deadline for short, retried requests) and record it; its
        SSH connection ends after, whatever the call did."""
        pod = self.pods.get(pod_id)
        if pod is not None and pod.state != "gone":
            pod.state, pod.ended_at, pod.why_gone = "gone", time.time(), why
        try:
            if self._api is not None:
                if until is None:
                    await self._call(self._api.terminate, pod_id)
                else:
                    await self._call(self._api.terminate, pod_id, until=until, timeout_s=CLOSE_REQUEST_TIMEOUT_S)
            self._record({"pod_id": pod_id, "terminated": time.time(), "why": why})
        finally:
            if pod is not None and pod.ssh is not None:
                await pod.ssh.close(timeout_s=3)

    # -- helpers -------------------------------------------------------------------------------------------------------
    async def _call(self, function, *args, **kwargs):
        return await in_thread(functools.partial(function, *args, **kwargs))

    async def _ssh(self, pod: Pod, command: str, **kwargs):
        if pod.ssh is None:
            raise SshError(f"pod {pod.id} has no SSH address")
        return await pod.ssh.run(command, **kwargs)

    async def _try(self, pod: Pod, command: str) -> None:
        with contextlib.suppress(SshError):
            await self._ssh(pod, command, timeout_s=60)

    def _record(self, entry: dict[str, Any]) -> None:
        """Append to ``pods.jsonl`` and flush it to disk, and record it in the run's ledger where the session gave
        a way (``backend_pod`` events), before going on: a pod is never unknown to the run."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "pods.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self.record is not None:
            self.record("pod", **entry)

    def _records(self) -> list[dict[str, Any]]:
        """One entry per pod this run created: its creation, merged with its termination where recorded."""
        return read_pod_records(self.workdir)


def parse_ended(out: bytes, artifacts: int) -> tuple[int | None, list[bool] | None, str]:
    """The fields of :meth:`RunpodBackend._ended_command`'s output: the exit code (None: no readable record), which
    artifacts are there (None: not ``artifacts`` 0/1 marks), the log's tail."""
    record, _, rest = out.partition(b"\n")
    marks, _, tail = rest.partition(b"\n")
    code = int(record) if EXIT_RECORD.fullmatch(record) else None
    present = [m == ord("1") for m in marks] if re.fullmatch(rb"[01]*", marks) and len(marks) == artifacts else None
    return code, present, tail.decode("utf-8", "replace").removesuffix("\n")


def in_thread(function) -> asyncio.Future:
    """``function()`` in a daemon thread, as a future of this loop. An API call can block for its whole timeout; a
    daemon thread holds neither the loop's shutdown nor the interpreter's exit (``asyncio.to_thread``'s executor
    would: the stop of a run must not wait on a request)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, function())
        except BaseException as exc:  # handed to the awaiting task
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="runpod-api", daemon=True).start()
    return future


def read_pod_records(workdir: Path) -> list[dict[str, Any]]:
    pods: dict[str, dict[str, Any]] = {}
    try:
        lines = (Path(workdir) / "pods.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(entry, dict) and isinstance(entry.get("pod_id"), str):
            pods.setdefault(entry["pod_id"], {}).update(entry)
    return [p for p in pods.values() if "created_at" in p]


class _Refused(Exception):
    def __init__(self, reason: DeadReason, detail: str):
        super().__init__(detail)
        self.reason = reason


class _Missing(Exception):
    """An artifact is missing, unreadable or refused: the job is dead, reason ``artifact``."""


def _tar(files: list[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in files:
            archive.add(path, arcname=path.name, recursive=False)
    return buffer.getvalue()


def _env_name(name: str) -> bool:
    return name.replace("_", "a").isalnum() and not name[0].isdigit()


def _replace(source: Path, target: Path) -> None:
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(target))
