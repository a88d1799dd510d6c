"""A frozen v1 job as an installable environment package: what ``aitrainsai export`` writes, for verifiers' own
tooling (``vf-eval <id>``, ``vf.load_taskset``) or an environment hub.

The package holds the job's files as accepted under one module, its frozen ``dataset.jsonl`` less the rows the probe
found to be hidden-eval items (``probe.json``, which names them, stays behind: the package shows neither), a
``pyproject.toml`` that depends on verifiers 0.4.0, ``aitrainsai`` and the task family's distribution (the job
imports its public module), and an ``__init__`` that re-exports the job's ``vf.Taskset``. The job's modules import
one another by their own names and verifiers starts a rollout's tool server as ``python -m taskset``; the ``__init__``
puts the module's folder on the path for both.

What the ledger says (a run's or episode's id, a family's name) may be damaged or foreign: it goes into the generated
files only as data, a Python string literal (``ascii``) or a TOML string (``tomli_w``), and the names that become
code or paths (the distribution, its module, the family's distribution) are checked against strict patterns first.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from aitrainsai.jobs.format import job_format
from aitrainsai.jobs.job import DATASET_FILE, PROBE_FILE, JobChanged, frozen_rows, verify_job, write_rows
from aitrainsai.parsing import printable
from aitrainsai.errors import AitrainsaiError

NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")  # what package_name makes: a distribution's and, with _, a module's
DISTRIBUTION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,198}[A-Za-z0-9])?")  # a PEP 508 name


class ExportError(ValueError, AitrainsaiError):
    """The job cannot be exported (one line, for the command line)."""


def package_name(family: str, episode: str) -> str:
    """The distribution's name (also verifiers' id for it): ``aitrainsai-<family>-<episode>``, lower case, ``-``
    between words; its module is the same with ``_``."""
    words = re.findall(r"[a-z0-9]+", f"aitrainsai {family} {episode}".lower())
    return "-".join(words)


def export_job(frozen: Path, digest: str | None, out: Path, *, name: str, family_distribution: str,
               about: str = "") -> Path:
    """Write the package of the v1 job frozen in ``frozen`` (checked against ``digest``) to ``out``, which must not
    exist; returns ``out``."""
    frozen, out = Path(frozen), Path(out)
    if not NAME.fullmatch(name):
        raise ExportError(f"{printable(name)[:100]!r} is not a package name (lower-case words joined by '-')")
    if not DISTRIBUTION.fullmatch(family_distribution):
        raise ExportError(f"the task family's distribution {printable(family_distribution)[:100]!r} is not a "
                          "distribution name")
    verify_job(frozen, digest)
    if job_format(os.listdir(frozen)) != "verifiers-v1":
        raise ExportError("only a verifiers-v1 job (taskset.py) exports as an environment package; this job is in the "
                          "classic format (environment.py)")
    if out.exists():
        raise ExportError(f"{out} exists; give another --out")
    module = name.replace("-", "_")
    try:
        rows = frozen_rows(frozen)
    except JobChanged as exc:
        raise ExportError(str(exc)) from None
    shutil.copytree(frozen, out / module, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", PROBE_FILE, DATASET_FILE))
    for path in (out / module).rglob("*"):
        if path.is_symlink() or not (path.is_dir() or stat.S_ISREG(path.lstat().st_mode)):
            path.unlink()  # a frozen job holds regular files only; never carry anything else
    write_rows(out / module, [row.model_dump() for i, row in enumerate(rows.rows) if rows.trained(i)])
    (out / module / "__init__.py").write_text(init_module(name, about), encoding="ascii")
    (out / "pyproject.toml").write_text(pyproject(name, module, family_distribution, about), encoding="utf-8")
    return out


def init_module(name: str, about: str) -> str:
    """The package's ``__init__``: its docstring an ASCII string literal (``about`` only ever data), then the code."""
    return INIT.format(docstring=ascii(f"{name}: a verifiers v1 taskset{printable(about)}, exported by aitrainsai."))


def pyproject(name: str, module: str, family_distribution: str, about: str) -> str:
    """The package's ``pyproject.toml``, written by ``tomli_w`` (every string escaped as TOML); the description one
    line (core metadata's summary is one)."""
    import tomli_w

    description = " ".join(f"A verifiers v1 taskset{printable(about)}, exported by aitrainsai".split())
    return tomli_w.dumps({
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": name, "version": "0.1.0", "description": description, "requires-python": ">=3.11",
                    "dependencies": ["verifiers==0.4.0", "aitrainsai", family_distribution]},
        "tool": {"hatch": {"build": {"targets": {"wheel": {"packages": [module]}}}}},
    })


INIT = '''{docstring}

import os
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
# the job's modules import one another by their own names, and verifiers starts a rollout's tool server as
# `python -m taskset`: this folder goes on the path here and in the processes verifiers starts
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)

from taskset import *  # noqa: E402,F403
from taskset import __all__  # noqa: E402,F401
'''
