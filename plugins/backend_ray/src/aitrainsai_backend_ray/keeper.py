"""The keeper of a Ray head the backend started: a small process that stops the head once the orchestrator that owns
it has been gone for ``grace_s`` (a SIGKILLed orchestrator cannot stop it itself), and the head's record that a
resumed orchestrator adopts it by.

``<backend folder>/head.json`` (a :class:`HeadRecord`, replaced whole) names the head (its ``ray start`` process, by
pid and start time, and its temp dir), its owner (the orchestrator's process) and its keeper; ``head.lock`` (flock)
orders the keeper's decisions against an orchestrator adopting or stopping the head, so that a head is never stopped
after a resumed orchestrator adopted it. ``python -m aitrainsai_backend_ray.keeper FOLDER`` runs in its own
session, checks the owner every ``tick`` (a zombie counts as gone), and when the grace is over stops every process of
the head (:func:`head_processes`: by pid and session, never ``ray stop``, which stops every Ray of the user) and
removes its temp dir. It ends when its head ends or another head's record replaces its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

RECORD = "head.json"
LOCK = "head.lock"
LOG = "keeper.log"
TEMP_PREFIX = "aitrainsai-ray-"  # the only folders a sweep removes


class Proc(BaseModel):
    """A process named by its pid and start time (a pid alone may be reused)."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        import psutil

        try:
            return cls(pid=pid, started=psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    def alive(self) -> bool:
        """Running (a zombie is not: it has ended and waits to be reaped, which an orphan may never be)."""
        import psutil

        try:
            process = psutil.Process(self.pid)
            return abs(process.create_time() - self.started) < 0.5 and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


class HeadRecord(BaseModel):
    temp_dir: str
    root: Proc  # ray start --head --block: the head's servers are its children, in its session
    owner: Proc  # the orchestrator that uses the head
    keeper: Proc | None = None
    grace_s: float
    url: str = ""
    gcs_address: str = ""
    ports: list[int] = []
    state: Literal["starting", "running", "stopped"] = "starting"
    stopped_by: str = ""


def load(folder: Path) -> HeadRecord | None:
    try:
        return HeadRecord.model_validate_json((folder / RECORD).read_bytes())
    except (OSError, ValidationError):
        return None


def save(folder: Path, record: HeadRecord) -> None:
    partial = folder / f"{RECORD}.partial"
    partial.write_text(record.model_dump_json())
    partial.replace(folder / RECORD)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def head_processes(root: Proc | None, temp_dir: str) -> list:
    """Every live process of the head (``psutil.Process``): ``ray start`` and its session (every Ray server and worker
    is started in it), whatever names the head's temp dir on its command line (its servers, should ``ray start`` be
    gone), everything these started, and the sessions they lead (a job's entrypoint is its own session leader: a
    payload that left its parent is still found)."""
    import psutil

    table, sessions = {}, {}
    for process in psutil.process_iter(["ppid", "cmdline", "create_time", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(OSError):
            sessions[process.pid] = os.getsid(process.pid)
            table[process.pid] = process
    names_dir = re.compile(re.escape(temp_dir.rstrip("/")) + r"(?:/|$)")
    rooted = root if root is not None and root.alive() else None
    seeds = [pid for pid, process in table.items()
             if (rooted is not None and (pid == rooted.pid or (sessions[pid] == rooted.pid
                                                               and (process.info["create_time"] or 0)
                                                               >= rooted.started - 0.5)))
             or any(names_dir.search(arg) for arg in process.info["cmdline"] or [])]
    children: dict[int, list[int]] = {}
    for pid, process in table.items():
        children.setdefault(process.info["ppid"], []).append(pid)
    found: set[int] = set()
    while seeds:
        pid = seeds.pop()
        if pid in found or pid not in table:
            continue
        found.add(pid)
        seeds += children.get(pid, [])
        if sessions[pid] == pid:
            seeds += [other for other, sid in sessions.items() if sid == pid]
    found.discard(os.getpid())
    return [table[pid] for pid in sorted(found)]


def sweep(root: Proc | None, temp_dir: str, grace_s: float = 3.0) -> int:
    """Stop every process of the head (SIGTERM; SIGKILL to what is left after ``grace_s``; ``grace_s=0``: SIGKILL at
    once) and remove its temp dir. Returns how many processes it signalled."""
    import psutil

    signalled = 0
    for rounds in range(3):  # a dying server may start another process: look again
        processes = head_processes(root, temp_dir)
        if not processes:
            break
        signalled += len(processes)
        first = signal.SIGTERM if grace_s > 0 and rounds == 0 else signal.SIGKILL
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(first)
        alive = wait_gone(processes, grace_s if first == signal.SIGTERM else 1.0)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        wait_gone(alive, 1.0)
    folder = Path(temp_dir)
    if folder.name.startswith(TEMP_PREFIX) and folder.parent in temp_roots():
        shutil.rmtree(folder, ignore_errors=True)
    return signalled


def temp_roots() -> set[Path]:
    """Where :class:`~aitrainsai_backend_ray.cluster.LocalCluster` makes a head's temp dir."""
    return {Path("/tmp"), Path(tempfile.gettempdir())}


def wait_gone(processes: list, timeout_s: float) -> list:
    """Wait until each process has ended (a zombie has: an orphan's may never be reaped); those left."""
    import psutil

    deadline = time.monotonic() + timeout_s
    alive = list(processes)
    while alive:
        still = []
        for process in alive:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    still.append(process)
            except psutil.Error:
                continue
        alive = still
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return alive


def tick_s(grace_s: float) -> float:
    return min(1.0, max(0.1, grace_s / 10))


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} keeper {os.getpid()}: {message}", flush=True)


def main(folder: Path) -> int:
    """Keep the head ``folder``'s record names now (its temp dir is not on this command line: a sweep of the head
    finds processes by that name)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the orchestrator stopped the head itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with locked(folder):
        record = load(folder)
    if record is None:
        _log(f"no head recorded in {folder}")
        return 0
    temp_dir, grace_s = record.temp_dir, record.grace_s
    gone_since: float | None = None
    while True:
        time.sleep(tick_s(grace_s))
        with locked(folder):
            record = load(folder)
            if record is None or record.temp_dir != temp_dir:
                _log("the record names another head: nothing of mine to keep")
                return 0
            grace_s = record.grace_s
            if record.state == "stopped":
                sweep(record.root, temp_dir)  # whatever its stop left
                return 0
            if not record.root.alive():
                why = "its ray start ended"
            elif record.owner.alive():
                gone_since = None
                continue
            else:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since < grace_s:
                    continue
                why = f"its orchestrator (pid {record.owner.pid}) has been gone for {grace_s:g} s"
            record.state, record.stopped_by = "stopped", f"keeper: {why}"
            save(folder, record)
            count = sweep(record.root, temp_dir)
            _log(f"stopped the head in {temp_dir} ({count} processes): {why}")
            return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
