"""A sandbox's scratch folder outlives a SIGKILLed process; the next process that starts a sandbox removes it (and
nothing of a live process)."""

import subprocess
import sys

from aitrainsai.isolation import sandbox


def test_scratch_of_dead_processes_is_swept_once_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(sandbox, "_swept", False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = tmp_path / f"{sandbox.SCRATCH_PREFIX}{int(dead.stdout)}-abc123"
    live = tmp_path / f"{sandbox.SCRATCH_PREFIX}{subprocess.os.getppid()}-def456"
    other = tmp_path / f"{sandbox.SCRATCH_PREFIX}{int(dead.stdout)}"  # not a scratch name (the uid-lease folder's)
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "passwd").write_text("x")
    sandbox.sweep_scratch()
    assert not stale.exists()
    assert live.exists() and other.exists()
    stale.mkdir()
    sandbox.sweep_scratch()  # once per process
    assert stale.exists()
