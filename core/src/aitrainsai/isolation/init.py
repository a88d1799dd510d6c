"""The init of a sandbox (stdlib only; ``python -I -S init.py SPEC``): PID 1 of a namespace sandbox (started
by bubblewrap), or, in a container sandbox, a root process the command's uid cannot signal or trace.

It starts the agent's command as an unprivileged child (its own uid where the sandbox was started as root, limits,
no new privileges, no capabilities), reaps everything, and when the command has exited kills every process left in
the sandbox: every process of its PID namespace, or in a container every process of its uid (its own session, too,
whatever session or group they moved to). Only then, with nothing else alive and without privilege, it exports the
out folder over a pipe the command never holds:
regular files only, opened with ``O_NOFOLLOW``, no hard links, no FIFOs or devices, the byte and file caps counted on
what is read. The trusted side (:mod:`aitrainsai.isolation.receiver`) writes what it receives, checking the same caps
again.

In a container it ends the same way when asked to (SIGTERM, also sent when its parent dies), without exporting.
``{"sweep_uid": N}`` as the spec only kills every process of uid N (the trusted side's last resort).

Export stream: per file ``F <n>\\n<path>``, then chunks ``D <n>\\n<bytes>``, then ``E\\n``; at the end
``Z <n>\\n<json>`` with what was skipped and whether a cap was reached.
"""

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SIGNAL_KILLED = 128 + 9
CHUNK = 1 << 16
MAX_DEPTH = 32


class _Stop(Exception):
    """The trusted side asked the container sandbox to end (or died)."""


def _stop(signum, frame) -> None:
    raise _Stop


def main(spec: dict) -> int:
    if "sweep_uid" in spec:
        _kill_uid(int(spec["sweep_uid"]))
        return 0
    container = spec["mode"] == "container"
    out_fd = spec.get("out_fd")
    if out_fd is not None:
        os.set_inheritable(out_fd, False)  # the command never holds the export pipe
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # nothing of the same uid may trace or read this process
    if container:
        if spec.get("uid") is None or os.getuid() != 0:
            os.write(2, b"sandbox: the container isolation needs root and a uid for the command\n")
            return 125
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the command come here, not to the host's init
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, _stop)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    elif spec.get("loopback_down"):
        _loopback_down()
    stopped = False
    try:
        pid = os.fork()
        if pid == 0:
            _child(spec, libc)
        code = _wait_for(pid)
    except _Stop:
        code, stopped = SIGNAL_KILLED, True
    if container:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
        _kill_uid(spec["uid"])
        if stopped:
            return code
    else:
        _kill_all()
    _drop(spec)
    if out_fd is not None:
        _export(spec["out"], out_fd, spec["out_bytes"], spec["out_files"])
    return code


def _child(spec: dict, libc) -> None:
    try:
        import resource

        os.setsid()
        for name, value in spec["rlimits"].items():
            limit = getattr(resource, name)
            # CPU: the soft limit sends SIGXCPU (reported as the CPU limit); the hard one, 5 s later, kills.
            resource.setrlimit(limit, (value, value + 5 if name == "RLIMIT_CPU" else value))
        if spec.get("nice"):
            os.nice(spec["nice"])  # no CPU cgroup: yield to the trusted side at least
        _drop(spec)
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # no capability survives the exec
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.chdir(spec["cwd"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the file size limit fail with EFBIG instead
        os.execvpe(spec["command"][0], spec["command"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - report anything, then leave without running Python's cleanup
        os.write(2, f"sandbox: cannot run {spec['command'][0]}: {exc}\n".encode())
        os._exit(126)


def _drop(spec: dict) -> None:
    """Become the sandbox's own uid (only where the sandbox was started as root); capabilities go with root."""
    uid = spec.get("uid")
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _wait_for(pid: int) -> int:
    """Reap children (orphans come here: this is PID 1) until ``pid`` exits; its exit code, 128+N for signal N."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 125
        except InterruptedError:
            continue
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def _loopback_down() -> None:
    """Take the sandbox's own loopback down (network 'none'); needs CAP_NET_ADMIN in its network namespace."""
    with socket.socket() as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags & ~IFF_UP))


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (as root, in a container): a helper of that uid sends SIGKILL to all it may
    signal at once (``kill(-1)``: a fork cannot slip past it), this process reaps what it inherited, and /proc is
    checked until no live process of the uid is left."""
    for _ in range(1_000):
        helper = os.fork()
        if helper == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            except BaseException:  # noqa: BLE001 - the loop checks /proc anyway
                pass
            os._exit(0)
        while True:
            try:
                done, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if done == helper:
                break
        _reap_ready()
        if not _live_processes(uid):
            return
        time.sleep(0.005)


def _reap_ready() -> None:
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            return


def _live_processes(uid: int) -> list[int]:
    """Processes (not zombies) of which ``uid`` is the real, effective, saved or file-system uid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
            continue
        if str(uid) in fields.get("Uid", "").split():
            found.append(int(name))
    return found


def _kill_all() -> None:
    """SIGKILL every other process of the sandbox and reap them all, until none is left."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass
        try:
            os.kill(-1, 0)
        except ProcessLookupError:
            return


class _Export:
    def __init__(self, fd: int, max_bytes: int, max_files: int):
        self.fd = fd
        self.bytes_left = max_bytes
        self.files_left = max_files
        self.skipped: list[str] = []
        self.cap = ""

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def skip(self, path: str, why: str) -> None:
        if len(self.skipped) < 100:
            self.skipped.append(f"{path}: {why}")

    def directory(self, dir_fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(dir_fd)):
            if self.cap:
                return
            path = prefix + name
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                self.skip(path, exc.strerror or "unreadable")
                continue
            if stat.S_ISDIR(info.st_mode):
                if depth >= MAX_DEPTH:
                    self.skip(path, f"deeper than {MAX_DEPTH} folders")
                    continue
                try:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                except OSError as exc:
                    self.skip(path, exc.strerror or "unreadable")
                    continue
                try:
                    self.directory(child, path + "/", depth + 1)
                finally:
                    os.close(child)
            elif stat.S_ISREG(info.st_mode):
                self.file(dir_fd, name, path)
            else:
                self.skip(path, "not a regular file (a link, FIFO, socket or device)")

    def file(self, dir_fd: int, name: str, path: str) -> None:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            self.skip(path, exc.strerror or "unreadable")
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self.skip(path, "not a regular file")
                return
            if info.st_nlink != 1:
                self.skip(path, "a hard link")
                return
            if self.files_left <= 0:
                self.cap = "files"
                return
            self.files_left -= 1
            encoded = path.encode("utf-8", "surrogateescape")
            self.write(b"F %d\n" % len(encoded) + encoded)
            while True:
                chunk = os.read(fd, min(CHUNK, self.bytes_left + 1))
                if not chunk:
                    break
                if len(chunk) > self.bytes_left:
                    self.cap = "bytes"
                    break
                self.bytes_left -= len(chunk)
                self.write(b"D %d\n" % len(chunk) + chunk)
            self.write(b"E\n")
        finally:
            os.close(fd)


def _export(root: str, fd: int, max_bytes: int, max_files: int) -> None:
    export = _Export(fd, max_bytes, max_files)
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            export.directory(top, "", 0)
        finally:
            os.close(top)
        summary = json.dumps({"skipped": export.skipped, "cap": export.cap}).encode()
        export.write(b"Z %d\n" % len(summary) + summary)
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            os.write(2, f"sandbox: export failed: {exc}\n".encode())
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
