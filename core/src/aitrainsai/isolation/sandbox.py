"""One sandboxed command and the strategy that makes it: the life cycle every strategy shares (uid lease, cgroup,
scratch, limits, streams, export), and :class:`IsolationStrategy`, the base of each strategy (one file each:
:mod:`~aitrainsai.isolation.namespace`, :mod:`~aitrainsai.isolation.container`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any, Literal
from collections.abc import Sequence

from aitrainsai.isolation.cgroup import Cgroup, cgroups_writable, cpu_share_enforced
from aitrainsai.isolation.contract import (MB, NETWORKS, NOBODY, SAFE_VARIABLES, SIGNAL_BASE, IsolationStatement,
                                          Limits, SandboxResult, SandboxUnavailable)
from aitrainsai.isolation.receiver import Capture, Receiver
from aitrainsai.isolation.uid import UidLease


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
        cpus = self.limits.cpus
        if cpus is not None and not (isinstance(cpus, int | float) and math.isfinite(cpus) and cpus > 0):
            raise ValueError(f"Limits.cpus must be a number of cores above 0, or None for no cap, not {cpus!r}")
        self.env = clean_env(env or {})
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.hide = [os.path.realpath(p) for p in hide]
        self.talk = talk
        self.gpu = gpu
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self._timed_out = False
        self._cleanup: list = []
        self._cgroup: Cgroup | None = None
        self._uid: int | None = None
        self._receiver: Receiver | None = None

    # -- what a strategy provides --
    @abstractmethod
    def _prepare(self, spec: dict, uid: int, scratch: Path) -> list[str]:
        """Complete ``spec`` (paths the command sees) and return the argv that starts the init with it."""

    def _stop(self) -> None:
        """Kill the command and everything it started (the wall clock ran out, or the caller gave up)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.running.pid, signal.SIGKILL)
        self.running.wait()

    @property
    def running(self) -> subprocess.Popen[bytes]:
        """The started command's process."""
        assert self.process is not None, "start() first"
        return self.process

    def _after(self) -> None:  # noqa: B027 - a hook: most strategies need nothing here
        """Runs after every process of the command has ended, before the scratch is removed."""

    # -- life cycle --
    def start(self, stdin: bytes | None = None) -> Sandbox:
        if not self.job_dir.is_dir():
            raise FileNotFoundError(f"no job folder {self.job_dir}")
        try:
            return self._start(stdin)
        except BaseException:
            self._close_all()
            raise

    def _start(self, stdin: bytes | None) -> Sandbox:
        root = os.geteuid() == 0
        lease = UidLease() if root else None
        if lease is not None:
            self._cleanup.append(lease.release)
        uid = lease.uid if lease else NOBODY
        self._uid = uid if root else None
        limits = self.limits
        sweep_scratch()
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
            self._cleanup.append(lambda: None if self._receiver is not None else close_quietly(export_read))
        self._cgroup = Cgroup.create(limits.memory_mb * MB, limits.processes, limits.cpus)  # tmpfs pages count in it
        if self._cgroup is not None:
            self._cleanup.insert(0, self._cgroup.close)
        niceness = 0
        if limits.cpus is not None and (self._cgroup is None or not self._cgroup.cpu_limited):
            niceness = UNCAPPED_NICE  # the share cannot be enforced: at least yield to the trusted side
            say_cpu_unenforced()
        rlimits = {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.file_size_mb * MB,
                   "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}
        if lease is not None:
            rlimits["RLIMIT_NPROC"] = limits.processes  # counts this sandbox's uid only
        if self._cgroup is None and not self.gpu:
            rlimits["RLIMIT_AS"] = limits.memory_mb * MB  # no cgroup: per process (CUDA cannot live with it)
        spec: dict[str, Any] = {"command": self.command, "env": dict(self.env), "uid": uid if root else None,
                                "rlimits": rlimits, "nice": niceness, "out_fd": export_write,
                                "out_bytes": limits.out_mb * MB, "out_files": limits.out_files}
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
        if export_read is not None and self.out_dir is not None:
            self._receiver = Receiver(export_read, self.out_dir, limits.out_mb * MB, limits.out_files)
        assert self.process.stderr is not None and self.process.stdout is not None
        self._stderr = Capture(self.process.stderr)
        self._stdout = None if self.talk else Capture(self.process.stdout)
        if stdin is not None and not self.talk:
            threading.Thread(target=feed, args=(self.process.stdin, stdin), daemon=True).start()
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

    def cpu_seconds(self) -> float | None:
        """The CPU time all its processes have used so far, from its CPU cgroup (None: none was made, or it is
        closed)."""
        return self._cgroup.cpu_seconds() if self._cgroup is not None else None

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
        cpu_used = self._cgroup.cpu_seconds() if self._cgroup is not None else None
        with contextlib.suppress(Exception):
            self._after()
        self._close_all()
        return SandboxResult(code, stdout, stderr, time.monotonic() - self.started, self._timed_out,
                             out_of_memory=oom and code != 0, exported=exported, export_problems=problems,
                             cpu_used_s=cpu_used)

    def _close_all(self) -> None:
        for step in self._cleanup:
            with contextlib.suppress(Exception):
                step()
        self._cleanup.clear()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.kill()
            self._result()
        else:
            self._close_all()


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(OSError):
        stream.write(data)
        stream.close()



UNCAPPED_NICE = 10  # a sandbox's niceness where its CPU share cannot be enforced
_said_cpu = False


def say_cpu_unenforced() -> None:
    """Say once per process, on stderr, that sandboxes' CPU shares are not enforced here."""
    global _said_cpu
    if not _said_cpu:
        _said_cpu = True
        print(f"sandbox: no CPU cgroup can be made here, so a sandbox's CPU share (Limits.cpus) is not enforced; its "
              f"processes run at nice {UNCAPPED_NICE} instead", file=sys.stderr, flush=True)


SCRATCH_PREFIX = "aitrainsai-sandbox-"
_SCRATCH = re.compile(re.escape(SCRATCH_PREFIX) + r"(\d+)-[a-z0-9_]+$")
_swept = False


def sweep_scratch() -> None:
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



class IsolationStrategy(ABC):
    """How agent code is kept from the trusted side. ``problem()`` says why it cannot work here (None when it can);
    ``statement()`` what it guarantees and what not; :meth:`sandbox` (a command talked to while it runs) and
    :meth:`run` (a command run to its end) are the entry points."""

    name: str
    sandbox_class: type[Sandbox]

    def __init__(self) -> None:
        self._problem: str | None | Literal[False] = False  # False: not checked yet

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


def memory_lines(root: bool) -> tuple[list[str], list[str]]:
    if root and cgroups_writable():
        return ([("memory and processes are limited per sandbox by a cgroup of its own (memory_mb, processes), tmpfs "
                 "pages included; with gpu=True too (no address-space limit is set, which CUDA could not live with)")],
                ["GPU memory is not limited"])
    return (["memory is limited per process by an address-space limit (memory_mb), except with gpu=True"],
            [("no cgroup can be made here: memory is not limited per sandbox, and with gpu=True not at all (CUDA "
             "reserves more address space than any useful limit); GPU memory is not limited")])


def cpu_lines(root: bool) -> tuple[list[str], list[str]]:
    if root and cpu_share_enforced():
        return (["the CPU time of all its processes together is capped by a cgroup quota (cpus: cores' worth, set "
                 "by the backend from its slots), so one sandbox cannot take the host's CPU"], [])
    return ([], [f"no CPU cgroup can be made here: a sandbox's CPU share (cpus) is not enforced; its processes run "
                 f"at nice {UNCAPPED_NICE}, so the trusted side's processes come first"])



def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in SAFE_VARIABLES}
    env.update({"HOME": "/tmp/home", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "PATH": "/usr/bin:/bin"})
    env.update(extra)
    return env
