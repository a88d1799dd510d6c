"""A job's way to Ray: its submission id (journaled before Ray hears of it), its folder on shared storage, its
runtime env and its entrypoint, then the submission itself."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aitrainsai import JobPayload, WheelCache, WheelError, append_journal, read_journal

from aitrainsai_backend_ray.config import RayConfig
from aitrainsai_backend_ray.pool import Pool, Refused, line

RUNNER = Path(__file__).with_name("runner.py")
NO_FOLDER = 96  # the entrypoint found no job folder: the node does not share shared_dir
NO_AGENT = "No available agent to submit job"  # Ray's dashboard: no job agent has registered yet; try again later
AGENT_WAIT_S = 60.0  # how long a submission waits for a job agent


class Submissions:
    """Submits payloads to the pool's cluster, each from its own folder under ``shared_dir``; the submission ids
    go into ``submissions.jsonl`` in ``workdir`` (the backend's folder) and, through ``record``, the run's ledger."""

    def __init__(self, config: RayConfig, pool: Pool, *, workdir: Path, shared_dir: Path,
                 record: Callable[[dict[str, Any]], None]):
        self.config = config
        self.pool = pool
        self.workdir = workdir
        self.shared_dir = shared_dir
        self.journal = workdir / "submissions.jsonl"
        self.record = record
        self.python = config.python or "python"  # start() may name this interpreter instead, for its own head
        self.wheels = WheelCache(shared_dir / "wheels", enabled=config.ship_local_wheels)
        self._attempts: dict[str, int] | None = None  # job id -> submissions so far (the journal)

    def new_id(self, job_id: str) -> str:
        """``aitrainsai-<run>-<job>-<attempt>``, recorded at once: the run is a digest of the backend's folder, the
        attempt counts the job's earlier submissions in ``submissions.jsonl`` (Ray refuses a submission id twice)."""
        run = hashlib.sha256(str(self.workdir.resolve()).encode()).hexdigest()[:10]
        slug = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)
        if slug != job_id or len(slug) > 48:
            slug = f"{slug[:40]}-{hashlib.sha256(job_id.encode()).hexdigest()[:7]}"
        if self._attempts is None:
            self._attempts = {}
            for entry in read_journal(self.journal):
                key = str(entry.get("job_id"))
                self._attempts[key] = self._attempts.get(key, 0) + 1
        attempt = self._attempts[job_id] = self._attempts.get(job_id, 0) + 1
        sid = f"aitrainsai-{run}-{slug}-{attempt}"
        entry = {"job_id": job_id, "submission_id": sid, "at": time.time()}
        append_journal(self.journal, entry)  # a submission id is never unknown to the run, nor reused
        self.record(entry)
        return sid

    async def runtime_env(self, payload: JobPayload) -> tuple[dict[str, Any] | None, Path | None]:
        """Ray's runtime env for the payload's distributions (``runtime_env='pip'``), and the folder of the wheels
        built here for those installed from a local folder (once per runtime). Distributions in ``no_deps`` are not
        in it: the runner installs them into the runtime env's virtualenv without their dependencies."""
        runtime = payload.runtime
        if self.config.runtime_env == "none" or not runtime.distributions:
            return None, None
        try:
            folder = (await self.wheels.get(runtime)).folder
        except (WheelError, OSError, subprocess.SubprocessError) as exc:
            raise Refused(f"the runtime's wheels could not be built here: {line(exc)}") from None
        packages = [f"{name}{spec}" for name, spec in sorted(runtime.distributions.items())
                    if name not in runtime.no_deps]
        # a virtualenv needs one package to install; pip is in it already
        options = ["--disable-pip-version-check", "--find-links", str(folder), *self.config.pip_args]
        return {"pip": {"packages": packages or ["pip"], "pip_install_options": options}}, folder

    def prepare(self, payload: JobPayload, job_dir: Path, wheels: Path | None = None) -> None:
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

    def entrypoint(self, job_dir: Path) -> str:
        work = shlex.quote(str(job_dir / "work"))
        missing = shlex.quote(f"aitrainsai: {job_dir} is not on this node: set gpu_backend.ray.shared_dir to a "
                              "folder that every node and the orchestrator share")
        python = shlex.join(shlex.split(self.python))
        return f"cd {work} 2>/dev/null || {{ echo {missing}; exit {NO_FOLDER}; }}; exec {python} ../runner.py"

    def submit(self, payload: JobPayload, sid: str, job_dir: Path, resources: dict[str, float],
               runtime_env: dict[str, Any] | None = None) -> None:
        """Hand the prepared job to Ray (blocking: call it in a thread). A head whose job agent has not registered
        yet (a new head on a loaded machine: Ray's dashboard waits 10 s for one, then asks to try again later) is
        asked again, for at most ``AGENT_WAIT_S``; a retry that finds the submission id taken finds this job, whose
        first request reached the agent after all (the id is this submission's own)."""
        assert self.pool.client is not None
        submit = functools.partial(
            self.pool.client.submit_job, entrypoint=self.entrypoint(job_dir), submission_id=sid,
            runtime_env=runtime_env, metadata={"aitrainsai_job_id": payload.job_id[:200]},
            entrypoint_num_cpus=self.config.cpus_per_job, entrypoint_num_gpus=payload.gpus,
            entrypoint_memory=int(payload.memory_gb * 2**30) if payload.memory_gb else None,
            entrypoint_resources=resources or None)
        deadline = time.monotonic() + AGENT_WAIT_S
        retried = False
        while True:
            try:
                submit()
                return
            except RuntimeError as exc:
                if retried and f"submission_id {sid} already exists" in str(exc):
                    return
                if NO_AGENT not in str(exc) or time.monotonic() >= deadline:
                    raise
                retried = True
                time.sleep(1.0)


def forget_env(job_dir: Path) -> None:
    """The secrets' file goes once the job has ended, whether or not its runner read it."""
    with contextlib.suppress(OSError):
        (job_dir / "env.json").unlink()

