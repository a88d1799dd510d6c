"""A job on a pod of the Runpod pool: shipped and launched over SSH (its runtime installed once per pod), followed
by long polls to its exit code, then how it ended and its artifacts; and a job an earlier orchestrator left on an
adopted pod, reattached to.

A pod that vanishes, is outbid or stops answering SSH during a job raises :class:`.pool.PodGone` (the backend retries
the job on another pod). What comes back from a pod is data, never instructions: how a job ended is read from its
own files (the exit record, which artifacts exist) in fixed-format fields ahead of the log's tail, so nothing the job
prints can pass for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import shlex
import subprocess
import tarfile
import time
from pathlib import Path

from aitrainsai import (PYTHON, JobHandle, JobPayload, JobResult, MissingArtifacts, WheelCache, WheelError,
                        blank_secrets)

from aitrainsai_backend_runpod import api as runpod_api
from aitrainsai_backend_runpod.artifacts import fetch
from aitrainsai_backend_runpod.config import RunpodConfig
from aitrainsai_backend_runpod.pool import Pod, PodGone, Pool
from aitrainsai_backend_runpod.ssh import SshError, pack

LOG_TAIL_BYTES = 4_000
SSH_FAILURES_BEFORE_GONE = 3
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "MemoryError", "Killed process")
EXIT_RECORD = re.compile(rb"[0-9]{1,3}")


class Jobs:
    """Runs jobs on the pool's pods; ``cancelled`` is the backend's set of the job ids it was asked to cancel."""

    def __init__(self, config: RunpodConfig, pool: Pool, cancelled: set[str], *, wheels: WheelCache):
        self.config = config
        self.pool = pool
        self.cancelled = cancelled
        self.wheels = wheels

    async def execute(self, pod: Pod, payload: JobPayload, handle: JobHandle) -> JobResult:
        """Ship, launch and follow one job: one SSH session uploads and starts it, long polls wait for its exit
        code, one session reads how it ended, one fetches its artifacts and cleans up (round trips cost more on a
        remote pod than anything else here)."""
        assert pod.ssh is not None
        job_id = payload.job_id
        if job_id in self.cancelled:
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
                runtime, problem = await self.install(pod, payload)
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
            await self.pool.ssh(pod, launch, stdin=files, timeout_s=600)
            handle.data.update({"pod_id": pod.id, "pod_name": pod.name, "started_at": time.time(),
                                "cost_per_hr": pod.cost_per_hr})
            return await self.follow(pod, job_id, payload.timeout_s, payload.artifacts, Path(payload.workdir),
                                     started, list(payload.secrets.values()))
        except SshError as exc:
            raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None

    async def follow(self, pod: Pod, job_id: str, timeout_s: float, artifacts: dict[str, str], local: Path,
                     started: float, secrets: list[str], reattached: bool = False) -> JobResult:
        """Wait for the job's exit code (long polls of up to ``wait_s``), then read how it ended, fetch its
        artifacts and clean its folder."""
        deadline = time.monotonic() + timeout_s + 60
        ticks = max(1, int(self.config.wait_s / 0.2))
        wait = (f"touch {self.config.remote_root}/heartbeat; {self.pool.cd_job(job_id)} || {{ echo missing; exit; }}; "
                f"i=0; while [ ! -f rc ] && [ $i -lt {ticks} ]; do sleep 0.2; i=$((i+1)); done; "
                "if [ -f rc ]; then head -c 16 rc | tr -cd 'a-z0-9'; else echo running; fi")
        while True:
            if pod.state == "gone":
                raise PodGone(f"pod {pod.id} {pod.why_gone or 'vanished'} while running job {job_id}")
            if job_id in self.cancelled:
                await self.pool.kill(pod, job_id)
                tail = await self.log_tail(pod, job_id, secrets)
                await self.pool.clean(pod, job_id)
                return JobResult.dead(job_id, "cancelled", "cancelled while running", wall_s=time.monotonic() - started,
                                      log_tail=tail)
            try:
                probe = await self.pool.ssh(pod, wait, timeout_s=self.config.wait_s + 60)
                pod.ssh_failures = 0
            except SshError as exc:
                pod.ssh_failures += 1
                if pod.ssh_failures >= SSH_FAILURES_BEFORE_GONE:
                    with contextlib.suppress(runpod_api.ApiError):  # unconfirmed: close() or the next start tries again
                        await self.pool.terminate(pod.id, f"stopped answering SSH ({exc})")
                    raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None
                await asyncio.sleep(self.config.poll_s)
                continue
            state = probe.stdout.decode(errors="replace").strip()
            if job_id in self.cancelled:
                continue  # ended by cancel(): the top of the loop reports it
            if state == "missing":
                return JobResult.dead(job_id, "lost",
                                      f"job {job_id} is not on pod {pod.id} (never started, or cleaned)")
            if state != "running":
                break
            if time.monotonic() > deadline:
                await self.pool.kill(pod, job_id)
                tail = await self.log_tail(pod, job_id, secrets)
                await self.pool.clean(pod, job_id)
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s (killed by the backend)",
                                      wall_s=time.monotonic() - started, log_tail=tail)
        wall_s = time.monotonic() - started
        cost = pod.cost_per_hr * wall_s / 3600
        self.pool.job_cost += cost
        try:  # how it ended, in one round trip, read from the job's files (never from its log)
            ended = await self.pool.ssh(pod, ended_command(self.pool.cd_job(job_id), list(artifacts.values())),
                                        timeout_s=60)
        except SshError as exc:
            raise PodGone(f"pod {pod.id} stopped answering SSH ({exc})") from None
        code, present, tail = parse_ended(ended.stdout, len(artifacts))
        tail = blank_secrets(tail, secrets)
        if code is None or present is None:
            await self.pool.clean(pod, job_id)
            first = ended.stdout.split(b"\n", 1)[0][:40].decode("utf-8", "replace")
            return JobResult.dead(job_id, "lost", f"unreadable exit record {first!r}", wall_s=wall_s, log_tail=tail,
                                  cost_usd=cost)
        common = {"exit_code": code, "wall_s": wall_s, "log_tail": tail, "cost_usd": cost}
        if code != 0:
            await self.pool.clean(pod, job_id)
            if code == 124:
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s", **common)
            if code == 137 and wall_s >= timeout_s:
                return JobResult.dead(job_id, "timeout", f"timed out after {timeout_s:g} s (killed)", **common)
            if code == 137 or any(marker in tail for marker in OOM_MARKERS):
                return JobResult.dead(job_id, "oom", f"exit code {code}: out of memory", **common)
            return JobResult.dead(job_id, "failed", f"exit code {code}" + (" (reattached)" if reattached else ""),
                                  **common)
        missing = [(name, path) for (name, path), here in zip(artifacts.items(), present) if not here]
        if missing:
            await self.pool.clean(pod, job_id)
            return MissingArtifacts.absent(missing).result(job_id, **common)
        try:
            found = await fetch(self.pool, pod, job_id, artifacts, local)
        except MissingArtifacts as exc:
            return exc.result(job_id, **common)
        return JobResult(job_id=job_id, status="done", artifacts=found, **common)

    async def install(self, pod: Pod, payload: JobPayload) -> tuple[str, str]:
        """Install the payload's distributions into a virtual environment on the pod, once per pod and runtime:
        those in ``no_deps`` without their dependencies, the wheels built here from local folders shipped along.
        Returns the runtime's key and a problem ("" when installed)."""
        try:
            built = await self.wheels.get(payload.runtime)
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
        result = await self.pool.ssh(pod, f"bash -c {shlex.quote(command)}", stdin=_tar(list(wheels.values())),
                                     timeout_s=3600)
        if result.code != 0:
            text = " ".join((result.stdout.decode(errors="replace") + result.stderr).split())[-500:]
            return runtime, (f"the runtime ({specs(distributions)}) could not be installed on pod {pod.id}: "
                             f"{text or 'exit ' + str(result.code)}")
        pod.runtimes.add(runtime)
        return runtime, ""

    async def log_tail(self, pod: Pod, job_id: str, secrets: list[str]) -> str:
        try:
            out = await self.pool.ssh(pod, f"{self.pool.cd_job(job_id)} && tail -c {LOG_TAIL_BYTES} log", timeout_s=60)
        except SshError:
            return ""
        return blank_secrets(out.stdout.decode("utf-8", "replace"), secrets)

    async def reattach(self, handle: JobHandle) -> JobResult:
        data = handle.data
        if data.get("refused"):
            return JobResult.dead(handle.job_id, "infra", data["refused"])
        # The handle was stored when the job was submitted, before it had a pod: find the pod that holds it, once
        # every adopted pod has answered SSH (or been given up).
        while any(p.adopted and p.state == "booting" for p in self.pool.pods.values()):
            await asyncio.sleep(self.config.poll_s / 2)
        pod = next((p for p in self.pool.pods.values() if p.state != "gone" and handle.job_id in p.leftovers), None)
        if pod is None:
            return JobResult.dead(handle.job_id, "lost", "no pod of the run holds the job (its pod is gone, or it "
                                                         "never started)")
        while pod.state == "busy":  # the leftover's pod is reserved for it; a moment's overlap with a release
            await asyncio.sleep(self.config.poll_s / 2)
        pod.state, pod.job = "busy", handle.job_id
        pod.reserved.discard(handle.job_id)
        started = time.monotonic() - max(0.0, time.time() - data.get("started_at", time.time()))
        try:
            workdir = Path(data.get("workdir", self.pool.workdir / "jobs" / handle.job_id))
            return await self.follow(pod, handle.job_id, data.get("timeout_s", 0.0), data.get("artifacts", {}),
                                     workdir, started, [], reattached=True)
        except PodGone as exc:
            return JobResult.dead(handle.job_id, "lost", str(exc))
        finally:
            self.pool.release(pod)


def ended_command(cd_job: str, paths: list[str]) -> str:
    """A shell line (after ``cd_job``, which enters the job's folder) printing, in fixed-format fields: the exit
    record (digits, at most 3; the file is cut at 8 bytes and stripped of anything else), a line; one 0/1 per artifact
    path (there, and not a link), a line; then the log's last LOG_TAIL_BYTES. The log comes last, so nothing in it
    can pass for the fields."""
    checks = "".join(f"if [ -e {shlex.quote('work/' + p)} ] && [ ! -L {shlex.quote('work/' + p)} ]; "
                     "then printf 1; else printf 0; fi; " for p in paths)
    return (f"{cd_job} && {{ head -c 8 rc 2>/dev/null | tr -cd '0-9'; echo; {checks}echo; "
            f"tail -c {LOG_TAIL_BYTES} log 2>/dev/null; }}")


def parse_ended(out: bytes, artifacts: int) -> tuple[int | None, list[bool] | None, str]:
    """The fields of :func:`ended_command`'s output: the exit code (None: no readable record), which
    artifacts are there (None: not ``artifacts`` 0/1 marks), the log's tail."""
    record, _, rest = out.partition(b"\n")
    marks, _, tail = rest.partition(b"\n")
    code = int(record) if EXIT_RECORD.fullmatch(record) else None
    present = [m == ord("1") for m in marks] if re.fullmatch(rb"[01]*", marks) and len(marks) == artifacts else None
    return code, present, tail.decode("utf-8", "replace").removesuffix("\n")


def _tar(files: list[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in files:
            archive.add(path, arcname=path.name, recursive=False)
    return buffer.getvalue()


def _env_name(name: str) -> bool:
    return name.replace("_", "a").isalnum() and not name[0].isdigit()
