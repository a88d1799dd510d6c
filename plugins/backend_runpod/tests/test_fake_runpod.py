"""The fake Runpod, driven through the real ``runpod`` SDK and the real OpenSSH client over loopback."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests
import runpod
from aitrainsai_backend_runpod.testing.fake_runpod import NO_CAPACITY, SSHD, FakeRunpod
from runpod.api.graphql import run_graphql_query

RTX, A100 = "NVIDIA GeForce RTX 4090", "NVIDIA A100 80GB PCIe"
# the probe a pod runs as its main process: its environment, then a dead-man switch over REST v1
PROBE = """
import json, os, pathlib, time, urllib.error, urllib.request
print("probe up", flush=True)
pathlib.Path("env.json").write_text(json.dumps(dict(os.environ)))
while not os.path.exists("go"):
    time.sleep(0.05)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def stop(pod_id):
    request = urllib.request.Request(f"{os.environ['REST']}/pods/{pod_id}/stop", method="POST",
                                     headers={"Authorization": "Bearer " + os.environ["RUNPOD_API_KEY"]})
    try:
        return opener.open(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
pathlib.Path("other.code").write_text(str(stop(pathlib.Path("go").read_text())))
stop(os.environ["RUNPOD_POD_ID"])
time.sleep(600)
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    missing = [tool for tool in (SSHD, "ssh", "ssh-keygen") if not shutil.which(tool)]
    if missing:
        message = f"the fake Runpod's pods need OpenSSH: {', '.join(missing)} not found"
        if os.environ.get("AITRAINSAI_REQUIRE_SSHD") == "1":
            pytest.fail(message + " (AITRAINSAI_REQUIRE_SSHD=1)")
        pytest.skip(message)
    saved_env = {name: os.environ.get(name) for name in ("RUNPOD_API_BASE_URL", "NO_PROXY", "no_proxy")}
    saved_key = runpod.api_key
    with FakeRunpod(tmp_path_factory.mktemp("runpod"), boot_s=0.3) as server:
        # loopback only, never through a proxy
        os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
        os.environ["RUNPOD_API_BASE_URL"] = server.url
        runpod.api_key = server.api_key
        try:
            yield server
        finally:
            runpod.api_key = saved_key
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    path = tmp_path_factory.mktemp("ssh") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return path, path.with_suffix(".pub").read_text().strip()


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def create(key, name: str, gpu: str = RTX, docker_args: str = "sleep 300", **env) -> str:
    pod = runpod.create_pod(name, "runpod/pytorch:2.4.0", gpu, ports="22/tcp", docker_args=docker_args,
                            env={"PUBLIC_KEY": key[1], **env})
    return pod["id"]


def ssh_port(pod_id: str) -> int:
    runtime = wait_for(lambda: runpod.get_pod(pod_id)["runtime"], what=f"{pod_id}'s runtime")
    (port,) = [p["publicPort"] for p in runtime["ports"] if p["privatePort"] == 22]
    return port


def ssh(key, port: int, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", str(key[0]), "-p", str(port), "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                           f"{getpass.getuser()}@127.0.0.1", command],
                          check=False, capture_output=True, text=True, timeout=30)


def rest(fake, method: str, path: str, token: str) -> int:
    request = urllib.request.Request(fake.rest_url + path, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_pod_lifecycle_over_ssh(fake, key):
    first = create(key, "job-a")
    (listed,) = [pod for pod in runpod.get_pods() if pod["id"] == first]
    assert (listed["desiredStatus"], listed["runtime"], listed["uptimeSeconds"]) == ("RUNNING", None, 0)
    assert (listed["costPerHr"], listed["gpuCount"], listed["dockerArgs"]) == (0.69, 1, "sleep 300")
    assert f"PUBLIC_KEY={key[1]}" in listed["env"] and listed["machine"]["podHostId"].startswith(first)
    assert fake.calls[-3:] == ["gpu_type", "create_pod", "get_pods"]
    second = create(key, "job-b")
    port = ssh_port(first)
    custom = run_graphql_query(
        "query myPods { myself { pods { id name desiredStatus lastStatusChange costPerHr runtime { uptimeInSeconds "
        "ports { ip isIpPublic privatePort publicPort type } } } } }")["data"]["myself"]["pods"]
    (mine,) = [pod for pod in custom if pod["id"] == first]
    assert mine["runtime"]["ports"] == [{"ip": "127.0.0.1", "isIpPublic": True, "privatePort": 22,
                                         "publicPort": port, "type": "tcp"}]
    assert mine["lastStatusChange"].startswith("Rented by User: ")

    # commands run in the pod's own home; another pod does not see its files
    result = ssh(key, port, "pwd; echo hi > f.txt")
    assert result.returncode == 0, result.stderr
    home = Path(fake.pod(first)["home"])
    assert result.stdout.split() == [str(home)] and (home / "f.txt").read_text() == "hi\n"
    result = ssh(key, ssh_port(second), "pwd; ls")
    assert result.stdout.split() == [fake.pod(second)["home"]], result.stderr

    # a background job started over SSH dies with the pod (/proc is the host's: the pid read there is a host pid)
    result = ssh(key, port, "nohup sh -c 'read -r pid rest < /proc/self/stat; echo $pid > bg.pid; exec sleep 1000' "
                            ">/dev/null 2>&1 &")
    assert result.returncode == 0, result.stderr
    pid = int(wait_for(lambda: (home / "bg.pid").exists() and (home / "bg.pid").read_text().strip(), what="bg.pid"))
    assert pid_alive(pid) and b"1000" in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert runpod.terminate_pod(first) is None
    wait_for(lambda: not pid_alive(pid), timeout=5, what="the background job to die")
    assert first not in [pod["id"] for pod in runpod.get_pods()] and runpod.get_pod(first) is None
    assert ssh(key, port, "true").returncode == 255
    with pytest.raises(runpod.error.QueryError, match="pod not found to terminate"):
        runpod.terminate_pod(first)

    # stop: killed, still listed as EXITED
    assert runpod.stop_pod(second) == {"id": second, "desiredStatus": "EXITED"}
    stopped = runpod.get_pod(second)
    assert (stopped["desiredStatus"], stopped["runtime"]) == ("EXITED", None)
    assert second in [pod["id"] for pod in runpod.get_pods()]
    runpod.terminate_pod(second)


def test_errors_the_sdk_raises(fake):
    with pytest.raises(runpod.error.AuthenticationError):
        runpod.get_pods(api_key="rp-wrong-key")
    fake.fail_next(1, 429, "json")
    with pytest.raises(KeyError, match="data"):
        runpod.get_pods()
    fake.fail_next(2, 429, "text")
    for _ in range(2):
        with pytest.raises(requests.JSONDecodeError):
            runpod.get_pods()
    assert isinstance(runpod.get_pods(), list)
    fake.set_capacity(A100, 0)
    calls = len(fake.calls)
    with pytest.raises(runpod.error.QueryError, match="no longer any instances") as info:
        runpod.create_pod("no-room", "img", A100)
    assert str(info.value) == NO_CAPACITY and fake.calls[calls:] == ["gpu_type", "create_pod"]
    fake.set_capacity(A100, None)
    with pytest.raises(ValueError, match="No GPU found"):
        runpod.create_pod("unknown", "img", "NVIDIA Imaginary 1GB")
    with pytest.raises(runpod.error.QueryError):
        runpod.create_pod("cpu", "img")


def test_stuck_and_sshd_less_pods(fake, key):
    fake.stuck_next = 1
    stuck = create(key, "stuck", gpu=A100)
    fake.no_sshd_next = 1
    no_sshd = create(key, "no-sshd")
    port = ssh_port(no_sshd)
    result = ssh(key, port, "true")
    assert result.returncode == 255 and "Connection refused" in result.stderr
    time.sleep(3 * fake.boot_s)
    pod = runpod.get_pod(stuck)
    assert (pod["desiredStatus"], pod["runtime"], pod["costPerHr"]) == ("RUNNING", None, 1.64)
    for pod_id in (stuck, no_sshd):
        runpod.terminate_pod(pod_id)


def test_outbid_and_main_process_exit(fake, key):
    outbid = create(key, "spot")
    exiting = create(key, "short", docker_args="sleep 0.5")
    port = ssh_port(outbid)
    fake.outbid(outbid)
    pod = runpod.get_pod(outbid)
    assert pod["desiredStatus"] == "EXITED" and pod["lastStatusChange"].startswith("Outbid: ")
    assert outbid in [p["id"] for p in runpod.get_pods()]
    assert ssh(key, port, "true").returncode == 255
    pod = wait_for(lambda: (p := runpod.get_pod(exiting))["desiredStatus"] == "EXITED" and p, what="the exit")
    assert pod["lastStatusChange"].startswith("Exited by Runpod: ") and pod["runtime"] is None
    for pod_id in (outbid, exiting):
        runpod.terminate_pod(pod_id)


def test_pod_environment_and_dead_man_switch(fake, key, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    victim = create(key, "victim")
    pod_id = create(key, "probe", docker_args=f"{sys.executable} {probe}", REST=fake.rest_url)
    home = Path(fake.pod(pod_id)["home"])
    env = json.loads(wait_for(lambda: (home / "env.json").exists() and (home / "env.json").read_text(), what="env"))
    assert (env["RUNPOD_POD_ID"], env["PUBLIC_KEY"], env["HOME"]) == (pod_id, key[1], str(home))
    assert env["RUNPOD_API_KEY"] not in ("", fake.api_key) and env["PATH"] == "/usr/bin:/bin"
    assert "probe up" in (home.parent / "container.log").read_text()

    # its own key stops it; another pod's key is refused
    (home / "go").write_text(victim)
    wait_for(lambda: runpod.get_pod(pod_id)["desiredStatus"] == "EXITED", what="the pod to stop itself")
    assert (home / "other.code").read_text() == "403"
    assert runpod.get_pod(victim)["desiredStatus"] == "RUNNING"
    assert fake.calls.count("rest_stop") == 2

    assert rest(fake, "DELETE", f"/pods/{victim}", "rp-wrong-key") == 401
    assert rest(fake, "DELETE", f"/pods/{victim}", env["RUNPOD_API_KEY"]) == 403
    assert rest(fake, "DELETE", f"/pods/{victim}", fake.api_key) == 200
    assert fake.calls[-1] == "rest_delete" and runpod.get_pod(victim) is None
    runpod.terminate_pod(pod_id)
    assert fake.pods() == []


def test_close_leaves_no_process(fake, key, tmp_path, monkeypatch):
    def processes_under(root: Path) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(root).encode() in (entry / "cmdline").read_bytes() and pid_alive(
                        int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    with FakeRunpod(tmp_path, api_key=fake.api_key, boot_s=0.1) as other:
        monkeypatch.setenv("RUNPOD_API_BASE_URL", other.url)
        pod_id = create(key, "main", docker_args="sh -c 'read -r pid rest < /proc/self/stat; echo $pid > main.pid; "
                                                 "exec sleep 300'")
        ssh_port(pod_id)
        pid_file = Path(other.pod(pod_id)["home"]) / "main.pid"
        main_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="main.pid"))
        assert pid_alive(main_pid) and len(processes_under(tmp_path)) >= 2    # the launcher and sshd
    wait_for(lambda: not pid_alive(main_pid) and not processes_under(tmp_path), timeout=5, what="every process to die")
