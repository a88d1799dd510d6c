"""A uid of its own for each live sandbox, leased from a range no file on the host belongs to (root only)."""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
from pathlib import Path

from aitrainsai.isolation.contract import UID_BASE, UID_SLOTS, SandboxUnavailable


class UidLease:
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
