"""A Ray head on this machine, on loopback only, that this process starts and stops (by process id, never with
``ray stop``, which stops every Ray process of the user); and the mapping of a configured address to the URL of a
cluster's job submission API (its dashboard)."""

from __future__ import annotations


import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Lock

from aitrainsai.backends import BackendUnavailable

# Ray's own environment switches: no usage report; node IP 127.0.0.1, so that every server the head starts listens
# on loopback only (the flag's name is Ray's: it makes a node single-machine, which a local head is).
LOCAL_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's clients take these over any address they are given; the backend's address must win.
ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
_ENV_LOCK = Lock()


class ClusterError(BackendUnavailable):
    """A cluster that cannot be started or reached (one line)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def without_address_variables() -> Iterator[None]:
    """Hide ``RAY_ADDRESS`` and ``RAY_API_SERVER_ADDRESS`` while a Ray client is built, so that it talks to the
    address it is given (a driver started by Ray has ``RAY_ADDRESS`` set to its own cluster)."""
    with _ENV_LOCK:
        saved = {name: os.environ.pop(name) for name in ADDRESS_VARIABLES if name in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


def dashboard_url(address: str, dashboard_port: int) -> str:
    """The job submission URL of ``address``: an ``http(s)://`` URL as it is; ``ray://host[:port]`` as
    ``http://host:<dashboard_port>``; ``auto`` or a GCS address ``host:port``: the URL that cluster's GCS holds
    (Ray's own lookup, which needs the GCS port reachable from here)."""
    address = address.strip()
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    if address.startswith("ray://"):
        host = address.removeprefix("ray://").split("/")[0].rsplit(":", 1)[0]
        if not host:
            raise ClusterError(f"address {address!r}: no host")
        return f"http://{host}:{dashboard_port}"
    if "://" in address:
        raise ClusterError(f"address {address!r}: use http://head:8265 (the dashboard), ray://head:10001, "
                           "a GCS address head:6379, or auto")
    from ray.dashboard.utils import ray_address_to_api_server_url

    try:
        with without_address_variables():
            return ray_address_to_api_server_url(address).rstrip("/")
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; the run needs one line
        raise ClusterError(f"no Ray cluster found at {address!r}: {' '.join(str(exc).split())[:300]}") from None


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the job submission API at ``url`` answers."""
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def alive_nodes(url: str, timeout_s: float = 2.0) -> int:
    """How many live nodes the cluster at ``url`` reports (Ray's state API); 0 when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/api/v0/nodes?limit=1000", timeout=timeout_s) as response:
            result = json.loads(response.read())["data"]["result"]["result"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return sum(1 for node in result if isinstance(node, dict) and node.get("state") == "ALIVE")


def _listens(port: int) -> bool:
    """Whether something accepts connections on the loopback ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


class LocalCluster:
    """``ray start --head --block`` in its own session with its own temp dir; every server on 127.0.0.1.

    ``python_dir`` goes first on the head's PATH, so that a job's ``python`` is this interpreter's environment. A
    stopped cluster started again listens on the same ports: a restarted head, which knows no earlier job."""

    def __init__(self, *, num_cpus: int | None = None, num_gpus: int | None = None, object_store_mb: int = 256,
                 python_dir: Path | None = None):
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.object_store_mb = object_store_mb
        self.python_dir = python_dir or Path(sys.executable).parent
        self.temp_dir: Path | None = None
        self.url = ""
        self.gcs_address = ""
        self.process: subprocess.Popen | None = None
        self.started_s = 0.0
        self._log = None
        self._ports: list[int] = []  # GCS, dashboard, client server, dashboard agent: chosen at the first start

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        ray = shutil.which("ray", path=str(self.python_dir)) or str(Path(sys.executable).parent / "ray")
        if not Path(ray).exists():
            raise ClusterError("the ray command is not installed next to this interpreter: "
                               "pip install 'ray[default]==2.60.0'")
        # short: Ray's socket paths live under it and a Unix socket path has at most 107 characters
        self.temp_dir = Path(tempfile.mkdtemp(prefix="aitrainsai-ray-", dir="/tmp" if Path("/tmp").is_dir() else None))
        self._ports = self._ports or [free_port() for _ in range(4)]
        port, dashboard, client, agent = self._ports
        self.gcs_address, self.url = f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}"
        command = [ray, "start", "--head", "--block", "--disable-usage-stats", f"--port={port}",
                   "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                   f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                   f"--temp-dir={self.temp_dir}", f"--object-store-memory={self.object_store_mb * 2**20}"]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        if self.num_gpus is not None:
            command.append(f"--num-gpus={self.num_gpus}")
        env = {k: v for k, v in os.environ.items() if k not in ADDRESS_VARIABLES}
        env.update(LOCAL_ENV, PATH=f"{self.python_dir}{os.pathsep}{env.get('PATH', '')}")
        self._log = open(self.temp_dir / "ray-start.log", "wb")  # noqa: SIM115 - open while the head runs
        begin = time.monotonic()
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # the dashboard answers a moment before the head's node has joined, and the node before its job agent (which
        # starts every job) listens: a job submitted before that can stay pending
        while not (alive_nodes(self.url) and _listens(agent)):
            if self.process.poll() is not None or time.monotonic() - begin > timeout_s:
                tail = self._tail()
                self.stop()
                raise ClusterError(f"the local Ray head did not start within {timeout_s:g} s: {tail}")
            time.sleep(0.2)
        self.started_s = time.monotonic() - begin
        return self

    def pids(self) -> list[int]:
        """The head's processes: ``ray start`` and everything under it (servers, workers, jobs)."""
        if self.process is None:
            return []
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the head's processes, SIGKILL what is left after ``grace_s``, and delete its temp dir; with
        ``grace_s=0`` every process gets SIGKILL at once, as when the head's machine fails."""
        import psutil

        processes = []
        for pid in self.pids():
            try:
                processes.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        wait_s = max(grace_s, 0.5)  # even a crash waits for the dead to be reaped
        for process in processes:
            with _quiet():
                process.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        _, alive = psutil.wait_procs(processes, timeout=wait_s)
        for process in alive:
            with _quiet():
                process.kill()
        psutil.wait_procs(alive, timeout=wait_s)
        if self.process is not None:
            with _quiet():
                self.process.wait(timeout=wait_s)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def _tail(self) -> str:
        try:
            text = (self.temp_dir / "ray-start.log").read_text(errors="replace") if self.temp_dir else ""
        except OSError:
            return ""
        return " ".join(text.split())[-400:]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _quiet() -> contextlib.suppress:
    """Ignore a process that is gone already (or will not wait)."""
    import psutil

    return contextlib.suppress(psutil.Error, OSError, subprocess.TimeoutExpired)
