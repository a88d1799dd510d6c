"""``aitrainsai runpod``: list the account's pods by run, and reap the ones no live run owns."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

import click

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


def run_is_live(run_dir: Path) -> bool:
    """A process holds the run's orchestrator lock (see :meth:`aitrainsai.ledger.Run.hold`)."""
    from aitrainsai.ledger import LOCK_NAME

    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def classify(pods, runs_dir: Path, prefix: str = PREFIX) -> list[Owned]:
    """Each of the account's pods with the prefix, with whether its run (in ``runs_dir``) is live."""
    owned = []
    for pod in pods:
        run_id = run_of(pod.name, prefix)
        if run_id is None:
            continue
        run_dir = Path(runs_dir) / run_id
        state = "unknown" if not run_dir.is_dir() else "live" if run_is_live(run_dir) else "dead"
        owned.append(Owned(pod.id, pod.name, run_id, state, pod.cost_per_hr))
    return owned


def reap(api, runs_dir: Path, *, prefix: str = PREFIX, unknown: bool = False) -> list[Owned]:
    """Terminate the prefix's pods whose run in ``runs_dir`` no process runs (and, with ``unknown``, those whose
    run this ledger does not hold); record each termination in its run's ``pods.jsonl``. Returns them."""
    import json
    import time

    reaped = []
    for pod in classify(api.list_pods(), runs_dir, prefix):
        if pod.state == "dead" or (unknown and pod.state == "unknown"):
            api.terminate(pod.pod_id)
            reaped.append(pod)
            backend_dir = Path(runs_dir) / str(pod.run_id) / "backend"
            if backend_dir.is_dir():
                with open(backend_dir / "pods.jsonl", "a") as handle:
                    handle.write(json.dumps({"pod_id": pod.pod_id, "terminated": time.time(),
                                             "why": "reaped: its run is not running"}) + "\n")
    return reaped


def _api(key_env: str, base_url: str | None):
    from aitrainsai_backend_runpod.api import RunpodApi

    key = os.environ.get(key_env, "").strip()
    if not key:
        raise click.ClickException(f"no Runpod API key: set {key_env}")
    return RunpodApi(key, base_url=base_url)


def _runs_dir() -> Path:
    from aitrainsai.cli import State

    return click.get_current_context().ensure_object(State).runs_dir


@click.group("runpod")
def runpod_group() -> None:
    """Runpod pods of aitrainsai runs: list them, reap orphans."""


@runpod_group.command("pods")
@click.option("--api-key-env", default="RUNPOD_API_KEY", show_default=True)
@click.option("--api-base-url", default=None, help="GraphQL base URL (default: $RUNPOD_API_BASE_URL or Runpod's).")
@click.option("--prefix", default=PREFIX, show_default=True)
def pods_command(api_key_env: str, api_base_url: str | None, prefix: str) -> None:
    """List the account's pods of aitrainsai runs: pod, run, whether the run is live here, $/h."""
    from aitrainsai_backend_runpod.api import ApiError

    try:
        owned = classify(_api(api_key_env, api_base_url).list_pods(), _runs_dir(), prefix)
    except ApiError as exc:
        raise click.ClickException(str(exc)) from None
    for pod in owned:
        click.echo(f"{pod.pod_id}  {pod.name}  run {pod.run_id}: {pod.state}  ${pod.cost_per_hr:.2f}/h")
    if not owned:
        click.echo(f"no pods named {prefix}-*")


@runpod_group.command("reap")
@click.option("--api-key-env", default="RUNPOD_API_KEY", show_default=True)
@click.option("--api-base-url", default=None, help="GraphQL base URL (default: $RUNPOD_API_BASE_URL or Runpod's).")
@click.option("--prefix", default=PREFIX, show_default=True)
@click.option("--unknown", is_flag=True, help="Also terminate pods of runs this runs directory does not hold.")
def reap_command(api_key_env: str, api_base_url: str | None, prefix: str, unknown: bool) -> None:
    """Terminate pods named <prefix>-<run>-pNNN whose run no process is running (a killed orchestrator's)."""
    from aitrainsai_backend_runpod.api import ApiError

    try:
        reaped = reap(_api(api_key_env, api_base_url), _runs_dir(), prefix=prefix, unknown=unknown)
    except ApiError as exc:
        raise click.ClickException(str(exc)) from None
    for pod in reaped:
        click.echo(f"terminated {pod.pod_id} ({pod.name}): run {pod.run_id} is {pod.state}")
    click.echo(f"{len(reaped)} pod(s) terminated")
