"""``aitrainsai runpod``: list the account's pods by run, and reap the ones no live run owns.

With ``--run``, a command talks to the API endpoint that run recorded (``gpu_backend.runpod.api_base_url``, its key's
variable and pod-name prefix) and sees only that run's pods; a flag given beside it wins."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import click

from aitrainsai_backend_runpod.reaper import PREFIX, classify, reap


@dataclass
class Endpoint:
    """Where the commands talk to Runpod: from the flags, else from a given run's recorded config, else defaults."""

    key_env: str
    base_url: str | None
    prefix: str
    retries: int = 5
    backoff_s: float = 2.0


def endpoint(run_ref: str | None, key_env: str | None, base_url: str | None, prefix: str | None) -> Endpoint:
    """The flags given, over what the run ``run_ref`` recorded (``gpu_backend.runpod``: the API it used, its key's
    variable, its pod-name prefix, its retries), over the defaults."""
    chosen = Endpoint(key_env="RUNPOD_API_KEY", base_url=None, prefix=PREFIX)
    if run_ref is not None:
        config = _recorded(run_ref)
        chosen = Endpoint(key_env=config.api_key_env, base_url=config.api_base_url, prefix=config.name_prefix,
                          retries=config.api_retries, backoff_s=config.backoff_s)
    if key_env is not None:
        chosen.key_env = key_env
    if base_url is not None:
        chosen.base_url = base_url
    if prefix is not None:
        chosen.prefix = prefix
    return chosen


def _recorded(run_ref: str):
    """The run's recorded Runpod options, checked as the backend's config; one line where it has none."""
    from aitrainsai import Ledger, LedgerError
    from pydantic import ValidationError

    from aitrainsai_backend_runpod.config import RunpodConfig

    try:
        run = Ledger(_runs_dir()).run(run_ref)
        backend = run.info().config.get("gpu_backend") or {}
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None
    if backend.get("use") != "runpod" or not isinstance(backend.get("runpod"), dict):
        raise click.ClickException(f"run {run.id} did not use the runpod GPU backend (gpu_backend.use is "
                                   f"{backend.get('use')!r})")
    try:
        return RunpodConfig.model_validate(backend["runpod"])
    except ValidationError as exc:
        raise click.ClickException(f"run {run.id}: its recorded gpu_backend.runpod is not valid here "
                                   f"({exc.error_count()} problems, first: {exc.errors()[0]['msg']})") from None


def _api(chosen: Endpoint):
    from aitrainsai_backend_runpod.api import RunpodApi

    key = os.environ.get(chosen.key_env, "").strip()
    if not key:
        raise click.ClickException(f"no Runpod API key: set {chosen.key_env}")
    return RunpodApi(key, base_url=chosen.base_url, retries=chosen.retries, backoff_s=chosen.backoff_s)


def _runs_dir() -> Path:
    from aitrainsai import CommandState

    return click.get_current_context().ensure_object(CommandState).runs_dir


def _run_id(run_ref: str | None) -> str | None:
    if run_ref is None:
        return None
    from aitrainsai import Ledger

    return Ledger(_runs_dir()).run(run_ref).id


_RUN_HELP = ("A run (id, id prefix or name): use the API endpoint, key variable and pod-name prefix it recorded, and "
             "only its pods.")
_URL_HELP = "GraphQL base URL (default: the run's, with --run; else $RUNPOD_API_BASE_URL or Runpod's)."


@click.group("runpod")
def runpod_group() -> None:
    """Runpod pods of aitrainsai runs: list them, reap orphans."""


@runpod_group.command("pods")
@click.option("--run", "run_ref", default=None, metavar="RUN", help=_RUN_HELP)
@click.option("--api-key-env", default=None, help="The key's variable [default: the run's, else RUNPOD_API_KEY].")
@click.option("--api-base-url", default=None, help=_URL_HELP)
@click.option("--prefix", default=None, help=f"Pod-name prefix [default: the run's, else {PREFIX}].")
def pods_command(run_ref: str | None, api_key_env: str | None, api_base_url: str | None, prefix: str | None) -> None:
    """List the account's pods of aitrainsai runs: pod, run, whether the run is live here, $/h."""
    from aitrainsai_backend_runpod.api import ApiError

    chosen = endpoint(run_ref, api_key_env, api_base_url, prefix)
    run_id = _run_id(run_ref)
    try:
        owned = classify(_api(chosen).list_pods(), _runs_dir(), chosen.prefix)
    except ApiError as exc:
        raise click.ClickException(str(exc)) from None
    owned = [pod for pod in owned if run_id is None or pod.run_id == run_id]
    for pod in owned:
        click.echo(f"{pod.pod_id}  {pod.name}  run {pod.run_id}: {pod.state}  ${pod.cost_per_hr:.2f}/h")
    if not owned:
        click.echo(f"no pods named {chosen.prefix}-{run_id or '*'}-*")


@runpod_group.command("reap")
@click.option("--run", "run_ref", default=None, metavar="RUN", help=_RUN_HELP)
@click.option("--api-key-env", default=None, help="The key's variable [default: the run's, else RUNPOD_API_KEY].")
@click.option("--api-base-url", default=None, help=_URL_HELP)
@click.option("--prefix", default=None, help=f"Pod-name prefix [default: the run's, else {PREFIX}].")
@click.option("--unknown", is_flag=True, help="Also terminate pods of runs this runs directory does not hold.")
def reap_command(run_ref: str | None, api_key_env: str | None, api_base_url: str | None, prefix: str | None,
                 unknown: bool) -> None:
    """Terminate pods named <prefix>-<run>-pNNN whose run no process is running (a killed orchestrator's)."""
    from aitrainsai_backend_runpod.api import ApiError

    chosen = endpoint(run_ref, api_key_env, api_base_url, prefix)
    try:
        reaped = reap(_api(chosen), _runs_dir(), prefix=chosen.prefix, unknown=unknown, run_id=_run_id(run_ref))
    except ApiError as exc:
        raise click.ClickException(str(exc)) from None
    for pod in reaped:
        click.echo(f"terminated {pod.pod_id} ({pod.name}): run {pod.run_id} is {pod.state}")
    click.echo(f"{len(reaped)} pod(s) terminated")
