"""The ``container`` strategy: no namespaces, for a worker that is itself a disposable container where user
namespaces are forbidden; the command runs under a uid of its own with the same limits."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path, PurePosixPath
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import aitrainsai.isolation.view as job_view
from aitrainsai.isolation.contract import SHARED_SCRATCH, IsolationStatement, SandboxUnavailable
from aitrainsai.isolation.namespace import python_folders
from aitrainsai.isolation.sandbox import IsolationStrategy, Sandbox, cpu_lines, memory_lines


class ContainerSandbox(Sandbox):
    """No namespaces: for a worker that is itself a disposable container. The command runs as a uid of its own (the
    caller must be root), in a session of its own, with the same limits; its init (:mod:`aitrainsai.isolation.init`,
    root, out of the command's reach) kills every process of that uid at the end and exports its ``out`` folder by the
    same rules. What it cannot do is stated by :class:`ContainerIsolation`."""

    STOP_GRACE_S = 10.0

    def _prepare(self, spec: dict, uid: int, scratch: Path) -> list[str]:
        if spec["uid"] is None:
            raise SandboxUnavailable(ContainerIsolation.NEEDS_ROOT)
        outside = [p for p in self.hide if not Path(p).is_relative_to(self.job_dir)]  # the job's own: not copied
        readable = _readable_by_uid([*outside, *job_view.hidden_family_files()])
        if readable:
            raise SandboxUnavailable(
                f"the container isolation cannot hide {readable} from agent code: make what it must not read "
                "unreadable to others in the image (chmod -R o-rwx on the task families' private modules and the "
                "runs folder)")
        scratch.chmod(0o711)  # each folder below belongs to the sandbox's uid (or its group) alone
        job = scratch / "job"
        _copy_job(self.job_dir, job, uid, skip={Path(p) for p in self.hide})
        for name in ("out", "tmp", "home"):
            (scratch / name).mkdir(mode=0o700)
            os.chown(scratch / name, uid, uid)
        spec["env"].update({"HOME": str(scratch / "home"), "TMPDIR": str(scratch / "tmp")})
        spec.update(mode="container", cwd=str(job), out=str(scratch / "out"), loopback_down=False)
        init = str(Path(__file__).with_name("init.py"))
        return [sys.executable, "-I", "-S", init]

    def _stop(self) -> None:
        """Ask the init to kill everything and end; if it does not in time, kill it and sweep the uid from here."""
        process = self.running
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=self.STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._sweep()

    def _sweep(self) -> None:
        if self._uid is not None:
            init = str(Path(__file__).with_name("init.py"))
            subprocess.run([sys.executable, "-I", "-S", init, json.dumps({"sweep_uid": self._uid})],
                           capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, check=False)

    def _after(self) -> None:
        if self._uid is None:
            return
        self._sweep()  # the init did this; a killed init did not
        for folder in SHARED_SCRATCH:
            _remove_owned(Path(folder), self._uid)



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


def _copy_job(source: Path, target: Path, uid: int, skip: AbstractSet[Path] = frozenset()) -> None:
    """A trusted copy of the job's folders and regular files (no link followed, none of ``skip``: files only the
    trusted side reads), readable by the sandbox's group alone and writable by no one but root."""
    target.mkdir(mode=0o750)
    os.chown(target, 0, uid)
    for entry in os.scandir(source):
        destination = target / entry.name
        if Path(os.path.realpath(entry.path)) in skip:
            continue
        if entry.is_dir(follow_symlinks=False):
            _copy_job(Path(entry.path), destination, uid, skip)
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
        memory, no_memory = memory_lines(os.geteuid() == 0)
        cpu, no_cpu = cpu_lines(os.geteuid() == 0)
        guarantees = [
            ("the command runs under a uid of its own (no file belongs to it), no capabilities, no new privileges; "
            "it cannot signal or trace the trusted side"),
            *memory,
            *cpu,
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
            ("PID, IPC and UTS are the container's: the command sees other processes and shared IPC objects, and "
             "/proc's host-wide counters (CPU times, load, free memory)"),
            *no_memory,
            *no_cpu,
            "the kernel and the container's own boundary are all that stand between the command and the host",
        ]
        return IsolationStatement(strategy=self.name, guarantees=tuple(guarantees),
                                  not_guaranteed=tuple(not_guaranteed))
