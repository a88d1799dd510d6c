"""Runs one payload command and records how it ended, so that a restarted orchestrator can reattach to it.

``python -m aitrainsai.builtin.job_runner WORKDIR -- COMMAND...`` writes ``WORKDIR/.job_pid`` when it starts and
``WORKDIR/.job_status.json`` (exit code, wall seconds) when the command ends, then exits with the command's code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PID_FILE = ".job_pid"
STATUS_FILE = ".job_status.json"


def main(argv: list[str]) -> int:
    workdir, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m aitrainsai.builtin.job_runner WORKDIR -- COMMAND...")
    workdir_path = Path(workdir)
    (workdir_path / PID_FILE).write_text(f"{os.getpid()}\n")
    start = time.monotonic()
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    temporary = workdir_path / (STATUS_FILE + ".partial")
    temporary.write_text(json.dumps({"exit_code": code, "wall_s": time.monotonic() - start, "finished_at": time.time()}))
    os.replace(temporary, workdir_path / STATUS_FILE)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
