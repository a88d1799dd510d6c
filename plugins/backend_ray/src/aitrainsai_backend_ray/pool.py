"""The cluster as the Ray backend sees it: the dashboard's clients, the live nodes' resources, and the share of them
the backend's jobs hold. Payloads queue here (:class:`JobQueue`, longest expected first) and go to Ray only while the
cluster has the CPUs, GPUs and memory for them: Ray never holds a queue of ours."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from aitrainsai import JobPayload, JobQueue

from aitrainsai_backend_ray.config import RayConfig

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import StateApiClient

REQUEST_TIMEOUT_S = (5.0, 30.0)  # connect, read: a request to the dashboard that takes longer is a silent poll


class Refused(Exception):
    """The cluster cannot run the payload (one line): a dead job, reason ``infra``."""


class Pool:
    """The cluster at ``url``: its clients (once :meth:`connect` has run), its alive nodes' resources, what this
    backend's jobs hold of them, and the local queue of the jobs waiting for room."""

    def __init__(self, config: RayConfig):
        self.config = config
        self.url = ""
        self.client: JobSubmissionClient | None = None
        self.state: StateApiClient | None = None
        self.nodes: list[dict[str, float]] = []  # alive nodes' resources
        self.used: dict[str, float] = {}
        self.queue: JobQueue[dict[str, float], None] = JobQueue(self.fits, self.take)

    async def connect(self, url: str) -> None:
        """The clients of the dashboard at ``url``, and its nodes; raises what the cluster answers (or does not)."""
        self.url = url
        self.client, self.state = await asyncio.to_thread(_clients, url)
        await self.refresh()

    @property
    def capacity(self) -> int:
        """The cluster's GPUs where it has any (one GPU payload each), else its CPUs // ``cpus_per_job``; 1 before
        it is connected."""
        totals = self.totals()
        if totals.get("GPU", 0) >= 1:
            return int(totals["GPU"])
        return max(1, int(totals.get("CPU", 0) // self.config.cpus_per_job))

    async def refresh(self) -> None:
        nodes = await asyncio.to_thread(_list_nodes, self.state)
        self.nodes = [dict(n.resources_total or {}) for n in nodes if n.state == "ALIVE"]

    def totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for node in self.nodes:
            for key in ("CPU", "GPU", "memory"):
                totals[key] = totals.get(key, 0.0) + node.get(key, 0.0)
        return totals

    def need(self, payload: JobPayload) -> dict[str, float]:
        """What the payload holds of the cluster while it runs."""
        need = {"CPU": self.config.cpus_per_job, "GPU": float(payload.gpus)}
        if payload.memory_gb:
            need["memory"] = payload.memory_gb * 2**30
        return need

    async def feasible(self, payload: JobPayload) -> dict[str, float]:
        """The custom resources the job asks Ray for (a GPU model); :class:`Refused` when no node could run it."""
        if payload.runtime.image:
            raise Refused(f"the Ray backend runs no container images yet (runtime.image {payload.runtime.image!r})")
        problem, resources = self.unmet(payload)
        if problem:  # nodes may have joined since: look once more
            with contextlib.suppress(Exception):
                await self.refresh()
            problem, resources = self.unmet(payload)
        if problem:
            raise Refused(problem)
        return resources

    def unmet(self, payload: JobPayload) -> tuple[str, dict[str, float]]:
        if not self.nodes:
            return "the Ray cluster has no live node", {}
        need = self.need(payload)
        wanted_type = (payload.gpu_type or "").lower()
        for node in self.nodes:
            if any(node.get(key, 0.0) < value for key, value in need.items()):
                continue
            if not wanted_type:
                return "", {}
            types = sorted(k for k in node if k.startswith("accelerator_type:") and wanted_type in k.lower())
            if types:
                return "", {types[0]: 0.001}  # Ray's way to ask for a GPU model
        most = {key: max(node.get(key, 0.0) for node in self.nodes) for key in ("CPU", "GPU", "memory")}
        if payload.gpus > most["GPU"] or (payload.gpu_type and payload.gpus == 0):
            kind = f" {payload.gpu_type}" if payload.gpu_type else ""
            return (f"the payload needs {max(payload.gpus, 1)}{kind} GPU(s); no node of the Ray cluster has them "
                    f"(the largest has {most['GPU']:g} GPU(s))"), {}
        if payload.gpu_type:
            types = sorted({k.split(":", 1)[1] for node in self.nodes for k in node if
                            k.startswith("accelerator_type:")})
            return f"the payload needs a {payload.gpu_type} GPU; the Ray cluster has {', '.join(types) or 'none'}", {}
        if payload.memory_gb and payload.memory_gb * 2**30 > most["memory"]:
            return (f"the payload needs {payload.memory_gb:g} GB of memory; no node of the Ray cluster has it (the "
                    f"largest has {most['memory'] / 2**30:.1f} GB for jobs)"), {}
        return (f"no node of the Ray cluster has {self.config.cpus_per_job:g} CPU(s) and the payload's other needs "
                f"(the largest has {most['CPU']:g} CPU(s))"), {}

    def fits(self, need: dict[str, float]) -> bool:
        """Whether the cluster has room for ``need`` beside the jobs this backend runs; an idle cluster takes any
        job (one that fits no node was refused before it queued)."""
        totals = self.totals()
        busy = any(self.used.values())
        return not busy or all(self.used.get(k, 0.0) + v <= totals.get(k, 0.0) + 1e-9 for k, v in need.items())

    def take(self, need: dict[str, float]) -> None:
        for key, value in need.items():
            self.used[key] = self.used.get(key, 0.0) + value

    def release(self, need: dict[str, float]) -> None:
        for key, value in need.items():
            self.used[key] = max(0.0, self.used.get(key, 0.0) - value)
        self.queue.dispatch()

    async def node_died(self, info: Any) -> bool:
        """Whether the node that ran a job's driver (``info``: Ray's job info) is no longer alive."""
        node_id = getattr(info, "driver_node_id", None)
        if not node_id or self.state is None:
            return False
        with contextlib.suppress(Exception):
            nodes = await asyncio.to_thread(_list_nodes, self.state)
            return any(n.node_id == node_id and n.state != "ALIVE" for n in nodes)
        return False


def line(exc: BaseException | str) -> str:
    """An error (or a text) on one line, at most 500 characters."""
    return " ".join(str(exc).split())[:500]


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
