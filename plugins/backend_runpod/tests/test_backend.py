"""The Runpod backend against the fake Runpod: the real SDK over HTTP, jobs over real SSH to real sshd pods.

Every test ends with no pod of its run left in the fake account (``assert_no_pods``)."""

from __future__ import annotations

import asyncio
import getpass
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aitrainsai import PYTHON, JobPayload
from aitrainsai.testing import GpuBackendConformance
from aitrainsai_backend_runpod.backend import RunpodBackend
from aitrainsai_backend_runpod.config import RunpodConfig
from aitrainsai_backend_runpod.pool import read_pod_records

pytestmark = pytest.mark.slow  # pods boot and jobs go over SSH: seconds each

GPU = "NVIDIA GeForce RTX 4090"
OTHER_GPU = "NVIDIA A100 80GB PCIe"
CLI = str(Path(sys.executable).parent / "aitrainsai")
FAKE = None  # the session's FakeRunpod, for the conformance kit's make_config (which takes no fixtures)


@pytest.fixture(autouse=True)
def _fake(runpod_fake):
    global FAKE
    FAKE = runpod_fake
    runpod_fake.set_capacity(GPU, None)
    runpod_fake.set_capacity(OTHER_GPU, None)
    runpod_fake.stuck_next = runpod_fake.no_sshd_next = 0
    yield runpod_fake


def config(**overrides) -> RunpodConfig:
    values = {"api_base_url": FAKE.url, "rest_url": FAKE.rest_url, "gpu_types": [GPU], "max_pods": 2, "poll_s": 0.2,
              "boot_timeout_s": 20, "ssh_user": getpass.getuser(), "python": sys.executable,
              "pip_args": ["--no-index"], "deadman_s": 600, "backoff_s": 0.05, "idle_timeout_s": 600, "wait_s": 2.0}
    return RunpodConfig(**{**values, **overrides})


def pods_of(backend: RunpodBackend) -> list[dict]:
    return [p for p in FAKE.pods() if p["name"].startswith(f"aitrainsai-{backend.run_tag}-")]


def assert_no_pods(state: Path) -> None:
    tag = state.resolve().parent.name
    left = [p["id"] for p in FAKE.pods() if p["name"].startswith(f"aitrainsai-{tag}-")]
    assert not left, f"pods left billing: {left}"


def go(state: Path, body, **overrides):
    """Start a backend, run ``body(backend)``, close it; then check that no pod of it is left."""

    async def main():
        backend = RunpodBackend(config(**overrides), workdir=state)
        await backend.start()
        try:
            return await body(backend)
        finally:
            await backend.close()

    try:
        return asyncio.run(main())
    finally:
        assert_no_pods(state)


def job(tmp_path: Path, name: str, code: str, **fields) -> JobPayload:
    workdir = tmp_path / "jobs" / name
    workdir.mkdir(parents=True)
    (workdir / "job.py").write_text(textwrap.dedent(code))
    return JobPayload(job_id=name, workdir=workdir, command=[PYTHON, "job.py"], **fields)


class TestConformance(GpuBackendConformance):
    """The core's kit; a vanished pod is reported lost at once here (no retry), which the kit checks."""

    backend = RunpodBackend
    distribution = "aitrainsai-backend-runpod"
    settle_s = 2.5

    def make_config(self):
        return config(lost_retries=0)

    def vanish(self, backend, handle):
        FAKE.outbid(handle.data["pod_id"])


def test_the_pool_is_warm_and_starts_the_longest_job_first(tmp_path):
    code = "import time, pathlib; pathlib.Path('started').write_text(repr(time.time())); time.sleep(0.3)"
    payloads = [job(tmp_path, f"j{i}", code, expected_s=e, artifacts={"started": "started"})
                for i, e in enumerate([10, 30, 20])]

    async def body(backend):
        handles = [await backend.submit(p) for p in payloads]
        results = await asyncio.gather(*(backend.wait(h) for h in handles))
        return handles, results

    handles, results = go(tmp_path / "run" / "backend", body, max_pods=1)
    assert all(r.status == "done" for r in results), results
    started = {r.job_id: float(Path(r.artifacts["started"]).read_text()) for r in results}
    assert sorted(started, key=started.get) == ["j1", "j2", "j0"]
    assert len({h.data["pod_id"] for h in handles}) == 1, "the pod was not reused"
    assert all(r.cost_usd > 0 for r in results)


def test_a_pod_outbid_mid_job_is_replaced_and_the_job_runs_again_once(tmp_path):
    code = "import time, pathlib; pathlib.Path('out').write_text('ok'); time.sleep(2)"
    payload = job(tmp_path, "j", code, artifacts={"out": "out"})

    async def body(backend):
        handle = await backend.submit(payload)
        while "pod_id" not in handle.data:
            await asyncio.sleep(0.1)
        first = handle.data["pod_id"]
        await asyncio.sleep(0.5)
        FAKE.outbid(first)
        result = await asyncio.wait_for(backend.wait(handle), 120)
        return first, handle.data["pod_id"], result

    first, second, result = go(tmp_path / "run" / "backend", body, max_pods=1)
    assert result.status == "done", result
    assert second != first


def test_a_second_loss_is_a_lost_job(tmp_path):
    payload = job(tmp_path, "j", "import time; time.sleep(60)")

    async def body(backend):
        handle = await backend.submit(payload)
        lost = None
        for _ in range(2):
            while handle.data.get("pod_id") in (None, lost):
                await asyncio.sleep(0.1)
            lost = handle.data["pod_id"]
            await asyncio.sleep(0.5)
            FAKE.outbid(lost)
        return await asyncio.wait_for(backend.wait(handle), 120)

    result = go(tmp_path / "run" / "backend", body, max_pods=1)
    assert result.status == "dead" and result.reason == "lost" and "run 2 times" in result.detail, result


@pytest.mark.parametrize("fault", ["stuck", "no_sshd"])
def test_a_pod_that_never_boots_or_refuses_ssh_is_replaced(tmp_path, fault):
    setattr(FAKE, f"{fault}_next", 1)
    payload = job(tmp_path, "j", "print('ran')")

    async def body(backend):
        return await asyncio.wait_for(backend.run(payload), 120)

    state = tmp_path / "run" / "backend"
    result = go(state, body, max_pods=1, boot_timeout_s=3)
    assert result.status == "done", result
    records = read_pod_records(state)
    assert len(records) == 2 and all(r.get("terminated") for r in records), records
    assert "within 3 s" in records[0]["why"]


def test_no_capacity_falls_back_to_the_next_gpu_type_then_gives_up_with_a_reason(tmp_path):
    FAKE.set_capacity(GPU, 0)
    payload = job(tmp_path, "j", "print('ran')")

    async def body(backend):
        handle = await backend.submit(payload)
        return handle, await asyncio.wait_for(backend.wait(handle), 120)

    _, result = go(tmp_path / "a" / "backend", body, max_pods=1, gpu_types=[GPU, OTHER_GPU])
    assert result.status == "done", result
    FAKE.set_capacity(OTHER_GPU, 0)
    _, result = go(tmp_path / "b" / "backend", body, max_pods=1, gpu_types=[GPU, OTHER_GPU], boot_attempts=2)
    assert result.status == "dead" and result.reason == "infra", result
    assert "could not get a Runpod pod" in result.detail and "no longer any instances" in result.detail


@pytest.mark.parametrize("body_kind", ["json", "text"])
def test_rate_limits_and_server_errors_are_retried_and_pods_are_listed_once_per_tick(tmp_path, body_kind):
    payloads = [job(tmp_path, f"j{i}", "import time; time.sleep(1)") for i in range(2)]

    async def body(backend):
        FAKE.fail_next(3, status=429, body=body_kind)
        handles = [await backend.submit(p) for p in payloads]
        FAKE.fail_next(2, status=503, body=body_kind)
        return await asyncio.wait_for(asyncio.gather(*(backend.wait(h) for h in handles)), 120)

    before = len(FAKE.calls)
    results = go(tmp_path / "run" / "backend", body, max_pods=2)
    assert all(r.status == "done" for r in results), results
    assert "get_pod" not in FAKE.calls[before:], "pods were polled one by one"


def test_an_error_inside_the_run_still_terminates_every_pod(tmp_path):
    async def body(backend):
        while not any(p.state == "ready" for p in backend.pool.pods.values()):
            await asyncio.sleep(0.1)
        raise KeyboardInterrupt  # Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        go(tmp_path / "run" / "backend", body)


def test_budget_stops_launching_jobs(tmp_path):
    payload = job(tmp_path, "j", "print('ran')")

    async def body(backend):
        while not any(p.state == "ready" for p in backend.pool.pods.values()):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)
        result = await asyncio.wait_for(backend.run(payload), 60)
        while pods_of(backend):  # the pool's pods are terminated once it has spent its budget
            await asyncio.sleep(0.1)
        return result

    result = go(tmp_path / "run" / "backend", body, max_pods=1, max_usd=1e-9)
    assert result.status == "dead" and result.reason == "budget" and "max_usd" in result.detail, result


def test_idle_pods_beyond_min_pods_are_terminated(tmp_path):
    payload = job(tmp_path, "j", "print('ran')")

    async def body(backend):
        result = await asyncio.wait_for(backend.run(payload), 60)
        while len(pods_of(backend)) > 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        return result, len(pods_of(backend))

    result, left = go(tmp_path / "run" / "backend", body, max_pods=2, min_pods=1, idle_timeout_s=1)
    assert result.status == "done" and left == 1, (result, left)


def test_out_of_memory_is_named(tmp_path):
    payload = job(tmp_path, "j", "import os, signal; print('allocating'); os.kill(os.getpid(), signal.SIGKILL)")
    result = go(tmp_path / "run" / "backend", lambda b: asyncio.wait_for(b.run(payload), 60), max_pods=1)
    assert result.status == "dead" and result.reason == "oom", result


def test_a_runtime_is_installed_once_per_pod(tmp_path):
    wheels = tmp_path / "wheels"
    source = tmp_path / "dist-src"
    (source / "src" / "kit_runtime_dist").mkdir(parents=True)
    (source / "src" / "kit_runtime_dist" / "__init__.py").write_text("VALUE = 'installed'\n")
    (source / "pyproject.toml").write_text(textwrap.dedent("""
        [project]
        name = "kit-runtime-dist"
        version = "0.1.0"
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [tool.hatch.build.targets.wheel]
        packages = ["src/kit_runtime_dist"]
    """))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(source)], check=True, capture_output=True, timeout=300)
    code = "import kit_runtime_dist, pathlib, sys; pathlib.Path('out').write_text(kit_runtime_dist.VALUE + sys.prefix)"
    payloads = [job(tmp_path, f"j{i}", code, artifacts={"out": "out"},
                    runtime={"distributions": {"kit-runtime-dist": "==0.1.0"}}) for i in range(2)]

    async def body(backend):
        first = await asyncio.wait_for(backend.run(payloads[0]), 300)
        (pod,) = [p for p in backend.pool.pods.values() if p.state != "gone"]
        ready = Path(FAKE.pod(pod.id)["home"]) / "aitrainsai" / "envs"
        stamp = {p: p.stat().st_mtime for p in ready.glob("*/.ready")}
        second = await asyncio.wait_for(backend.run(payloads[1]), 300)
        return first, second, stamp, {p: p.stat().st_mtime for p in ready.glob("*/.ready")}

    first, second, before, after = go(tmp_path / "run" / "backend", body, max_pods=1,
                                      pip_args=["--no-index", "--find-links", str(wheels)])
    assert first.status == "done" and second.status == "done", (first, second)
    assert Path(first.artifacts["out"]).read_text().startswith("installed")
    assert len(before) == 1 and before == after, "the runtime was installed again"


def distribution_source(folder: Path, name: str, dependencies: list[str]) -> Path:
    module = name.replace("-", "_")
    (folder / "src" / module).mkdir(parents=True)
    (folder / "src" / module / "__init__.py").write_text(f"NAME = {name!r}\n")
    (folder / "pyproject.toml").write_text(textwrap.dedent(f"""
        [project]
        name = "{name}"
        version = "0.2.0"
        dependencies = {dependencies!r}
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [tool.hatch.build.targets.wheel]
        packages = ["src/{module}"]
    """))
    return folder


def test_distributions_installed_here_from_a_folder_travel_as_wheels(tmp_path, monkeypatch):
    # two distributions installed here from local folders (as the workspace's editable ones are), on no index: the
    # backend builds their wheels and installs them on the pod from those; 'kit-model' goes without its dependency
    sources = [distribution_source(tmp_path / "shipped", "kit-shipped", []),
               distribution_source(tmp_path / "model", "kit-model", ["kit-absent-dependency"])]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), *map(str, sources)], check=True, capture_output=True, timeout=300)
    monkeypatch.syspath_prepend(str(site))
    code = "import kit_shipped, kit_model, pathlib, sys; pathlib.Path('out').write_text(kit_shipped.NAME + sys.prefix)"
    runtime = {"distributions": {"kit-shipped": "==0.2.0", "kit-model": "==0.2.0"}, "no_deps": ["kit-model"]}
    payloads = [job(tmp_path, f"j{i}", code, artifacts={"out": "out"}, runtime=runtime) for i in range(2)]

    async def body(backend):
        return [await asyncio.wait_for(backend.run(p), 300) for p in payloads]

    results = go(tmp_path / "run" / "backend", body, max_pods=1, pip_args=["--no-index"])
    assert [r.status for r in results] == ["done", "done"], results
    text = Path(results[0].artifacts["out"]).read_text()
    assert text.startswith("kit-shipped") and "/aitrainsai/envs/" in text
    wheels = (tmp_path / "run" / "backend" / "wheels").glob("*/*.whl")
    assert sorted(p.name.split("-")[0] for p in wheels) == ["kit_model", "kit_shipped"]

    # without the wheels, the pod has nowhere to find them: a dead job that says so
    (dead,) = go(tmp_path / "run2" / "backend",
                 lambda b: asyncio.gather(b.run(job(tmp_path, "k", code, runtime=runtime))),
                 max_pods=1, pip_args=["--no-index"], ship_local_wheels=False)
    assert dead.status == "dead" and dead.reason == "infra" and "could not be installed" in dead.detail, dead


def test_artifacts_from_the_pod_are_checked(tmp_path):
    code = "import os; os.makedirs('ckpt'); os.symlink('/etc/passwd', 'ckpt/link')"
    payload = job(tmp_path, "j", code, artifacts={"ckpt": "ckpt"})
    result = go(tmp_path / "run" / "backend", lambda b: asyncio.wait_for(b.run(payload), 60), max_pods=1)
    assert result.status == "dead" and result.reason == "artifact" and "ckpt/link" in result.detail, result
    assert not (payload.workdir / "ckpt" / "link").exists()


def test_a_pod_deletes_itself_when_the_orchestrator_is_gone(tmp_path):
    async def body(backend):
        while not any(p.state == "ready" for p in backend.pool.pods.values()):
            await asyncio.sleep(0.1)
        (pod,) = list(backend.pool.pods.values())
        backend.pool.closed = True  # the orchestrator "disappears": no more heartbeats
        backend.pool.monitor.cancel()
        for _ in range(100):
            if FAKE.pod(pod.id) is None:
                return pod.id
            await asyncio.sleep(0.2)
        return None

    gone = go(tmp_path / "run" / "backend", body, max_pods=1, deadman_s=3)
    assert gone is not None, "the pod did not delete itself"
    assert "rest_delete" in FAKE.calls


def test_pods_of_runs_no_process_runs_are_reaped_at_start_and_by_the_command(tmp_path):
    from aitrainsai import Ledger

    ledger = Ledger(tmp_path / "runs")
    dead, live = ledger.create_run({}, []), ledger.create_run({}, [])
    started = {}

    async def boot(run):
        backend = RunpodBackend(config(max_pods=1), workdir=run.dir / "backend")
        await backend.start()
        backend.pool.monitor.cancel()  # left running, as a killed orchestrator leaves it
        started[run.id] = next(iter(backend.pool.pods))

    def cli(*args):
        return subprocess.run([CLI, "runpod", *args, "--runs-dir", str(tmp_path / "runs"), "--api-base-url", FAKE.url],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "RUNPOD_API_KEY": FAKE.api_key})

    asyncio.run(boot(dead))  # its orchestrator is gone: nothing holds the run
    with live.hold():
        asyncio.run(boot(live))  # a backend starting in the same ledger reaps the dead run's pod
        assert FAKE.pod(started[dead.id]) is None
        assert FAKE.pod(started[live.id]) is not None
        out = cli("pods")
        assert f"run {live.id}: live" in out.stdout, out.stdout + out.stderr
        assert "0 pod(s) terminated" in cli("reap").stdout  # the live run's pod is kept
    out = cli("reap")  # now nothing runs it either
    assert out.returncode == 0 and "1 pod(s) terminated" in out.stdout, out.stdout + out.stderr
    assert FAKE.pod(started[live.id]) is None
    for run in (dead, live):
        assert all(r.get("terminated") for r in read_pod_records(run.dir / "backend"))


def test_a_missing_key_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY")
    with pytest.raises(RuntimeError, match="^no Runpod API key: set RUNPOD_API_KEY$"):
        asyncio.run(RunpodBackend(config(), workdir=tmp_path / "run" / "backend").start())
    assert not (tmp_path / "run").exists(), "something was created before the key was checked"


def test_a_run_without_a_key_is_refused_before_it_exists(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RUNPOD_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "run", "-s", "gpu_backend.use=runpod",
                          "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "Error: config: gpu_backend.runpod: no Runpod API key: set RUNPOD_API_KEY (see 'aitrainsai run --help')"]
    assert not (tmp_path / "runs").exists()


# -- a bounded close, hostile pod output, unknown GPU types, the commands' endpoint ------------------------------------
def test_close_is_bounded_when_the_api_hangs_and_a_pod_freezes(tmp_path):
    from aitrainsai_backend_runpod.pool import CLOSE_TIMEOUT_S

    payload = job(tmp_path, "j", "import time; time.sleep(60)")
    state = tmp_path / "run" / "backend"

    async def main():
        backend = RunpodBackend(config(max_pods=2), workdir=state)
        await backend.start()
        try:
            handle = await backend.submit(payload)
            pods = backend.pool.pods
            while "pod_id" not in handle.data or sum(p.state in ("ready", "busy") for p in pods.values()) < 2:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # the job's long poll is in flight
            FAKE.freeze(handle.data["pod_id"])  # every process of its pod stops: SSH to it hangs
            FAKE.hang_next(2, 90, "terminate_pod")  # the first terminate request of each pod is never answered
        finally:
            began = time.monotonic()
            await backend.close()
        return time.monotonic() - began

    took = asyncio.run(main())
    assert_no_pods(state)
    assert took < CLOSE_TIMEOUT_S, f"close() took {took:.1f} s"
    assert all(r.get("terminated") for r in read_pod_records(state))


@pytest.mark.hostile
def test_a_log_that_prints_the_old_marker_or_fake_fields_changes_nothing(tmp_path):
    noise = "print('@@aitrainsai@@'); print('out'); print('@@aitrainsai@@'); print('0'); print('137'); "
    ok = job(tmp_path, "ok", noise + "open('out', 'w').write('real')", artifacts={"out": "out"})
    failing = job(tmp_path, "failing", noise + "open('out', 'w').write('x'); raise SystemExit(3)",
                  artifacts={"out": "out"})
    done, failed = go(tmp_path / "run" / "backend", lambda b: asyncio.gather(b.run(ok), b.run(failing)), max_pods=1)
    assert done.status == "done" and Path(done.artifacts["out"]).read_text() == "real", done
    assert "@@aitrainsai@@" in done.log_tail
    assert failed.status == "dead" and failed.reason == "failed" and failed.exit_code == 3, failed


@pytest.mark.hostile
def test_a_hostile_artifact_stream_is_a_dead_job_not_an_exception(tmp_path):
    import io
    import tarfile

    from aitrainsai_backend_runpod.ssh import SshResult

    def stream(name: str, data: bytes = b"pwned", kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
            archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        return buffer.getvalue()

    whole = stream("out/w.bin", b"x" * 5000)
    hostile = {"climbing": stream("out/../../../../x"), "absolute": stream(str(tmp_path / "x")),
               "symlink": stream("out/link", kind=tarfile.SYMTYPE, link="/etc/passwd"),
               "hardlink": stream("out/link", kind=tarfile.LNKTYPE, link="/etc/passwd"),
               "truncated": whole[:2048]}
    payloads = {name: job(tmp_path, name, "import os; os.makedirs('out'); open('out/w.bin', 'w').write('w')",
                          artifacts={"out": "out"}) for name in hostile}

    async def body(backend):
        real_ssh = backend.pool.ssh

        async def compromised(pod, command, **kwargs):  # the pod's tar answers with a crafted stream
            result = await real_ssh(pod, command, **kwargs)
            for name in hostile:
                if "tar -cf -" in command and f"/jobs/{name}/" in command:
                    return SshResult(0, hostile[name], "")
            return result

        backend.pool.ssh = compromised
        return [await asyncio.wait_for(backend.run(p), 60) for p in payloads.values()]

    results = go(tmp_path / "run" / "backend", body, max_pods=1)
    for name, result in zip(hostile, results):
        assert result.status == "dead" and result.reason == "artifact", (name, result)
        assert result.detail.startswith("artifacts refused: ") and "\n" not in result.detail, (name, result.detail)
    assert not [p for p in tmp_path.rglob("x")], "a member landed outside the destination"
    assert not (payloads["symlink"].workdir / "out" / "link").exists()


def test_an_unknown_gpu_type_fails_the_start_in_one_line_without_retries(tmp_path):
    from aitrainsai import BackendUnavailable

    before = len(FAKE.calls)
    began = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        asyncio.run(RunpodBackend(config(gpu_types=["NVIDIA Imaginary 1GB", GPU]), workdir=tmp_path / "run" / "backend")
                    .start())
    message = str(info.value)
    assert "'NVIDIA Imaginary 1GB'" in message and "it lists: " in message and GPU in message, message
    assert "\n" not in message and time.monotonic() - began < 10
    assert "create_pod" not in FAKE.calls[before:] and FAKE.calls[before:].count("gpu_type") == 1, FAKE.calls[before:]


def test_a_gpu_type_that_disappears_mid_run_ends_queued_jobs_at_once(tmp_path, monkeypatch):
    payload = job(tmp_path, "j", "print('ran')")

    async def body(backend):
        while not any(p.state == "ready" for p in backend.pool.pods.values()):
            await asyncio.sleep(0.1)
        monkeypatch.delitem(FAKE.gpu_types, GPU)  # Runpod no longer lists it
        FAKE.outbid(next(iter(backend.pool.pods)))  # the pool must create a new pod
        while any(p.state != "gone" for p in backend.pool.pods.values()):
            await asyncio.sleep(0.1)
        before = len(FAKE.calls)
        result = await asyncio.wait_for(backend.run(payload), 60)
        return result, FAKE.calls[before:]

    result, calls = go(tmp_path / "run" / "backend", body, max_pods=1, backoff_s=0.5)
    assert result.status == "dead" and result.reason == "infra", result
    assert f"no GPU type {GPU!r}" in result.detail and OTHER_GPU in result.detail, result.detail
    assert calls.count("gpu_type") <= 2 and "create_pod" not in calls, calls  # looked up, never retried


def test_pods_and_reap_use_the_runs_recorded_endpoint(tmp_path):
    from aitrainsai import Ledger
    from aitrainsai_backend_runpod.testing.fake_runpod import FakeRunpod

    ledger = Ledger(tmp_path / "runs")
    run = ledger.create_run({"gpu_backend": {"use": "runpod", "runpod": config(max_pods=1).model_dump(mode="json")}},
                            [])
    other_run = ledger.create_run({"gpu_backend": {"use": "local", "local": {}}}, [])

    async def boot():
        backend = RunpodBackend(config(max_pods=1), workdir=run.dir / "backend")
        await backend.start()
        backend.pool.monitor.cancel()  # left running, as a killed orchestrator leaves it
        return next(iter(backend.pool.pods))

    pod_id = asyncio.run(boot())
    # nothing but loopback: a request to any other address goes to a proxy that refuses it
    env = {**{k: v for k, v in os.environ.items() if k.upper() not in ("RUNPOD_API_BASE_URL", "NO_PROXY")},
           "RUNPOD_API_KEY": FAKE.api_key, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost"}

    def cli(*args):
        return subprocess.run([CLI, "runpod", *args, "--runs-dir", str(tmp_path / "runs")], capture_output=True,
                              text=True, timeout=60, check=False, env=env)

    with FakeRunpod(tmp_path / "other-account", api_key=FAKE.api_key) as other:
        out = cli("pods", "--run", run.id, "--api-base-url", other.url)  # a flag wins over the record
        assert out.returncode == 0 and f"no pods named aitrainsai-{run.id}-*" in out.stdout, out.stdout + out.stderr
        assert "get_pods" in other.calls
    before = len(FAKE.calls)
    out = cli("pods", "--run", run.id)
    assert out.returncode == 0 and f"{pod_id}  aitrainsai-{run.id}-p000  run {run.id}: dead" in out.stdout, \
        out.stdout + out.stderr
    out = cli("reap", "--run", run.id)
    assert out.returncode == 0 and "1 pod(s) terminated" in out.stdout, out.stdout + out.stderr
    assert FAKE.calls[before:].count("get_pods") == 2 and "terminate_pod" in FAKE.calls[before:]
    assert FAKE.pod(pod_id) is None and all(r.get("terminated") for r in read_pod_records(run.dir / "backend"))
    out = cli("reap", "--run", other_run.id)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"Error: run {other_run.id} did not use the runpod GPU backend (gpu_backend.use is 'local')"], out.stderr
