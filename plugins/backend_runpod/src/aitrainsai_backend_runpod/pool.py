"""The Runpod backend's pool: its pods, from creation to termination, and the queue of jobs waiting for one.

Pods are created with the real ``runpod`` SDK (:mod:`.api`) and named ``<prefix>-<run id>-pNNN``; every pod id is
appended to ``pods.jsonl`` in the backend's folder (and recorded as a ledger event) the moment the API returns it, so
no pod is ever unknown to the run. A pod counts as ready only once an SSH command succeeds on it; one that is not
ready within ``boot_timeout_s`` is terminated and replaced. One ``get_pods`` listing per tick watches them all.
Payloads queue longest-expected first (:class:`JobQueue`) and each gets an idle pod. ``terminate_all`` ends every
pod of the run, in parallel and within :data:`CLOSE_TIMEOUT_S` whatever the API or a pod's SSH does; a pod whose
orchestrator never returns deletes itself (:mod:`.keeper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aitrainsai import DeadReason, JobPayload, JobQueue, append_journal, read_journal

from aitrainsai_backend_runpod import api as runpod_api
from aitrainsai_backend_runpod.config import RunpodConfig
from aitrainsai_backend_runpod.keeper import start_command
from aitrainsai_backend_runpod.ssh import Ssh, SshError, SshResult

CLOSE_TIMEOUT_S = 15.0
"""The longest ``close()`` takes: terminate calls (in parallel, each request cut at CLOSE_REQUEST_TIMEOUT_S and
retried) until 3 s before it, then the SSH connections' ends. A pod it could not confirm terminated stays so in
``pods.jsonl``: the next start or ``aitrainsai runpod reap`` terminates it; it deletes itself after ``deadman_s``."""
CLOSE_REQUEST_TIMEOUT_S = 4.0


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


class Refusal(Exception):
    """What ends every queued job at once (the budget spent, no pod left): its reason and one line."""

    def __init__(self, reason: DeadReason, detail: str):
        super().__init__(detail)
        self.reason = reason


class Pool:
    """The run's pods (``pods``: id -> :class:`Pod`) and the queue of jobs waiting for an idle one. ``has_jobs`` says
    whether the backend was given any job (the pool then grows for the queue, else to ``max_pods`` at the start);
    ``on_record`` writes each ``pods.jsonl`` entry into the run's ledger as well."""

    def __init__(self, config: RunpodConfig, workdir: Path, *, has_jobs: Callable[[], bool],
                 on_record: Callable[[dict[str, Any]], None]):
        self.config = config
        self.workdir = workdir
        self.has_jobs = has_jobs
        self.on_record = on_record
        self.pods: dict[str, Pod] = {}
        self.api: runpod_api.RunpodApi | None = None
        self.public_key = ""
        # a job needs an idle pod (what it asks for is its job id) and gets that pod
        self.queue: JobQueue[str, Pod] = JobQueue(self._has_idle_pod, self._take_idle_pod, refusal=self._refusal)
        self.monitor: asyncio.Task | None = None
        self.started = False
        self.closed = False
        self.gave_up = ""
        self.job_cost = 0.0
        self._create_failures = 0
        self._wake = asyncio.Event()
        self._next_index = 0
        self._creating: dict[asyncio.Future, str] = {}  # create calls in flight -> name (a thread outlives a cancel)

    @property
    def run_tag(self) -> str:
        """The run's id (the backend folder's parent), part of every pod name."""
        return self.workdir.resolve().parent.name or "run"

    async def boot(self) -> None:
        """Reap orphans, adopt this run's pods, check the GPU types, then the first tick and the monitor."""
        assert self.api is not None
        runs_dir = self.workdir.resolve().parent.parent
        if (runs_dir / "ledger.sqlite").exists():  # pods of this ledger's runs that no process runs any more
            from aitrainsai_backend_runpod.reaper import reap

            await self.call(reap, self.api, runs_dir, prefix=self.config.name_prefix)
        listed = {p.id: p for p in await self.call(self.api.list_pods)}  # also checks the key
        known = await self.call(self.api.gpu_type_ids)
        unknown = [gpu for gpu in self.config.gpu_types if gpu not in known]
        if unknown:  # a typo: one line now, not a pool that keeps failing to create pods
            raise runpod_api.UnknownGpuType(
                f"Runpod has no GPU type {', '.join(map(repr, unknown))} (gpu_backend.runpod.gpu_types); it lists: "
                f"{', '.join(known) or 'none'}")
        for record in self.records():  # pods an earlier orchestrator of this run created
            info = listed.get(record["pod_id"])
            if record.get("terminated") or info is None or info.gone:
                continue
            pod = Pod(id=info.id, name=info.name, created_at=record["created_at"], cost_per_hr=info.cost_per_hr,
                      gpu=info.gpu, adopted=True)
            self.pods[pod.id] = pod
        self.started = True
        await self.tick(listed=list(listed.values()))
        self.monitor = asyncio.ensure_future(self.monitor_loop())

    def halt(self) -> None:
        """The first step of a close: no more ticks, and the queued jobs' waits end."""
        self.closed = True
        if self.monitor is not None:
            self.monitor.cancel()
        self.queue.close()

    async def terminate_all(self) -> None:
        """Terminate every pod of the run: those in memory and in ``pods.jsonl``, those whose creation was in flight,
        and any the API lists under the run's pod names; all at once, within :data:`CLOSE_TIMEOUT_S` however slow
        the API or a pod's SSH."""
        if self.api is None:
            return
        api = self.api
        api.stop.set()  # other calls stop retrying
        began = time.monotonic()
        until = began + CLOSE_TIMEOUT_S - 3
        ended: set[str] = set()

        async def end(pod_id: str, name: str | None = None) -> None:
            if pod_id in ended:
                return
            ended.add(pod_id)
            if name is not None and pod_id not in self.pods and pod_id not in {r["pod_id"] for r in self.records()}:
                self.record({"pod_id": pod_id, "name": name, "created_at": time.time(), "found": "at close"})
            await self.terminate(pod_id, "the run closed the pool", until=until)

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
        ids |= {r["pod_id"] for r in self.records() if not r.get("terminated")}
        work = asyncio.gather(*(end(pod_id) for pod_id in ids), stragglers(), return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(work, CLOSE_TIMEOUT_S - (time.monotonic() - began))

    def spent_usd(self) -> float:
        """What the run's pods have cost so far (held seconds times their hourly price)."""
        now = time.time()
        return sum(p.cost_per_hr * p.held_s(now) / 3600 for p in self.pods.values())

    async def slot(self, payload: JobPayload) -> Pod:
        """Wait for an idle pod (:class:`JobQueue`: longer expected jobs first); the pool grows for the queue."""
        self._wake.set()
        return await self.queue.wait(payload.job_id, payload.expected_s, payload.job_id)

    def _idle_pods(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.state == "ready" and not p.reserved]

    def _has_idle_pod(self, job_id: str) -> bool:
        return bool(self._idle_pods())

    def _take_idle_pod(self, job_id: str) -> Pod:
        pod = self._idle_pods()[0]
        pod.state, pod.job = "busy", job_id
        return pod

    def _refusal(self) -> Refusal | None:
        """What ends every queued job at once: the budget spent, or no pod left after the pool gave up."""
        if self.config.max_usd is not None and self.spent_usd() >= self.config.max_usd:
            return Refusal("budget", f"the pool has spent ${self.spent_usd():.2f} of its max_usd "
                                      f"${self.config.max_usd:.2f}")
        if self.gave_up and not any(p.state in ("booting", "ready", "busy") for p in self.pods.values()):
            return Refusal("infra", self.gave_up)
        return None

    def release(self, pod: Pod) -> None:
        if pod.state == "busy":
            pod.state, pod.job, pod.idle_since = "ready", None, time.time()
        self.queue.dispatch()

    async def find_leftover_jobs(self, pod: Pod) -> None:
        """Jobs an earlier orchestrator left on an adopted pod; the pod runs nothing new while one still runs."""
        try:
            out = await self.ssh(pod, f"cd {self.config.remote_root}/jobs 2>/dev/null && for d in *; do "
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

    async def monitor_loop(self) -> None:
        while not self.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)
            self._wake.clear()
            try:
                await self.tick()
            except runpod_api.ApiError:
                continue  # retried inside; the next tick tries again

    async def tick(self, listed: list[runpod_api.PodInfo] | None = None) -> None:
        """One listing of the account's pods; boot deadlines, vanished pods, idle pods, heartbeats, growth."""
        assert self.api is not None
        if listed is None:
            listed = await self.call(self.api.list_pods)
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
                await self.terminate(pod.id, why)
                continue
            pod.cost_per_hr = info.cost_per_hr or pod.cost_per_hr
            pod.gpu = info.gpu or pod.gpu
            if pod.state == "booting":
                if info.ssh is not None:
                    await self._probe(pod, info.ssh)
                if pod.state == "booting" and now - pod.created_at > self.config.boot_timeout_s:
                    self._create_failures += 1
                    await self.terminate(pod.id, f"not reachable over SSH within {self.config.boot_timeout_s:g} s")
            elif pod.state == "ready":
                live = [p for p in self.pods.values() if p.state in ("booting", "ready", "busy")]
                if over_budget and not pod.reserved:
                    await self.terminate(pod.id, f"the pool reached max_usd ${self.config.max_usd:.2f}")
                elif (not self.queue and not pod.reserved and len(live) > self.config.min_pods
                        and now - pod.idle_since > self.config.idle_timeout_s):
                    await self.terminate(pod.id, "idle")
                elif now - pod.beat_at > self.config.deadman_s / 4:
                    await self.ssh_quietly(pod, f"touch {self.config.remote_root}/heartbeat")
                    pod.beat_at = now
                if pod.reserved:
                    await self.find_leftover_jobs(pod)
        await self._grow(infos)
        self.queue.dispatch()

    async def _grow(self, infos: dict[str, runpod_api.PodInfo]) -> None:
        """Create pods up to what is wanted: ``max_pods`` at start, then as many as queued work needs."""
        if self.closed or self.gave_up:
            return
        if self.config.max_usd is not None and self.spent_usd() >= self.config.max_usd:
            return
        live = [p for p in self.pods.values() if p.state in ("booting", "ready", "busy")]
        if self.has_jobs() or self.queue:
            wanted = min(self.config.max_pods, max(self.config.min_pods, len(live) + len(self.queue)))
        else:
            wanted = self.config.max_pods if not any(True for _ in self.records()) else self.config.min_pods
        missing = wanted - len(live)
        if missing <= 0:
            return
        results = await asyncio.gather(*(self._create() for _ in range(missing)), return_exceptions=True)
        problems = [str(r) for r in results if isinstance(r, BaseException)]
        unknown = [r for r in results if isinstance(r, runpod_api.UnknownGpuType)]
        if unknown:  # not worth another try: queued jobs end with the reason
            self.gave_up = str(unknown[0])
        elif problems and self._create_failures >= self.config.boot_attempts * self.config.max_pods:
            self.gave_up = (f"could not get a Runpod pod after {self._create_failures} attempts "
                             f"(GPU types {', '.join(self.config.gpu_types)}; last: {problems[-1]})")

    async def _create(self) -> Pod:
        assert self.api is not None
        self._next_index = max(self._next_index, len(self.records()))
        name = f"{self.config.name_prefix}-{self.run_tag}-p{self._next_index:03d}"
        self._next_index += 1
        env = {"PUBLIC_KEY": self.public_key}
        docker_args = start_command(remote_root=self.config.remote_root, rest_url=self.config.rest_url,
                                    deadman_s=self.config.deadman_s)
        last: Exception | None = None
        data_centers: list[str | None] = [*self.config.data_centers] or [None]  # None: any
        for gpu_type in self.config.gpu_types:
            for data_center in data_centers:
                # the call's thread outlives a cancel: close() waits for it and terminates what it created
                creating = in_thread(functools.partial(
                    self.api.create_pod, name=name, image=self.config.image, gpu_type=gpu_type,
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
                self.record({"pod_id": pod_id, "name": name, "created_at": pod.created_at, "gpu_type": gpu_type,
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
                await self.find_leftover_jobs(pod)
            pod.state, pod.idle_since, pod.beat_at = "ready", time.time(), time.time()

    async def terminate(self, pod_id: str, why: str, *, until: float | None = None) -> None:
        """Terminate a pod through the API (``until``: a deadline for short, retried requests) and record it; its
        SSH connection ends after, whatever the call did."""
        pod = self.pods.get(pod_id)
        if pod is not None and pod.state != "gone":
            pod.state, pod.ended_at, pod.why_gone = "gone", time.time(), why
        try:
            if self.api is not None:
                if until is None:
                    await self.call(self.api.terminate, pod_id)
                else:
                    await self.call(self.api.terminate, pod_id, until=until, timeout_s=CLOSE_REQUEST_TIMEOUT_S)
            self.record({"pod_id": pod_id, "terminated": time.time(), "why": why})
        finally:
            if pod is not None and pod.ssh is not None:
                await pod.ssh.close(timeout_s=3)

    def cd_job(self, job_id: str) -> str:
        return f"cd {self.config.remote_root}/jobs/{shlex.quote(job_id)}"

    async def kill(self, pod: Pod, job_id: str, *, then: str = "true") -> None:
        """Kill the job's process group on the pod (SIGKILL), then run ``then`` in its folder."""
        await self.ssh_quietly(pod, f"{self.cd_job(job_id)} && kill -9 -- -$(cat pid) 2>/dev/null; {then}")

    async def clean(self, pod: Pod, job_id: str) -> None:
        await self.ssh_quietly(pod, f"rm -rf {self.config.remote_root}/jobs/{shlex.quote(job_id)}")

    async def call(self, function, *args, **kwargs):
        return await in_thread(functools.partial(function, *args, **kwargs))

    async def ssh(self, pod: Pod, command: str, **kwargs) -> SshResult:
        if pod.ssh is None:
            raise SshError(f"pod {pod.id} has no SSH address")
        return await pod.ssh.run(command, **kwargs)

    async def ssh_quietly(self, pod: Pod, command: str) -> None:
        with contextlib.suppress(SshError):
            await self.ssh(pod, command, timeout_s=60)

    def record(self, entry: dict[str, Any]) -> None:
        """Append to ``pods.jsonl`` and flush it to disk, and record it in the run's ledger where the session gave
        a way (``backend_pod`` events), before going on: a pod is never unknown to the run."""
        append_journal(self.workdir / "pods.jsonl", entry)
        self.on_record(entry)

    def records(self) -> list[dict[str, Any]]:
        """One entry per pod this run created: its creation, merged with its termination where recorded."""
        return read_pod_records(self.workdir)


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
    """One entry per pod of ``pods.jsonl`` in ``workdir`` (the backend's folder): its creation, merged with its
    termination where recorded."""
    pods: dict[str, dict[str, Any]] = {}
    for entry in read_journal(Path(workdir) / "pods.jsonl"):
        if isinstance(entry.get("pod_id"), str):
            pods.setdefault(entry["pod_id"], {}).update(entry)
    return [p for p in pods.values() if "created_at" in p]
