"""A cgroup of its own for each sandbox (v1 or v2): memory and processes limited per sandbox, tmpfs pages
included, and a CPU share (a quota over all its processes); stale ones of dead runs removed."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import time
from pathlib import Path

from aitrainsai.isolation.contract import CGROUP_PREFIX

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000  # the quota's period: a capped sandbox runs at most ``cpus`` x this in each
MIN_QUOTA_US = 1_000  # the kernel's least quota


class Cgroup:
    """A memory and pids cgroup of the sandbox's own (v1 or v2), where this process may make one, and a CPU quota in
    it where a share is asked for and the cpu controller is there (``cpu_limited``). The quota caps the sandbox at
    ``cpus`` cores' worth of CPU time, however many processes it starts (or sessions: unlike the kernel's
    autogroups, a cgroup cannot be left); its weight under contention is that of ``cpus`` busy threads of the
    trusted side (``cpu.shares`` 1024 or ``cpu.weight`` 100 per core)."""

    def __init__(self, folders: list[Path], procs: list[Path], version: int):
        self.folders, self.procs, self.version = folders, procs, version
        self.cpu_limited = False
        self._usage: Path | None = None  # v1: cpuacct.usage (ns); v2: cpu.stat (usage_usec)

    @classmethod
    def create(cls, memory_bytes: int, pids: int, cpus: float | None = None, *,
               root: Path = CGROUP_ROOT) -> Cgroup | None:
        """A cgroup with these limits (``cpus``: cores' worth of CPU time, None: no cap), or None where none can be
        made. A machine whose cpu controller cannot be used still gets the memory and pids limits; ``cpu_limited``
        says whether the share holds."""
        if os.geteuid() != 0:
            return None
        name = f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        v1 = [root / "memory", root / "pids"]
        group: Cgroup | None = None
        try:
            if all((folder / "cgroup.procs").is_file() for folder in v1):
                group = cls([folder / name for folder in v1], [folder / name / "cgroup.procs" for folder in v1], 1)
                for folder, own in zip(v1, group.folders):
                    _remove_stale(folder)
                    own.mkdir()
                memory = group.folders[0]
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (group.folders[1] / "pids.max").write_text(str(pids))
                if cpus is not None:
                    group._cpu_v1(root, name, cpus)
                return group
            controllers = set((root / "cgroup.controllers").read_text().split())
            if {"memory", "pids"} <= controllers:
                _remove_stale(root)
                wanted = {"memory", "pids"} | ({"cpu"} & controllers if cpus is not None else set())
                if not wanted <= set((root / "cgroup.subtree_control").read_text().split()):
                    with contextlib.suppress(OSError):  # cpu cannot be enabled beside realtime threads
                        (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
                    if not {"memory", "pids"} <= set((root / "cgroup.subtree_control").read_text().split()):
                        (root / "cgroup.subtree_control").write_text("+memory +pids")
                group = cls([root / name], [root / name / "cgroup.procs"], 2)
                folder = group.folders[0]
                folder.mkdir()
                (folder / "memory.max").write_text(str(memory_bytes))
                if (folder / "memory.swap.max").exists():
                    (folder / "memory.swap.max").write_text("0")
                (folder / "pids.max").write_text(str(pids))
                if cpus is not None and "cpu" in (root / "cgroup.subtree_control").read_text().split():
                    with contextlib.suppress(OSError):
                        (folder / "cpu.max").write_text(f"{quota_us(cpus)} {CPU_PERIOD_US}")
                        group.cpu_limited = True
                        (folder / "cpu.weight").write_text(str(min(10_000, max(1, round(100 * cpus)))))
                group._usage = folder / "cpu.stat"
                return group
        except OSError:
            if group is not None:
                group.close()
        return None

    def _cpu_v1(self, root: Path, name: str, cpus: float) -> None:
        """Join the cpu (quota) and cpuacct (usage) hierarchies too, where they are mounted (often together); a
        failure leaves the share unenforced, not the sandbox without its other limits."""
        hierarchies: dict[str, Path] = {}
        for controller in ("cpu", "cpuacct"):
            folder = root / controller
            if (folder / "cgroup.procs").is_file():
                hierarchies.setdefault(os.path.realpath(folder), folder)  # cpu,cpuacct mounted once: joined once
        cpu = next((f for f in hierarchies.values() if (f / "cpu.cfs_quota_us").exists()), None)
        if cpu is None:
            return
        added: list[Path] = []
        try:
            for folder in hierarchies.values():
                _remove_stale(folder)
                (folder / name).mkdir()
                added.append(folder / name)
            quota = quota_us(cpus)
            parent = int((cpu / "cpu.cfs_quota_us").read_text())
            if parent > 0:  # v1 refuses a quota above the parent's (a container's own cap)
                quota = min(quota, parent * CPU_PERIOD_US // int((cpu / "cpu.cfs_period_us").read_text()))
            (cpu / name / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cpu / name / "cpu.cfs_quota_us").write_text(str(quota))
            (cpu / name / "cpu.shares").write_text(str(min(262_144, max(2, round(1024 * cpus)))))
        except (OSError, ValueError, ZeroDivisionError):
            for folder in added:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return
        self.folders += added
        self.procs += [folder / "cgroup.procs" for folder in added]
        self.cpu_limited = True
        self._usage = next((f / "cpuacct.usage" for f in added if (f.parent / "cpuacct.usage").exists()), None)

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

    def cpu_seconds(self) -> float | None:
        """The CPU time all its processes used so far (None where it is not counted); read it before closing."""
        try:
            if self._usage is None:
                return None
            if self.version == 1:
                return int(self._usage.read_text()) / 1e9
            fields = dict(line.split() for line in self._usage.read_text().splitlines())
            return int(fields["usage_usec"]) / 1e6
        except (OSError, ValueError, KeyError):
            return None

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


def quota_us(cpus: float) -> int:
    """The quota per :data:`CPU_PERIOD_US` that gives ``cpus`` cores' worth of CPU time."""
    return max(MIN_QUOTA_US, round(cpus * CPU_PERIOD_US))


@functools.cache
def cgroups_writable() -> bool:
    group = Cgroup.create(2**30, 64)
    if group is not None:
        group.close()
    return group is not None


@functools.cache
def cpu_share_enforced() -> bool:
    """Whether a sandbox's CPU share can be enforced here (a cgroup with a CPU quota can be made)."""
    group = Cgroup.create(2**30, 64, 1.0)
    if group is not None:
        group.close()
    return group is not None and group.cpu_limited
