"""Read-only access to a runs directory: the ledger opened read-only (``Ledger(runs_dir, readonly=True)``: SQLite's
``mode=ro``, nothing created), read through its public methods, and an accepted job's own files."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aitrainsai
from aitrainsai import Ledger, run_is_live

MAX_FILE_BYTES = 256_000  # a frozen job's file larger than this is named, not shown
MAX_FILES = 64


@contextlib.contextmanager
def open_ledger(runs_dir: Path) -> Iterator[Ledger]:
    """The ledger of ``runs_dir`` for one request, read-only (never created, written or migrated), closed after it."""
    ledger = Ledger(runs_dir, readonly=True)
    try:
        yield ledger
    finally:
        ledger.close()


class RunNotFound(LookupError):
    """No run of that id (the page is a 404)."""


def find_run(ledger: Ledger, run_id: str) -> Any:
    """The run of exactly ``run_id`` (no prefixes, names or ``latest``: links carry ids)."""
    row = ledger.db.one("SELECT id FROM runs WHERE id = ?", (run_id,))
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.runs_dir}")
    if not (ledger.runs_dir / run_id).is_dir():  # Run() would create it
        raise RunNotFound(f"run {run_id} is in the ledger but its folder {ledger.runs_dir / run_id} is missing")
    return ledger.run(run_id)


def fingerprint(ledger: Ledger, run_id: str) -> str:
    """Changes whenever the run records anything: its status, events, episodes, messages or probes."""
    row = ledger.db.one("""
        SELECT (SELECT status || ':' || updated_at FROM runs WHERE id = ?) AS run,
               (SELECT MAX(seq) FROM events WHERE run_id = ?) AS events,
               (SELECT MAX(updated_at) FROM episodes WHERE run_id = ?) AS episodes,
               (SELECT COUNT(*) FROM messages WHERE run_id = ?) AS messages,
               (SELECT COUNT(*) FROM probes WHERE run_id = ?) AS probes""", (run_id,) * 5)
    live = run_is_live(ledger.runs_dir / run_id)
    return "|".join(str(v) for v in (*(tuple(row) if row is not None else ()), live))


# -- an accepted job's files ------------------------------------------------------------------------------------
def frozen_files(folder: Path, allowed_root: Path) -> tuple[dict[str, str], list[str]]:
    """The text files of a frozen job folder (``episodes/ID/probe-N/job`` inside the run's folder), walked without
    following a symlink, each capped; and notes on what was left out. A folder outside ``allowed_root`` (the run's
    ``episodes/``) is not read at all."""
    notes: list[str] = []
    files: dict[str, str] = {}
    try:
        real = folder.resolve(strict=True)
    except OSError:
        return {}, [f"the frozen job's folder {folder.name} is gone"]
    if not real.is_relative_to(allowed_root.resolve()) or folder.is_symlink():
        return {}, ["the frozen job's folder is not inside this run's episodes: not shown"]
    for top, dirs, names in os.walk(real, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "eval")
        for name in sorted(names):
            path = Path(top) / name
            relative = path.relative_to(real).as_posix()
            if name.startswith("."):
                continue
            if len(files) >= MAX_FILES:
                notes.append(f"more than {MAX_FILES} files: the rest are not shown")
                return files, notes
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
            except OSError:
                notes.append(f"{relative}: a link or unreadable, not shown")
                continue
            with os.fdopen(fd, "rb") as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):
                    notes.append(f"{relative}: not a regular file, not shown")
                    continue
                if info.st_size > MAX_FILE_BYTES:
                    notes.append(f"{relative}: {info.st_size} bytes, over {MAX_FILE_BYTES}: not shown")
                    continue
                data = handle.read(MAX_FILE_BYTES + 1)
            if b"\x00" in data:
                notes.append(f"{relative}: binary, not shown")
                continue
            files[relative] = data.decode("utf-8", errors="replace")
    return files, notes


def starting_files(plugins: Any, config: dict[str, Any], family_name: str, level: int) -> dict[str, str]:
    """The files the agent's workspace started from, rebuilt as the episode built them (``job_template`` of the
    family's task spec at ``level``, with the run's inner trainer and job format). Raises when a part is missing."""
    families = config.get("families") or {}
    job_format = (families.get("job_formats") or {}).get(family_name, families.get("job_format", "verifiers"))
    options = families.get(family_name)  # a run records a family's options under its name (ChosenFamilies.record)
    family = plugins.task_families.create(family_name, options if isinstance(options, dict) else None)
    inner = config.get("inner_trainer") or {}
    trainer = plugins.inner_trainers.create(inner["use"], inner.get(inner["use"]))
    spec = family.task_spec(level, trainer.constraints(aitrainsai.Constraints(), job_format)).model_copy(
        update={"job_format": job_format})
    return aitrainsai.job_template(spec, trainer.config_template(spec), job_format)
