"""The keeper of a head the backend starts, on a stand-in head (no Ray: a root process in its own session with a
server naming the head's temp dir, and a job's entrypoint in a session of its own whose payload left it): it stops
every process of the head once its orchestrator has been gone for the grace, and never a head a resumed
orchestrator adopted in time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from aitrainsai_backend_ray import keeper
from aitrainsai_backend_ray.cluster import LocalCluster, _start_keeper
from aitrainsai_backend_ray.keeper import TEMP_PREFIX, HeadRecord, Proc

GRACE_S = 1.5

# ray start's stand-in: a server that names the temp dir (as Ray's do) and a job entrypoint in its own session (as
# Ray's job supervisor starts it) whose payload double-forked away from it; every pid goes to the pid file
FAKE_HEAD = textwrap.dedent("""
    import os, subprocess, sys, time
    temp_dir, pids = sys.argv[1], sys.argv[2]
    PAYLOAD = '''
    import os, sys, time
    if os.fork() == 0:
        if os.fork() == 0:
            open(sys.argv[1], "a").write(f"{os.getpid()}\\\\n")
            time.sleep(600)
        os._exit(0)
    open(sys.argv[1], "a").write(f"{os.getpid()}\\\\n")
    time.sleep(600)
    '''
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"--temp-dir={temp_dir}"])
    open(pids, "a").write(f"{os.getpid()}\\n{server.pid}\\n")
    subprocess.Popen([sys.executable, "-c", PAYLOAD, pids], start_new_session=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Head:
    """A stand-in head recorded in ``folder`` as owned by ``owner``, with its keeper."""

    def __init__(self, tmp_path: Path, owner: Proc, url: str = ""):
        self.folder = tmp_path / "backend"
        self.folder.mkdir()
        self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
        pid_file = tmp_path / "pids"
        self.root = subprocess.Popen([sys.executable, "-c", FAKE_HEAD, self.temp_dir, str(pid_file)],
                                     start_new_session=True)
        deadline = time.monotonic() + 30
        while len(pid_file.read_text().split() if pid_file.exists() else []) < 4:
            assert time.monotonic() < deadline, "the stand-in head did not start"
            time.sleep(0.05)
        self.pids = [int(p) for p in pid_file.read_text().split()]
        record = HeadRecord(temp_dir=self.temp_dir, root=Proc.of(self.root.pid), owner=owner, grace_s=GRACE_S,
                            url=url, state="running")
        with keeper.locked(self.folder):
            keeper.save(self.folder, record)
        self.keeper = _start_keeper(self.folder)
        with keeper.locked(self.folder):
            record.keeper = Proc.of(self.keeper.pid)
            keeper.save(self.folder, record)

    def living(self) -> list[int]:
        return [pid for pid in self.pids if alive(pid)]

    def wait_gone(self, within_s: float) -> float:
        begin = time.monotonic()
        while self.living():
            assert time.monotonic() - begin < within_s, f"still running: {self.living()}"
            time.sleep(0.05)
        return time.monotonic() - begin

    def record(self) -> HeadRecord:
        return keeper.load(self.folder)

    def close(self) -> None:
        for pid in self.pids + [self.keeper.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.root.wait()
        self.keeper.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def orchestrator():
    """A process standing for the orchestrator that started the head (the test SIGKILLs it)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


def test_the_keeper_stops_every_process_of_a_head_whose_orchestrator_is_gone_for_its_grace(tmp_path, orchestrator):
    head = Head(tmp_path, Proc.of(orchestrator.pid))
    try:
        time.sleep(GRACE_S + 0.5)
        assert head.living() == head.pids, "the keeper stopped a head whose orchestrator runs"
        orchestrator.kill()
        orchestrator.wait()
        time.sleep(GRACE_S / 2)
        assert head.living() == head.pids, "the keeper did not wait for its grace"
        took = head.wait_gone(GRACE_S + 10)
        assert head.keeper.wait(timeout=10) == 0
        assert not Path(head.temp_dir).exists()
        record = head.record()
        assert record.state == "stopped" and record.stopped_by.startswith("keeper: its orchestrator"), record
        print(f"\nthe keeper stopped the stand-in head {GRACE_S / 2 + took:.1f} s after its orchestrator died "
              f"(grace {GRACE_S} s)")
    finally:
        head.close()


class Dashboard(BaseHTTPRequestHandler):
    """Ray's state API as far as adopting a head asks it: one live node."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"data": {"result": {"result": [{"state": "ALIVE"}]}}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def dashboard():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_resumed_orchestrator_adopts_the_head_within_the_grace_and_stops_it_at_its_close(tmp_path, orchestrator,
                                                                                            dashboard):
    head = Head(tmp_path, Proc.of(orchestrator.pid), url=dashboard)
    try:
        orchestrator.kill()
        orchestrator.wait()
        cluster, what = LocalCluster.adopt(head.folder, keeper_grace_s=GRACE_S)  # this process: the new owner
        assert cluster is not None and cluster.adopted and what.startswith("adopted the head"), what
        assert cluster.url == dashboard and str(cluster.temp_dir) == head.temp_dir
        time.sleep(GRACE_S * 2 + 1)
        assert head.living() == head.pids, "the keeper stopped a head its run adopted"
        assert head.keeper.poll() is None and head.record().owner.pid == os.getpid()
        assert sorted(cluster.pids()) == sorted(head.pids), "the head's processes, found from its record"
        begin = time.monotonic()
        cluster.stop()
        head.wait_gone(1.0)
        assert time.monotonic() - begin < 10
        assert head.keeper.wait(timeout=5) is not None and not Path(head.temp_dir).exists()
        assert head.record().state == "stopped" and head.record().stopped_by == "the orchestrator"
    finally:
        head.close()


def test_a_head_that_does_not_answer_is_stopped_instead_of_adopted(tmp_path, orchestrator):
    head = Head(tmp_path, Proc.of(orchestrator.pid), url="http://127.0.0.1:9")  # nothing listens there
    try:
        orchestrator.kill()
        orchestrator.wait()
        head.keeper.kill()  # and its keeper is gone too
        head.keeper.wait()
        cluster, what = LocalCluster.adopt(head.folder, keeper_grace_s=GRACE_S, answer_s=0.5)
        assert cluster is None and "was not adopted (it did not answer)" in what, what
        head.wait_gone(1.0)
        assert not Path(head.temp_dir).exists() and head.record().state == "stopped"
        assert LocalCluster.adopt(head.folder, keeper_grace_s=GRACE_S) == (None, "")  # nothing left to adopt
    finally:
        head.close()
