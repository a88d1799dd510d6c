"""The strategy this process isolates agent code with (``AITRAINSAI_ISOLATION``), and the entry points:
:func:`run_sandboxed` for a command that runs to its end, :func:`make_sandbox` for one talked to while it runs."""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Sequence

from aitrainsai.isolation.container import ContainerIsolation
from aitrainsai.isolation.contract import Limits, SandboxResult, SandboxUnavailable
from aitrainsai.isolation.namespace import NamespaceIsolation
from aitrainsai.isolation.sandbox import IsolationStrategy, Sandbox

STRATEGIES: dict[str, IsolationStrategy] = {s.name: s for s in (NamespaceIsolation(), ContainerIsolation())}
ISOLATION_VARIABLE = "AITRAINSAI_ISOLATION"
ISOLATION_CHOICES = (*STRATEGIES, "auto")


def isolation() -> IsolationStrategy:
    """The strategy this process isolates agent code with: ``AITRAINSAI_ISOLATION`` (namespace, the default;
    container; or auto: namespace where it works, else container). The one place that setting is read."""
    choice = os.environ.get(ISOLATION_VARIABLE, "namespace").strip().lower() or "namespace"
    if choice == "auto":
        namespace = STRATEGIES["namespace"]
        container = STRATEGIES["container"]
        return namespace if namespace.problem() is None or container.problem() else container
    if choice not in STRATEGIES:
        raise SandboxUnavailable(f"{ISOLATION_VARIABLE}={os.environ[ISOLATION_VARIABLE]!r} is not an isolation "
                                 f"strategy: choose one of {', '.join(ISOLATION_CHOICES)}")
    return STRATEGIES[choice]


def make_sandbox(command: list[str], **options) -> Sandbox:
    """A sandbox for ``command`` by the chosen strategy, not yet started (options as
    :meth:`IsolationStrategy.sandbox`)."""
    return isolation().sandbox(command, **options)


def run_sandboxed(command: list[str], *, job_dir: Path, out_dir: Path | None = None, limits: Limits | None = None,
                  hide: Sequence[Path] = (), env: dict[str, str] | None = None, stdin: str | None = None,
                  gpu: bool = False) -> SandboxResult:
    """Run ``command`` in a sandbox of the chosen strategy to its end. ``job_dir`` is the command's working directory
    (read-only; ``$AITRAINSAI_JOB_DIR``, ``/tmp/job`` under namespaces); what the command leaves in its out folder
    (``$AITRAINSAI_OUT_DIR``, ``/tmp/out``) is written to ``out_dir`` (emptied first) when one is given. ``hide``:
    paths inside the folders the sandbox shows that it must not show."""
    return isolation().run(command, job_dir=job_dir, out_dir=out_dir, limits=limits, hide=hide, env=env,
                           stdin=stdin, gpu=gpu)


def sandbox_problem() -> str:
    """Why this machine cannot isolate agent code by the chosen strategy, in one line, or '' when it can."""
    try:
        return isolation().problem() or ""
    except SandboxUnavailable as exc:
        return str(exc)


def sandbox_works() -> bool:
    """Whether this machine can isolate agent code by the chosen strategy."""
    return not sandbox_problem()
