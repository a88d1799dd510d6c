"""Conformance checks for GPU backends: payloads travel, and backends report done or dead honestly.

Every payload the kit runs is written in one folder, copied to another and the first one deleted before it is
submitted: a backend (or a payload) that reads anything outside the workdir it was given fails the kit. The kit
covers artifacts (a file and a folder), secrets (delivered, never stored), the worker's ``python``, a crash, a
timeout, a missing artifact, refused requirements, cancel, reattaching after the orchestrator was killed, and a job
whose worker vanished (``lost``).

:func:`payload_problems` checks any payload (a trainer's, say) for what would not travel.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest

from aitrainsai.backends import PYTHON, GpuBackend, JobHandle, JobPayload, JobResult
from aitrainsai.components import ComponentConfig
from aitrainsai.testing.plugins import PluginConformance

TEXT_SCAN_BYTES = 1_000_000


def payload_problems(payload: JobPayload) -> list[str]:
    """What in ``payload`` would not travel to another machine: the absolute path of the folder around its workdir
    (or of the workdir itself) in its env, or in a text file of its workdir. Empty when it travels."""
    workdir = Path(payload.workdir).resolve()
    outside = str(workdir.parent)
    problems = [f"env {key} names {value!r}, outside the workdir" for key, value in payload.env.items()
                if outside in value]
    for path in sorted(p for p in workdir.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.stat().st_size > TEXT_SCAN_BYTES:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if outside in text:
            problems.append(f"{path.relative_to(workdir)} names {outside}, a path outside the workdir")
    for path in workdir.rglob("*"):
        if path.is_symlink():
            problems.append(f"{path.relative_to(workdir)} is a symbolic link (it would not travel)")
    return problems


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def relocate(payload: JobPayload, destination: Path) -> JobPayload:
    """Copy the payload's workdir to ``destination``, delete the original, and return the payload that points there."""
    shutil.copytree(payload.workdir, destination, symlinks=True)
    shutil.rmtree(payload.workdir)
    return payload.model_copy(update={"workdir": destination})


# The job every kit payload runs (job.py in its workdir): argv[1] picks what it does.
JOB = textwrap.dedent('''
    import hashlib, os, pathlib, sys, time
    mode = sys.argv[1]
    if mode == "succeed":
        data = pathlib.Path("input.txt").read_text()
        secret = hashlib.sha256(os.environ.get("KIT_SECRET", "").encode()).hexdigest()
        pathlib.Path("out.txt").write_text(f"{data}|secret {secret}|env {os.environ.get('KIT_ENV')}"
                                            f"|python {sys.version_info >= (3, 10)}")
        pathlib.Path("folder/deeper").mkdir(parents=True)
        pathlib.Path("folder/deeper/part.txt").write_text("part")
        print("hello from the job", flush=True)
    elif mode == "crash":
        print("about to fail", flush=True)
        sys.exit(3)
    elif mode == "sleep":
        with open("runs.txt", "a") as runs:
            runs.write("ran\\n")
        print("started", flush=True)
        time.sleep(float(sys.argv[2]))
        pathlib.Path("out.txt").write_text("ok")
    elif mode == "nothing":
        pass
''')

# The orchestrator that is killed: submits a payload, waits until it is surely running, then SIGKILLs itself.
ORCHESTRATOR = textwrap.dedent('''
    import asyncio, importlib, os, signal, sys
    from pathlib import Path
    from aitrainsai.backends import JobPayload

    module, name, config, state, payload, handle_path, settle = sys.argv[1:]
    cls = getattr(importlib.import_module(module), name)
    backend = cls(cls.Config.model_validate_json(config), workdir=Path(state))

    async def main():
        await backend.start()
        handle = await backend.submit(JobPayload.model_validate_json(payload))
        Path(handle_path).write_text(handle.model_dump_json())
        try:
            result = await asyncio.wait_for(asyncio.shield(backend.wait(handle)), float(settle))
        except asyncio.TimeoutError:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"the job ended before the orchestrator was killed: {result}", flush=True)
        sys.exit(5)

    asyncio.run(main())
''')


class GpuBackendConformance(PluginConformance):
    """Set ``backend`` to the class; override :meth:`make_config` to point it at a test server, and implement
    :meth:`vanish`. The backend class must be importable by its module and name (the reattach check builds it in a
    process that is then killed)."""

    backend: ClassVar[type[GpuBackend]]
    kind = "gpu_backends"
    settle_s: ClassVar[float] = 1.5
    """How long the kit lets a submitted long job run before it cancels it, kills its orchestrator or its worker."""
    limit_s: ClassVar[float] = 120.0
    """The most any kit payload may take from submission to its result (a backend that boots workers may need more)."""

    def component_names(self) -> list[str]:
        return [self.backend.name]

    def make_config(self) -> ComponentConfig:
        return self.backend.Config()

    def make_backend(self, state_dir: Path) -> GpuBackend:
        return self.backend(self.make_config(), workdir=state_dir)

    def vanish(self, backend: GpuBackend, handle: JobHandle) -> None:
        """Make the worker of this running job disappear, as if its machine died (the local backend: SIGKILL its
        runner's process group, so that nothing records how the job ended)."""
        pytest.fail(f"{type(self).__name__} must implement vanish() to check that a vanished worker is reported lost")

    # -- helpers -----------------------------------------------------------------------------------------------------
    def payload(self, tmp_path: Path, mode: str, *args: str, **fields: Any) -> JobPayload:
        """A kit payload written in one folder and relocated to another before anything runs it."""
        job_id = f"kit-{mode}-{uuid.uuid4().hex[:8]}"
        origin = tmp_path / "origin" / job_id
        origin.mkdir(parents=True)
        (origin / "job.py").write_text(JOB)
        (origin / "input.txt").write_text(f"payload input {job_id}")
        payload = JobPayload(job_id=job_id, workdir=origin, command=[PYTHON, "job.py", mode, *args], **fields)
        return relocate(payload, tmp_path / "elsewhere" / job_id)

    def _go(self, tmp_path: Path, body) -> Any:
        async def go():
            backend = self.make_backend(tmp_path / "state")
            await backend.start()
            try:
                return await body(backend)
            finally:
                await backend.close()

        return asyncio.run(go())

    def _run(self, tmp_path: Path, payload: JobPayload) -> JobResult:
        async def body(backend):
            return await asyncio.wait_for(backend.run(payload), self.limit_s)

        return self._go(tmp_path, body)

    async def _started(self, backend: GpuBackend, handle: JobHandle) -> None:
        """Give a long job time to start; fail if it ended already."""
        try:
            result = await asyncio.wait_for(asyncio.shield(backend.wait(handle)), self.settle_s)
        except TimeoutError:
            return
        pytest.fail(f"a job that sleeps ended within {self.settle_s} s: {result}")

    # -- the checks --------------------------------------------------------------------------------------------------
    def test_a_relocated_payload_runs_and_its_artifacts_come_back(self, tmp_path):
        secret = f"kit-secret-{uuid.uuid4().hex}"
        payload = self.payload(tmp_path, "succeed", env={"KIT_ENV": "visible"}, secrets={"KIT_SECRET": secret},
                               artifacts={"file": "out.txt", "folder": "folder"})
        assert not (tmp_path / "origin" / payload.job_id).exists()
        result = self._run(tmp_path, payload)
        assert result.status == "done" and result.reason is None, result
        assert set(result.artifacts) == {"file", "folder"}, result.artifacts
        assert Path(result.artifacts["file"]).read_text() == \
            f"payload input {payload.job_id}|secret {_sha256(secret)}|env visible|python True"
        assert (Path(result.artifacts["folder"]) / "deeper" / "part.txt").read_text() == "part"
        assert "hello from the job" in result.log_tail
        assert result.cost_usd >= 0 and result.wall_s > 0

    def test_secrets_are_delivered_but_never_stored(self, tmp_path):
        secret = f"kit-secret-{uuid.uuid4().hex}"
        payload = self.payload(tmp_path, "succeed", secrets={"KIT_SECRET": secret}, artifacts={"file": "out.txt"})
        for text in (payload.model_dump_json(), json.dumps(payload.model_dump(mode="json")), repr(payload),
                     str(payload)):
            assert secret not in text

        async def body(backend):
            handle = await backend.submit(payload)
            return handle, await asyncio.wait_for(backend.wait(handle), self.limit_s)

        handle, result = self._go(tmp_path, body)
        assert result.status == "done", result
        assert f"secret {_sha256(secret)}" in Path(result.artifacts["file"]).read_text()  # the job saw it
        assert secret not in handle.model_dump_json() and secret not in result.model_dump_json()
        for path in tmp_path.rglob("*"):  # nothing the backend wrote holds it (the payload never writes it)
            if path.is_file() and not path.is_symlink():
                assert secret.encode() not in path.read_bytes(), f"{path} holds the secret"

    def test_a_payload_that_crashes_is_dead_with_its_log(self, tmp_path):
        result = self._run(tmp_path, self.payload(tmp_path, "crash"))
        assert result.status == "dead" and result.reason == "failed" and result.detail, result
        assert "about to fail" in result.log_tail

    def test_a_payload_that_hangs_is_dead_of_timeout(self, tmp_path):
        result = self._run(tmp_path, self.payload(tmp_path, "sleep", "600", timeout_s=1))
        assert result.status == "dead" and result.reason == "timeout", result

    def test_a_missing_artifact_is_a_dead_job(self, tmp_path):
        result = self._run(tmp_path, self.payload(tmp_path, "nothing", artifacts={"weights": "adapter"}))
        assert result.status == "dead" and result.reason == "artifact" and "weights" in result.detail, result
        assert not result.artifacts

    @pytest.mark.parametrize("needs", [
        {"runtime": {"distributions": {"aitrainsai-kit-no-such-distribution": ">=1"}}},
        {"runtime": {"distributions": {"aitrainsai": "<0.0.1"}}},
        {"memory_gb": 1e9},
        {"gpus": 4096, "gpu_type": "kit-no-such-gpu"},
        {"disk_gb": 1e12},
        {"shm_gb": 1e9},
    ], ids=["unknown-distribution", "incompatible-version", "memory", "gpus", "disk", "shm"])
    def test_a_payload_it_cannot_meet_is_refused_as_infra(self, tmp_path, needs):
        result = self._run(tmp_path, self.payload(tmp_path, "succeed", **needs))
        assert result.status == "dead" and result.reason == "infra" and result.detail, result
        assert "\n" not in result.detail.strip(), "a refusal is one line"

    def test_cancel_stops_a_running_job(self, tmp_path):
        payload = self.payload(tmp_path, "sleep", "60", artifacts={"file": "out.txt"})

        async def body(backend):
            handle = await backend.submit(payload)
            await self._started(backend, handle)
            await backend.cancel(handle)
            return await asyncio.wait_for(backend.wait(handle), self.limit_s)

        result = self._go(tmp_path, body)
        assert result.status == "dead" and result.reason == "cancelled" and not result.artifacts, result

    def test_a_new_backend_reattaches_to_a_job_whose_orchestrator_was_killed(self, tmp_path):
        payload = self.payload(tmp_path, "sleep", str(self.settle_s + 3),
                               artifacts={"file": "out.txt", "runs": "runs.txt"})
        handle_path = tmp_path / "handle.json"
        proc = subprocess.run([sys.executable, "-c", ORCHESTRATOR, self.backend.__module__, self.backend.__qualname__,
                               self.make_config().model_dump_json(), str(tmp_path / "state"),
                               payload.model_dump_json(), str(handle_path), str(self.settle_s)],
                              capture_output=True, text=True, timeout=self.limit_s, check=False)
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
        handle = JobHandle.model_validate_json(handle_path.read_text())  # as the ledger stored it

        async def body(backend):
            return await asyncio.wait_for(backend.wait(handle), self.limit_s)

        result = self._go(tmp_path, body)
        assert result.status == "done", result
        assert Path(result.artifacts["file"]).read_text() == "ok"
        assert Path(result.artifacts["runs"]).read_text() == "ran\n", "the job ran twice"

    def test_a_job_whose_worker_vanished_is_lost(self, tmp_path):
        payload = self.payload(tmp_path, "sleep", "60", artifacts={"file": "out.txt"})

        async def body(backend):
            handle = await backend.submit(payload)
            await self._started(backend, handle)
            self.vanish(backend, handle)
            return await asyncio.wait_for(backend.wait(handle), self.limit_s)

        result = self._go(tmp_path, body)
        assert result.status == "dead" and result.reason == "lost", result

    def test_a_handle_it_never_issued_is_lost(self, tmp_path):
        async def body(backend):
            handle = JobHandle(backend=self.backend.name, job_id=f"kit-unknown-{uuid.uuid4().hex[:8]}")
            return await asyncio.wait_for(backend.wait(handle), self.limit_s)

        result = self._go(tmp_path, body)
        assert result.status == "dead" and result.reason == "lost", result
