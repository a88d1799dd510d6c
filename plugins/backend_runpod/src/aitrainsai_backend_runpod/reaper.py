"""Orphan pods: which of the account's pods belong to runs no process runs any more, and terminating them (the
backend at its start, and ``aitrainsai runpod reap``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PREFIX = "aitrainsai"


@dataclass
class Owned:
    pod_id: str
    name: str
    run_id: str | None  # None: not a pod of this prefix
    state: str  # "live", "dead" (its run is in this ledger and no process runs it), "unknown" (not in this ledger)
    cost_per_hr: float


def run_of(name: str, prefix: str = PREFIX) -> str | None:
    """The run id in a pod name ``<prefix>-<run id>-pNNN``, or None."""
    head = f"{prefix}-"
    if not name.startswith(head) or "-p" not in name[len(head):]:
        return None
    run_id, _, index = name[len(head):].rpartition("-p")
    return run_id if run_id and index.isdigit() else None


def classify(pods, runs_dir: Path, prefix: str = PREFIX) -> list[Owned]:
    """Each of the account's pods with the prefix, with whether its run (in ``runs_dir``) is live."""
    from aitrainsai import run_is_live

    owned = []
    for pod in pods:
        run_id = run_of(pod.name, prefix)
        if run_id is None:
            continue
        run_dir = Path(runs_dir) / run_id
        state = "unknown" if not run_dir.is_dir() else "live" if run_is_live(run_dir) else "dead"
        owned.append(Owned(pod.id, pod.name, run_id, state, pod.cost_per_hr))
    return owned


def reap(api, runs_dir: Path, *, prefix: str = PREFIX, unknown: bool = False,
         run_id: str | None = None) -> list[Owned]:
    """Terminate the prefix's pods whose run in ``runs_dir`` no process runs (and, with ``unknown``, those whose
    run this ledger does not hold; with ``run_id``, only that run's); record each termination in its run's
    ``pods.jsonl``. Returns them."""
    import time

    from aitrainsai import append_journal

    reaped = []
    for pod in classify(api.list_pods(), runs_dir, prefix):
        if run_id is not None and pod.run_id != run_id:
            continue
        if pod.state == "dead" or (unknown and pod.state == "unknown"):
            api.terminate(pod.pod_id)
            reaped.append(pod)
            backend_dir = Path(runs_dir) / str(pod.run_id) / "backend"
            if backend_dir.is_dir():
                append_journal(backend_dir / "pods.jsonl", {"pod_id": pod.pod_id, "terminated": time.time(),
                                                            "why": "reaped: its run is not running"})
    return reaped
