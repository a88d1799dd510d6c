"""The job formats and how a job's format is read from its files: stdlib only, so that the sandboxed env server can
read it before it imports anything of the job's verifiers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

JobFormat = Literal["verifiers", "verifiers-v1"]
JOB_FILES: dict[str, tuple[str, ...]] = {
    "verifiers": ("environment.py", "rubric.py", "dataset.py", "trainer.toml"),  # classic: load_environment()
    "verifiers-v1": ("taskset.py", "rubric.py", "dataset.py", "trainer.toml"),  # one vf.Taskset in __all__
}
ENTRY_FILE: dict[str, str] = {"verifiers": "environment.py", "verifiers-v1": "taskset.py"}
V1_VARIABLE = "AITRAINSAI_VERIFIERS_V1"  # where verifiers 0.4.0 and its dependencies lie, for v1 jobs


def job_format(names: Iterable[str]) -> JobFormat:
    """A job's format from its files' shape: ``taskset.py`` (a package exporting one ``vf.Taskset``) is
    ``verifiers-v1``; anything else is the classic format (``environment.py``). Never from the name
    ``load_environment``, which both APIs use with different signatures."""
    return "verifiers-v1" if "taskset.py" in set(names) else "verifiers"


def verifiers_v1_path() -> Path | None:
    """The folder holding verifiers 0.4.0 for v1 jobs (``make install`` puts it in ``<venv>/pinned/verifiers-v1``;
    ``$AITRAINSAI_VERIFIERS_V1`` names another), or None where there is none."""
    path = Path(os.environ.get(V1_VARIABLE) or Path(sys.prefix) / "pinned" / "verifiers-v1")
    return path if (path / "verifiers" / "v1").is_dir() else None
