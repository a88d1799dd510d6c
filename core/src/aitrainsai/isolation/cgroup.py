"""A cgroup of its own for each sandbox (v1 or v2): memory and processes limited per sandbox, tmpfs pages
included; stale ones of dead runs removed."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import time
from pathlib import Path

from aitrainsai.isolation.contract import CGROUP_PREFIX


class Cgroup:
    """A memory and pids cgroup of the sandbox's own (v1 or v2), where this process may make one."""

    def __init__(self, folders: list[Path], procs: list[Path], version: int):
        self.folders, self.procs, self.version = folders, procs, version

    @classmethod
    def create(cls, memory_bytes: int, pids: int) -> Cgroup | None:
        if os.geteuid() != 0:
            return None
        name = f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        v1 = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")]
        v2 = Path("/sys/fs/cgroup")
        group: Cgroup | None = None
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



@functools.cache
def cgroups_writable() -> bool:
    group = Cgroup.create(2**30, 64)
    if group is not None:
        group.close()
    return group is not None
