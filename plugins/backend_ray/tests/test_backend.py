"""The Ray backend against a real local Ray head (one per test session, see conftest.py): jobs go through Ray's
job submission API and run on the head as Ray jobs."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from aitrainsai import PYTHON, JobPayload
from aitrainsai.testing import ORCHESTRATOR, GpuBackendConformance
from aitrainsai_backend_ray.backend import RayBackend
from aitrainsai_backend_ray.config import RayConfig

pytestmark = pytest.mark.slow  # a real Ray head (10-20 s to start on 2 CPUs) and a Ray job per payload (~2 s)

CLUSTER = None  # the session's LocalCluster, for the conformance kit's make_config (which takes no fixtures)


@pytest.fixture(autouse=True)
def _cluster(ray_cluster):
    global CLUSTER
    CLUSTER = ray_cluster
    yield ray_cluster


def config(**overrides) -> RayConfig:
    values = {"address": CLUSTER.url, "poll_s": 0.2, "kill_grace_s": 1.0}
    return RayConfig(**{**values, **overrides})


def go(state: Path, body, **overrides):
    async def main():
        backend = RayBackend(config(**overrides), workdir=state)
        await backend.start()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


def job(tmp_path: Path, name: str, code: str, **fields) -> JobPayload:
    workdir = tmp_path / "jobs" / name
    workdir.mkdir(parents=True)
    (workdir / "job.py").write_text(textwrap.dedent(code))
    return JobPayload(job_id=name, workdir=workdir, command=[PYTHON, "job.py"], **fields)


def runner_pid(handle, timeout_s: float = 30.0) -> int:
    pid_file = Path(handle.data["job_dir"]) / "pid"
    deadline = time.monotonic() + timeout_s
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)
    return int(pid_file.read_text())


class TestConformance(GpuBackendConformance):
    """The core's kit, the relocated-workdir checks included; a vanished worker: its job supervisor (the Ray actor
    that runs the job) and the job are SIGKILLed, as when their node dies."""

    backend = RayBackend
    distribution = "aitrainsai-backend-ray"
    settle_s = 3.0

    def make_config(self):
        return config()

    def vanish(self, backend, handle):
        import psutil

        runner = psutil.Process(runner_pid(handle))
        supervisor = runner.parent()
        os.kill(supervisor.pid, signal.SIGKILL)
        os.killpg(runner.pid, signal.SIGKILL)


def ray_client():
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(CLUSTER.url)


def test_every_server_of_the_head_listens_on_loopback_only(ray_cluster):
    import psutil

    pids = set(ray_cluster.pids())
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening, "no server of the head found"
    outside = [f"{c.laddr.ip}:{c.laddr.port}" for c in listening
               if c.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not outside, f"the head listens beyond loopback: {outside}"


def test_a_job_that_fails_is_dead_with_its_reason_exit_code_and_log_tail(tmp_path):
    raising = job(tmp_path, "raises", "print('working', flush=True)\nraise ValueError('boom')")
    killed = job(tmp_path, "killed", "import os, signal; print('allocating', flush=True); "
                                     "os.kill(os.getpid(), signal.SIGKILL)")

    async def body(backend):
        return await asyncio.wait_for(asyncio.gather(backend.run(raising), backend.run(killed)), 120)

    failed, oom = go(tmp_path / "state", body)
    assert failed.status == "dead" and failed.reason == "failed" and failed.exit_code == 1, failed
    assert failed.detail == "exit code 1"
    assert "working" in failed.log_tail and "ValueError: boom" in failed.log_tail
    assert oom.status == "dead" and oom.reason == "oom" and oom.exit_code == -9, oom
    assert "allocating" in oom.log_tail


def test_a_job_that_ignores_sigterm_is_killed_at_its_time(tmp_path):
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('stubborn', flush=True)
        time.sleep(600)
    """
    payload = job(tmp_path, "stubborn", code, timeout_s=1.5)

    async def body(backend):
        return await asyncio.wait_for(backend.run(payload), 120)

    begin = time.monotonic()
    result = go(tmp_path / "state", body, kill_grace_s=0.5)
    assert result.status == "dead" and result.reason == "timeout", result
    assert "stubborn" in result.log_tail and "timed out after 1.5 s" in result.log_tail
    assert 1.5 <= result.wall_s < 10 and time.monotonic() - begin < 30


def test_the_queue_starts_the_longest_first_runs_no_more_than_fit_and_cancels_a_queued_job(tmp_path):
    code = "import time, pathlib; pathlib.Path('started').write_text(repr(time.time())); time.sleep(0.2); " \
           "pathlib.Path('ended').write_text(repr(time.time()))"
    payloads = [job(tmp_path, f"j{i}", code, expected_s=e, artifacts={"started": "started", "ended": "ended"})
                for i, e in enumerate([10, 30, 20, 5])]

    async def body(backend):
        assert backend.capacity == 1  # 4 CPUs, 4 per job
        handles = [await backend.submit(p) for p in payloads]
        await backend.cancel(handles[3])  # still queued here: it never reaches Ray
        return handles, await asyncio.wait_for(asyncio.gather(*(backend.wait(h) for h in handles)), 120)

    handles, results = go(tmp_path / "state", body, cpus_per_job=4)
    assert [r.status for r in results[:3]] == ["done"] * 3, results
    cancelled = results[3]
    assert cancelled.reason == "cancelled" and cancelled.detail == "cancelled while queued", cancelled
    with pytest.raises(RuntimeError, match="404"):
        ray_client().get_job_info(handles[3].data["submission_id"])
    spans = {r.job_id: (float(Path(r.artifacts["started"]).read_text()), float(Path(r.artifacts["ended"]).read_text()))
             for r in results[:3]}
    order = sorted(spans, key=lambda j: spans[j][0])
    assert order == ["j1", "j2", "j0"], spans
    for earlier, later in itertools.pairwise(order):
        assert spans[earlier][1] <= spans[later][0], f"{earlier} and {later} ran at once"


def test_a_job_that_ended_without_its_orchestrator_is_collected_once_and_never_rerun(tmp_path):
    workdir = tmp_path / "payload"
    workdir.mkdir()
    (workdir / "job.py").write_text("import pathlib, time\nwith open('runs.txt', 'a') as f: f.write('ran\\n')\n"
                                    "time.sleep(2)\npathlib.Path('out.txt').write_text('ok')\n")
    payload = JobPayload(job_id=f"orphan-{uuid.uuid4().hex[:6]}", workdir=workdir, command=[PYTHON, "job.py"],
                         artifacts={"out": "out.txt", "runs": "runs.txt"})
    state, handle_path = tmp_path / "state", tmp_path / "handle.json"
    proc = subprocess.run([sys.executable, "-c", ORCHESTRATOR, RayBackend.__module__, RayBackend.__qualname__,
                           config().model_dump_json(), str(state), payload.model_dump_json(), str(handle_path), "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    from aitrainsai import JobHandle

    handle = JobHandle.model_validate_json(handle_path.read_text())
    client, sid = ray_client(), handle.data["submission_id"]
    deadline = time.monotonic() + 60
    while str(client.get_job_status(sid)) not in ("SUCCEEDED", "JobStatus.SUCCEEDED"):
        assert time.monotonic() < deadline, client.get_job_info(sid)
        time.sleep(0.2)

    async def body(backend):
        return await asyncio.wait_for(backend.wait(handle), 60)

    first = go(state, body)  # a new orchestrator: the job has ended; its artifacts come back
    second = go(state, body)  # and again: the recorded result, nothing runs
    assert first.status == "done" and second == first, (first, second)
    assert Path(first.artifacts["runs"]).read_text() == "ran\n" and Path(first.artifacts["out"]).read_text() == "ok"
    ours = [j for j in client.list_jobs() if (j.submission_id or "").startswith(sid.rsplit("-", 1)[0])]
    assert len(ours) == 1, [j.submission_id for j in ours]


def test_artifacts_are_checked_where_the_job_left_them(tmp_path):
    code = "import os; os.makedirs('ckpt'); open('ckpt/w', 'w').write('x'); os.symlink('/etc/passwd', 'ckpt/link')"
    payload = job(tmp_path, "linked", code, artifacts={"ckpt": "ckpt"})
    result = go(tmp_path / "state", lambda b: asyncio.wait_for(b.run(payload), 120))
    assert result.status == "dead" and result.reason == "artifact" and "ckpt/link" in result.detail, result
    assert not (payload.workdir / "ckpt").exists()


def test_secrets_never_reach_ray(tmp_path, ray_cluster):
    secret = f"ray-secret-{uuid.uuid4().hex}"
    payload = job(tmp_path, "secretive", "import os; assert os.environ['TOKEN'].startswith('ray-secret-')",
                  secrets={"TOKEN": secret}, env={"VISIBLE": "yes"})

    async def body(backend):
        handle = await backend.submit(payload)
        return handle, await asyncio.wait_for(backend.wait(handle), 120)

    handle, result = go(tmp_path / "state", body)
    assert result.status == "done", result
    info = ray_client().get_job_info(handle.data["submission_id"])
    assert secret not in repr(info) and secret not in ray_client().get_job_logs(handle.data["submission_id"])
    for path in ray_cluster.temp_dir.rglob("*"):  # Ray's logs and session files
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 50_000_000:
            assert secret.encode() not in path.read_bytes(), f"{path} holds the secret"


def test_a_head_the_backend_starts_is_its_own_and_goes_at_close(tmp_path):
    import psutil
    from aitrainsai_backend_ray.keeper import load

    payload = job(tmp_path, "local", "import pathlib, sys; pathlib.Path('out').write_text(sys.executable)",
                  artifacts={"out": "out"})
    seen = {}

    async def main():
        backend = RayBackend(RayConfig(local_num_cpus=1, local_object_store_mb=80, poll_s=0.2),
                             workdir=tmp_path / "state")
        await backend.start()
        try:
            seen.update(pids=backend.cluster.pids(), temp_dir=backend.cluster.temp_dir, capacity=backend.capacity,
                        started_s=backend.cluster.started_s, keeper=backend.cluster.keeper.pid,
                        record=load(tmp_path / "state"))
            return await asyncio.wait_for(backend.run(payload), 120)
        finally:
            begin = time.monotonic()
            await backend.close()
            seen["close_s"] = time.monotonic() - begin

    result = asyncio.run(main())
    print(f"\na head started by the backend answered after {seen['started_s']:.1f} s; close took "
          f"{seen['close_s']:.1f} s")
    assert result.status == "done", result
    assert Path(result.artifacts["out"]).read_text() == sys.executable  # 'python' is this interpreter
    assert seen["capacity"] == 1
    record = seen["record"]  # recorded for its keeper, which watches this process
    assert record.state == "running" and record.owner.pid == os.getpid() and record.keeper.pid == seen["keeper"]
    assert record.temp_dir == str(seen["temp_dir"]) and record.root.pid in seen["pids"]
    assert not [pid for pid in [*seen["pids"], seen["keeper"]] if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "the head's processes outlived close()"
    assert not seen["temp_dir"].exists() and seen["close_s"] < 15
    after = load(tmp_path / "state")
    assert after.state == "stopped" and after.stopped_by == "the orchestrator"


def test_a_head_restarted_mid_job_reports_the_job_lost_and_its_rerun_finishes(tmp_path):
    """The head's machine fails (every Ray process SIGKILLed, the job's with them) and a new head comes up on the
    same ports without GCS persistence: it knows no earlier job. The backend waits out the silence, then reports the
    job lost; the loop submits a lost job again (core: MAX_LOST_RERUNS), and the rerun runs on the new head."""
    from aitrainsai_backend_ray.cluster import LocalCluster

    marker = tmp_path / "first-run"
    code = f"""
        import pathlib, time
        marker = pathlib.Path({str(marker)!r})
        if not marker.exists():
            marker.write_text('started')
            time.sleep(600)  # the head goes away meanwhile
        pathlib.Path('out').write_text('second run')
    """
    payload = job(tmp_path, "survivor", code, artifacts={"out": "out"})
    cluster = LocalCluster(num_cpus=1, num_gpus=0, object_store_mb=80).start(timeout_s=180)
    try:
        async def main():
            backend = RayBackend(RayConfig(address=cluster.url, poll_s=0.2, unreachable_s=240),
                                 workdir=tmp_path / "state")
            await backend.start()
            try:
                handle = await backend.submit(payload)
                await asyncio.to_thread(runner_pid, handle, 60)
                while not marker.exists():  # the payload itself runs (its runner starts a moment before it)
                    await asyncio.sleep(0.1)
                url = cluster.url
                await asyncio.to_thread(cluster.stop, 0)  # a crash: no process of the head gets a grace period
                await asyncio.to_thread(cluster.start, 180)  # the same ports; a head that knows no job
                assert cluster.url == url
                lost = await asyncio.wait_for(backend.wait(handle), 120)
                again = await backend.submit(payload)
                # a fresh head's first job starts its workers: minutes on 2 busy cores
                return handle, lost, again, await asyncio.wait_for(backend.wait(again), 300)
            finally:
                await backend.close()

        handle, lost, again, rerun = asyncio.run(main())
    finally:
        cluster.stop()
    assert lost.status == "dead" and lost.reason == "lost", lost
    assert "has no job" in lost.detail and handle.data["submission_id"] in lost.detail
    assert rerun.status == "done", rerun
    assert Path(rerun.artifacts["out"]).read_text() == "second run"
    first, second = handle.data["submission_id"], again.data["submission_id"]
    assert first.endswith("-1") and second == first[:-1] + "2"


def make_wheel(folder: Path, name: str, version: str, module: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel: ``module.VALUE`` is ``name``."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{module}/__init__.py": f"VALUE = {name!r}\n",
             f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()

    record = "".join(f"{path},sha256={digest(text)},"
                     f"{len(text.encode())}\n" for path, text in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{dist}.dist-info/RECORD": record}.items():
            archive.writestr(path, text)
    return wheel


def test_the_payloads_runtime_is_installed_by_a_ray_runtime_env(tmp_path):
    """runtime_env='pip': Ray builds a virtualenv for the payload's distributions on the node (one with a
    dependency nobody has is installed without it, as no_deps says); without it the node lacks them and the runner
    refuses the payload before it runs."""
    from aitrainsai import Runtime

    wheels = tmp_path / "wheelhouse"
    make_wheel(wheels, "aitrainsai-probe-a", "0.1", "probe_a", [])
    make_wheel(wheels, "aitrainsai-probe-b", "0.2", "probe_b", ["aitrainsai-nowhere-to-be-found"])
    runtime = Runtime(distributions={"aitrainsai-probe-a": "==0.1", "aitrainsai-probe-b": "==0.2"},
                      no_deps=["aitrainsai-probe-b"])
    code = ("import pathlib, sys, probe_a, probe_b\n"
            "pathlib.Path('out').write_text(f'{probe_a.VALUE} {probe_b.VALUE} {sys.prefix}')\n")
    bare = job(tmp_path, "bare", code, runtime=runtime)
    refused = go(tmp_path / "bare-state", lambda b: asyncio.wait_for(b.run(bare), 120))
    assert refused.status == "dead" and refused.reason == "infra", refused
    assert "distribution aitrainsai-probe-a is not installed on node" in refused.detail

    payload = job(tmp_path, "installed", code, runtime=runtime, artifacts={"out": "out"})
    result = go(tmp_path / "state", lambda b: asyncio.wait_for(b.run(payload), 600), runtime_env="pip",
                pip_args=["--no-index", "--find-links", str(wheels)])
    assert result.status == "done", result
    a, b, prefix = Path(result.artifacts["out"]).read_text().split()
    assert (a, b) == ("aitrainsai-probe-a", "aitrainsai-probe-b")
    assert Path(prefix) != Path(sys.prefix), "the payload ran in this interpreter's environment, not Ray's virtualenv"
