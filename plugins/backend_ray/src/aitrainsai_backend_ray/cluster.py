"""A Ray head on this machine, on loopback only, that this process starts and stops (by process id, never with
``ray stop``, which stops every Ray process of the user), watched by a keeper for when this process dies; and the
mapping of a configured address to the URL of a cluster's job submission API (its dashboard)."""

from __future__ import annotations


import contextlib
import json
import os
import shutil
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
from threading import Event, Lock
from typing import BinaryIO

from aitrainsai import BackendUnavailable

from aitrainsai_backend_ray import keeper
from aitrainsai_backend_ray.keeper import TEMP_PREFIX, HeadRecord, Proc, head_processes

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
    stopped cluster started again listens on the same ports: a restarted head, which knows no earlier job.

    With ``keeper_dir`` (the backend's folder) the head is recorded there and watched by a keeper process
    (:mod:`.keeper`) from the moment ``ray start`` runs: once this process has been gone for ``keeper_grace_s`` the
    keeper stops the head; :meth:`adopt` lets a later process on the same folder take the head over instead."""

    def __init__(self, *, num_cpus: int | None = None, num_gpus: int | None = None, object_store_mb: int = 256,
                 python_dir: Path | None = None, keeper_dir: Path | None = None, keeper_grace_s: float = 300.0):
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.object_store_mb = object_store_mb
        self.python_dir = python_dir or Path(sys.executable).parent
        self.keeper_dir = keeper_dir
        self.keeper_grace_s = keeper_grace_s
        self.temp_dir: Path | None = None
        self.url = ""
        self.gcs_address = ""
        self.process: subprocess.Popen | None = None
        self.root: Proc | None = None  # the ray start process (this process's child, or an adopted head's)
        self.keeper: subprocess.Popen | None = None  # a keeper this process started
        self.adopted = False
        self.started_s = 0.0
        self._log: BinaryIO | None = None
        self._ports: list[int] = []  # GCS, dashboard, client server, dashboard agent: chosen at the first start

    def start(self, timeout_s: float = 120.0, *, abort: Event | None = None) -> LocalCluster:
        """Start the head and wait until it runs jobs; ``abort`` (set from another thread) stops it meanwhile."""
        ray = shutil.which("ray", path=str(self.python_dir)) or str(Path(sys.executable).parent / "ray")
        if not Path(ray).exists():
            raise ClusterError("the ray command is not installed next to this interpreter: "
                               "pip install 'ray[default]==2.60.0'")
        # short: Ray's socket paths live under it and a Unix socket path has at most 107 characters
        self.temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp" if Path("/tmp").is_dir() else None))
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
        self.root = Proc.of(self.process.pid) or Proc(pid=self.process.pid, started=0.0)
        if self.keeper_dir is not None:
            self._record_and_keep()
        # the dashboard answers a moment before the head's node has joined, and the node before its job agent (which
        # starts every job) listens: a job submitted before that can stay pending
        while not (alive_nodes(self.url) and _listens(agent)):
            if abort is not None and abort.is_set():
                self.stop()
                raise ClusterError("the local Ray head was stopped while it started")
            if self.process.poll() is not None or time.monotonic() - begin > timeout_s:
                tail = self._tail()
                self.stop()
                raise ClusterError(f"the local Ray head did not start within {timeout_s:g} s: {tail}")
            time.sleep(0.2)
        self.started_s = time.monotonic() - begin
        if self.keeper_dir is not None:
            with keeper.locked(self.keeper_dir):
                record = keeper.load(self.keeper_dir)
                if record is None or record.temp_dir != str(self.temp_dir) or record.state == "stopped":
                    self.stop()
                    raise ClusterError(f"the local Ray head was stopped while it started: "
                                       f"{record.stopped_by if record else 'its record is gone'}")
                record.state = "running"
                keeper.save(self.keeper_dir, record)
        return self

    def _record_and_keep(self) -> None:
        """Record the head in ``keeper_dir`` and start its keeper, before the head has finished starting (this
        process may die meanwhile)."""
        assert self.keeper_dir is not None and self.root is not None and self.temp_dir is not None
        record = HeadRecord(temp_dir=str(self.temp_dir), root=self.root, owner=Proc.of(os.getpid()),
                            grace_s=self.keeper_grace_s, url=self.url, gcs_address=self.gcs_address,
                            ports=self._ports)
        with keeper.locked(self.keeper_dir):
            keeper.save(self.keeper_dir, record)
        self.keeper = _start_keeper(self.keeper_dir)
        with keeper.locked(self.keeper_dir):
            current = keeper.load(self.keeper_dir)
            if current is not None and current.temp_dir == record.temp_dir:
                current.keeper = Proc.of(self.keeper.pid)
                keeper.save(self.keeper_dir, current)

    @classmethod
    def adopt(cls, keeper_dir: Path, *, keeper_grace_s: float = 300.0, python_dir: Path | None = None,
              answer_s: float = 10.0) -> tuple[LocalCluster | None, str]:
        """The head an earlier process recorded in ``keeper_dir``, if it still runs and answers: this process becomes
        its owner (its keeper, started anew if it is gone, now watches this process). Otherwise every process of
        that head is stopped and its temp dir removed, and there is no cluster. Also returns what was done, in
        words ('' when no head was recorded). A head that reports no live node within ``answer_s`` is not adopted."""
        with keeper.locked(keeper_dir):
            record = keeper.load(keeper_dir)
            if record is None or (record.state == "stopped" and not head_processes(record.root, record.temp_dir)):
                return None, ""
            if record.state == "running" and record.root.alive() and _answers_soon(record.url, answer_s):
                cluster = cls(python_dir=python_dir, keeper_dir=keeper_dir, keeper_grace_s=keeper_grace_s)
                cluster.temp_dir, cluster.root, cluster.adopted = Path(record.temp_dir), record.root, True
                cluster.url, cluster.gcs_address, cluster._ports = record.url, record.gcs_address, record.ports
                owner = Proc.of(os.getpid())
                assert owner is not None  # this process runs
                record.owner, record.grace_s = owner, keeper_grace_s
                if record.keeper is None or not record.keeper.alive():
                    cluster.keeper = _start_keeper(keeper_dir)
                    record.keeper = Proc.of(cluster.keeper.pid)
                keeper.save(keeper_dir, record)
                return cluster, f"adopted the head in {record.temp_dir} (ray start pid {record.root.pid})"
            why = record.stopped_by or ("it did not answer" if record.root.alive() else "its ray start had ended")
            count = keeper.sweep(record.root, record.temp_dir)
            record.state, record.stopped_by = "stopped", record.stopped_by or f"the resumed run: {why}"
            keeper.save(keeper_dir, record)
            return None, f"the head in {record.temp_dir} was not adopted ({why}); {count} of its processes stopped"

    def pids(self) -> list[int]:
        """The head's processes: ``ray start`` and everything of its session and under it (servers, workers, jobs)."""
        if self.temp_dir is None:
            return []
        return [process.pid for process in head_processes(self.root, str(self.temp_dir))]

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the head's processes, SIGKILL what is left after ``grace_s``, and delete its temp dir; with
        ``grace_s=0`` every process gets SIGKILL at once, as when the head's machine fails. Its keeper goes too."""
        if self.keeper_dir is not None and self.temp_dir is not None:
            with keeper.locked(self.keeper_dir):  # the keeper stands down (or sweeps what this stop leaves)
                record = keeper.load(self.keeper_dir)
                if record is not None and record.temp_dir == str(self.temp_dir) and record.state != "stopped":
                    record.state, record.stopped_by = "stopped", "the orchestrator"
                    keeper.save(self.keeper_dir, record)
        if self.temp_dir is not None:
            keeper.sweep(self.root, str(self.temp_dir), grace_s)
        if self.process is not None:
            with _quiet():
                self.process.wait(timeout=1.0)
            self.process = None
        self._stop_keeper()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
        self.root = None

    def _stop_keeper(self) -> None:
        if self.keeper is not None:
            with _quiet():
                self.keeper.terminate()
                self.keeper.wait(timeout=2.0)
            with _quiet():
                self.keeper.kill()
                self.keeper.wait(timeout=1.0)
            self.keeper = None
        elif self.adopted and self.keeper_dir is not None:  # an earlier process's keeper
            record = keeper.load(self.keeper_dir)
            process = record.keeper if record is not None else None
            if process is not None and process.alive():
                import psutil

                with _quiet():
                    found = psutil.Process(process.pid)
                    found.terminate()
                    keeper.wait_gone([found], 2.0)

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


def _start_keeper(folder: Path) -> subprocess.Popen:
    """The keeper of the head recorded in ``folder``, in its own session (a Ctrl-C to the orchestrator's terminal
    does not reach it), logging to ``folder/keeper.log``."""
    with open(folder / keeper.LOG, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "aitrainsai_backend_ray.keeper", str(folder)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                                start_new_session=True)


def _answers_soon(url: str, within_s: float = 10.0) -> bool:
    """Whether the head at ``url`` reports a live node within ``within_s`` (a busy head may be slow to answer)."""
    deadline = time.monotonic() + within_s
    while True:
        if alive_nodes(url):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _quiet() -> contextlib.suppress:
    """Ignore a process that is gone already (or will not wait)."""
    import psutil

    return contextlib.suppress(psutil.Error, OSError, subprocess.TimeoutExpired)
