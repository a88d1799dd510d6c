"""Run untrusted (agent-written) code in a subprocess that cannot do harm.

The child runs in fresh mount, network and PID namespaces (``unshare``): no network at all, a read-only view of the
filesystem with ``/tmp``, ``/root``, ``/home``, ``/run``, ``/dev/shm``, the runs directory and every hidden path
masked, the job directory mounted read-only at ``/tmp/job`` and an output directory read-write at ``/tmp/out``. It
runs as ``nobody`` with no capabilities, under limits on CPU time, address space, file size, open files and
processes, with an environment that holds no credentials, and it is killed with everything it started when the wall
clock runs out. What the trusted side needs from a run (results, datasets, checkpoints) comes back through the
output directory only.

Usage: :func:`run_sandboxed`. This module is also the program that sets the sandbox up inside the namespaces
(``python -m aitrainsai.sandbox SPEC -- COMMAND...``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

JOB_MOUNT = "/tmp/job"
OUT_MOUNT = "/tmp/out"
EXPORT = "/tmp/.export"
STAGE = "/mnt"
SIGNAL_BASE = 128
NOBODY = 65534
MASKED_DIRS = ("/tmp", "/root", "/home", "/run", "/dev/shm", "/var/tmp")
SAFE_VARIABLES = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE",
                  "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES")


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the sandbox (no ``unshare``, or namespaces are forbidden)."""


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


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool

    @property
    def reason(self) -> str:
        """Why the child failed, in words, or '' when it exited 0."""
        if self.timed_out:
            return "ran out of wall-clock time"
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


@dataclass
class _Spec:
    job: str
    out: str
    hide: list[str]
    expose: list[str]
    limits: dict
    cwd: str = JOB_MOUNT
    env: dict = field(default_factory=dict)


def run_sandboxed(command: list[str], *, job_dir: Path, out_dir: Path, limits: Limits | None = None,
                  hide: list[Path] = (), expose: list[Path] = (), env: dict[str, str] | None = None,
                  stdin: str | None = None) -> SandboxResult:
    """Run ``command`` inside the sandbox; ``job_dir`` is visible read-only at ``/tmp/job`` (the working directory),
    ``out_dir`` read-write at ``/tmp/out``. ``hide`` paths become empty; ``expose`` paths stay readable even under a
    masked directory (the Python installation is always exposed)."""
    limits = limits or Limits()
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("the sandbox needs `unshare` (util-linux)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = _Spec(job=str(Path(job_dir).resolve()), out=str(out_dir.resolve()),
                 hide=[str(Path(p).resolve()) for p in hide],
                 expose=sorted({str(Path(p).resolve()) for p in [*expose, *_python_paths()] if Path(p).exists()}),
                 limits=asdict(limits), env=_clean_env(env or {}))
    prefix = [unshare, "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        prefix.insert(1, "--map-root-user")
    argv = [*prefix, sys.executable, "-I", "-m", "aitrainsai.sandbox", json.dumps(asdict(spec)), "--", *command]
    start = time.monotonic()
    process = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    timed_out = False
    try:
        stdout, stderr = process.communicate(stdin, timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(process)
        stdout, stderr = process.communicate()
    code = process.returncode
    if code is not None and SIGNAL_BASE < code < SIGNAL_BASE + 64:
        code = SIGNAL_BASE - code  # the command died by a signal
    return SandboxResult(code, _text(stdout), _text(stderr), time.monotonic() - start, timed_out)


def sandbox_works() -> bool:
    """Whether this machine can build the sandbox."""
    try:
        probe = Path(os.environ.get("TMPDIR", "/tmp")) / f".aitrainsai-sandbox-check-{os.getpid()}"
        result = run_sandboxed([sys.executable, "-c", "print('ok')"], job_dir=probe, out_dir=probe,
                               limits=Limits(wall_s=30))
        shutil.rmtree(probe, ignore_errors=True)
        return result.returncode == 0 and result.stdout.strip() == "ok"
    except SandboxUnavailable:
        return False


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(data: bytes | str | None, limit: int = 200_000) -> str:
    if data is None:
        return ""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else text[:limit // 2] + "\n...[cut]...\n" + text[-limit // 2:]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in SAFE_VARIABLES}
    env.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _python_paths() -> list[str]:
    return [sys.base_prefix, sys.prefix, *[p for p in sys.path if p and os.path.isdir(p)]]


# --- inside the namespaces ----------------------------------------------------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 8192, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
PR_SET_NO_NEW_PRIVS = 38


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    import ctypes

    enc = lambda value: value.encode() if isinstance(value, str) else value  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} -> {target}: {os.strerror(errno)}")


def _under(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _setup(spec: _Spec) -> None:
    libc = _libc()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    # 1. stage what must stay visible, before anything is masked
    masked = [d for d in MASKED_DIRS if os.path.isdir(d)]
    _mount(libc, "tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    staged: list[tuple[str, str, bool]] = []
    exposed = [p for p in spec.expose if _under(p, masked)]
    for index, (source, target, writable) in enumerate(
            [(spec.job, JOB_MOUNT, False), (spec.out, EXPORT, True)] + [(p, p, False) for p in exposed]):
        stage = f"{STAGE}/{index}"
        os.mkdir(stage)
        if not os.path.isdir(source):
            continue
        _mount(libc, source, stage, None, MS_BIND | MS_REC)
        staged.append((stage, target, writable))
    # 2. mask, then put the staged directories in place
    tmp_size = f"size={spec.limits['tmp_mb']}m"
    for directory in masked:
        _mount(libc, "tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, f"{tmp_size},mode=0755")
    for stage, target, writable in staged:
        os.makedirs(target, exist_ok=True)
        _mount(libc, stage, target, None, MS_MOVE)
        if not writable:
            _remount_readonly(libc, target)
    # 3. hide, last, so that nothing mounted later covers a hidden path
    for path in spec.hide:
        if not os.path.lexists(path):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0555")
        else:
            _mount(libc, "/dev/null", path, None, MS_BIND)
    libc.umount2(STAGE.encode(), MNT_DETACH)
    os.chmod("/tmp", 0o755)
    os.makedirs(OUT_MOUNT, exist_ok=True)
    _mount(libc, "tmpfs", OUT_MOUNT, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec.limits['out_mb']}m,nr_inodes={spec.limits['out_files'] + 16},mode=0755")
    _copy_tree(Path(EXPORT), Path(OUT_MOUNT))  # what the trusted side put there (inputs)
    os.makedirs("/tmp/home", exist_ok=True)
    # 4. everything else read-only
    writable_mounts = set(masked) | {OUT_MOUNT, EXPORT}
    for mount_point in _mount_points():
        if mount_point in writable_mounts or _under(mount_point, ["/proc", "/sys", "/dev"]) and mount_point != "/dev/shm":
            continue
        try:
            _remount_readonly(libc, mount_point)
        except OSError:
            if mount_point in ("/",) or _under(spec.job, [mount_point]):
                raise
    for path in [Path("/tmp"), Path("/tmp/home"), Path("/dev/shm"), Path(OUT_MOUNT), *Path(OUT_MOUNT).rglob("*")]:
        os.chown(path, NOBODY, NOBODY)


def _copy_tree(source: Path, target: Path, max_files: int | None = None) -> int:
    """Copy regular files and directories only (never links or devices); return how many files were copied."""
    copied = 0
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        destination = target / relative
        if path.is_symlink():
            continue
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            if max_files is not None and copied >= max_files:
                break
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
            copied += 1
    return copied


def _remount_readonly(libc, path: str) -> None:
    _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            points.append(line.split()[4].replace("\\040", " "))
    return points


def _limit(limits: dict) -> None:
    import resource

    mb = 1024 * 1024
    for name, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb), (resource.RLIMIT_NPROC, limits["processes"]),
                        (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        # CPU: the soft limit sends SIGXCPU (reported as the CPU limit); the hard one, 5 s later, SIGKILLs a child
        # that ignores it. Equal limits would make the kernel send SIGKILL straight away.
        resource.setrlimit(name, (value, value + 5 if name == resource.RLIMIT_CPU else value))


def _drop_privileges() -> None:
    import ctypes

    libc = _libc()
    os.setgroups([])
    if os.getuid() == 0 and _uid_mapped(NOBODY):
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _uid_mapped(uid: int) -> bool:
    with open("/proc/self/uid_map") as handle:
        for line in handle:
            inside, _outside, count = map(int, line.split())
            if inside <= uid < inside + count:
                return True
    return False


def main(argv: list[str]) -> None:
    """PID 1 of the sandbox: set up, run the command as an unprivileged child, export its outputs."""
    spec_text, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m aitrainsai.sandbox SPEC -- COMMAND...")
    spec = _Spec(**json.loads(spec_text))
    try:
        _setup(spec)
    except OSError as exc:
        print(f"sandbox: could not be set up: {exc}", file=sys.stderr)
        raise SystemExit(125) from exc
    for stale in Path(EXPORT).iterdir():  # the export receives exactly what the command leaves in /tmp/out
        shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
    pid = os.fork()
    if pid == 0:
        _child(spec, command)
    _, status = os.waitpid(pid, 0)
    _copy_tree(Path(OUT_MOUNT), Path(EXPORT), max_files=spec.limits["out_files"])
    code = os.waitstatus_to_exitcode(status)
    raise SystemExit(code if code >= 0 else SIGNAL_BASE - code)


def _child(spec: _Spec, command: list[str]) -> None:
    try:
        libc = _libc()
        if libc.unshare(CLONE_NEWNS) != 0:  # a mount namespace of its own, without the export
            raise OSError("unshare(CLONE_NEWNS) failed")
        libc.umount2(EXPORT.encode(), MNT_DETACH)
        _limit(spec.limits)
        _drop_privileges()
        os.chdir(spec.cwd)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the file size limit fail with EFBIG instead
        os.execvpe(command[0], command, spec.env)
    except BaseException as exc:
        print(f"sandbox: cannot run {command[0]}: {exc}", file=sys.stderr)
        os._exit(126)


if __name__ == "__main__":
    main(sys.argv[1:])
