"""The run ledger: everything a run produces, persisted as it happens.

Storage is one SQLite database (stdlib ``sqlite3``) in the runs directory, plus a directory per run for files (job
workspaces, checkpoints, reports). Why SQLite: each write is a transaction that is durable once ``commit`` returns,
so a run killed at any instant (SIGKILL included) loses nothing that had finished, and never leaves a half-written
record; WAL mode lets ``aitrainsai show`` read a run while it is being written; and it needs no server.
``synchronous=NORMAL`` in WAL mode survives a killed process; only a power cut could drop the last commits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

DB_NAME = "ledger.sqlite"
LOCK_NAME = ".orchestrator.lock"  # held (flock) by the process running the loop: one runner per run

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    config TEXT NOT NULL, plugins TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS episodes (
    run_id TEXT NOT NULL, id TEXT NOT NULL, step INTEGER, family TEXT, level INTEGER, group_id TEXT,
    status TEXT NOT NULL, reward REAL, data TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE TABLE IF NOT EXISTS messages (
    run_id TEXT NOT NULL, episode_id TEXT NOT NULL, seq INTEGER NOT NULL, message TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (run_id, episode_id, seq)
);
CREATE TABLE IF NOT EXISTS probes (
    run_id TEXT NOT NULL, episode_id TEXT NOT NULL, attempt INTEGER NOT NULL, ok INTEGER NOT NULL,
    problems TEXT NOT NULL, seconds REAL, created_at REAL NOT NULL, PRIMARY KEY (run_id, episode_id, attempt)
);
CREATE TABLE IF NOT EXISTS jobs (
    run_id TEXT NOT NULL, id TEXT NOT NULL, episode_id TEXT, status TEXT NOT NULL, backend TEXT, handle TEXT,
    cost_usd REAL, wall_s REAL, result TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, data TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, kind);
CREATE TABLE IF NOT EXISTS baselines (
    key TEXT PRIMARY KEY, family TEXT NOT NULL, level INTEGER NOT NULL, base_model TEXT NOT NULL,
    eval_seed INTEGER NOT NULL, eval_size INTEGER NOT NULL, score REAL NOT NULL, item_scores TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""


class LedgerError(Exception):
    """A run that cannot be found, or a ledger that cannot be opened."""


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)


@dataclass(frozen=True)
class RunSummary:
    id: str
    name: str | None
    status: str
    created_at: float
    updated_at: float
    episodes: int
    jobs_done: int
    jobs_dead: int
    mean_reward: float | None
    cost_usd: float


class Ledger:
    """The runs directory: ``ledger.sqlite`` and one sub-directory per run."""

    def __init__(self, runs_dir: Path | str):
        self.runs_dir = Path(runs_dir)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.runs_dir / DB_NAME
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"cannot open the run ledger {self.path}: {exc}") from exc
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def create_run(self, config: dict[str, Any], plugins: list[dict[str, Any]], name: str | None = None) -> "Run":
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        now = time.time()
        self.db.execute("INSERT INTO runs VALUES (?, ?, 'running', ?, ?, ?, ?)",
                        (run_id, name, now, now, _dumps(config), _dumps(plugins)))
        return Run(self, run_id)

    def run(self, ref: str) -> "Run":
        """A run by id, unique id prefix, name, or ``latest``."""
        if ref == "latest":
            row = self.db.execute("SELECT id FROM runs ORDER BY created_at DESC LIMIT 1").fetchone()
            if row is None:
                raise LedgerError(f"no runs in {self.runs_dir}")
            return Run(self, row["id"])
        rows = self.db.execute("SELECT id FROM runs WHERE id = ? OR name = ? OR id LIKE ? ORDER BY created_at",
                               (ref, ref, ref.replace("%", "") + "%")).fetchall()
        exact = [r["id"] for r in rows if r["id"] == ref]
        ids = exact or sorted({r["id"] for r in rows})
        if not ids:
            raise LedgerError(f"no run {ref!r} in {self.runs_dir} (see `aitrainsai runs`)")
        if len(ids) > 1:
            raise LedgerError(f"{ref!r} matches {len(ids)} runs: {', '.join(ids[:5])}; give more of the id")
        return Run(self, ids[0])

    # -- untrained baselines, shared by every run -------------------------------------------------------------
    def baseline(self, key: str) -> tuple[float, list[float]] | None:
        row = self.db.execute("SELECT score, item_scores FROM baselines WHERE key = ?", (key,)).fetchone()
        return None if row is None else (row["score"], json.loads(row["item_scores"]))

    def save_baseline(self, key: str, *, family: str, level: int, base_model: str, eval_seed: int, eval_size: int,
                      score: float, item_scores: list[float]) -> None:
        self.db.execute("INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (key, family, level, base_model, eval_seed, eval_size, score, _dumps(item_scores), time.time()))

    def summaries(self) -> list[RunSummary]:
        rows = self.db.execute("""
            SELECT r.id, r.name, r.status, r.created_at, r.updated_at,
              (SELECT COUNT(*) FROM episodes e WHERE e.run_id = r.id) AS episodes,
              (SELECT COUNT(*) FROM jobs j WHERE j.run_id = r.id AND j.status = 'done') AS jobs_done,
              (SELECT COUNT(*) FROM jobs j WHERE j.run_id = r.id AND j.status = 'dead') AS jobs_dead,
              (SELECT AVG(reward) FROM episodes e WHERE e.run_id = r.id AND reward IS NOT NULL) AS mean_reward,
              (SELECT COALESCE(SUM(cost_usd), 0) FROM jobs j WHERE j.run_id = r.id) AS cost_usd
            FROM runs r ORDER BY r.created_at""").fetchall()
        return [RunSummary(**{**dict(row), "status": _live_status(row["status"], self.runs_dir / row["id"])})
                for row in rows]


class Run:
    """One run's records. Every method writes through at once."""

    def __init__(self, ledger: Ledger, run_id: str):
        self.ledger = ledger
        self.db = ledger.db
        self.id = run_id
        self.dir = ledger.runs_dir / run_id
        self.dir.mkdir(parents=True, exist_ok=True)

    # -- the run ---------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (self.id,)).fetchone()
        data = dict(row)
        data["status"] = _live_status(data["status"], self.dir)
        data["config"] = json.loads(data["config"])
        data["plugins"] = json.loads(data["plugins"])
        return data

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Be this run's only runner while the block runs; LedgerError if another live process is running it."""
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LedgerError(f"run {self.id} is being run by another process right now") from None
            yield
        finally:
            os.close(fd)

    def set_status(self, status: str) -> None:
        self.db.execute("UPDATE runs SET status = ?, updated_at = ? WHERE id = ?", (status, time.time(), self.id))

    def _touch(self) -> None:
        self.db.execute("UPDATE runs SET updated_at = ? WHERE id = ?", (time.time(), self.id))

    # -- episodes and their transcripts ----------------------------------------------------------------------
    def upsert_episode(self, episode_id: str, *, status: str, step: int | None = None, family: str | None = None,
                       level: int | None = None, group_id: str | None = None, reward: float | None = None,
                       data: dict[str, Any] | None = None) -> None:
        now = time.time()
        self.db.execute("""
            INSERT INTO episodes (run_id, id, step, family, level, group_id, status, reward, data, created_at, updated_at)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (run_id, id) DO UPDATE SET status = excluded.status,
              step = COALESCE(excluded.step, step), family = COALESCE(excluded.family, family),
              level = COALESCE(excluded.level, level), group_id = COALESCE(excluded.group_id, group_id),
              reward = COALESCE(excluded.reward, reward),
              data = json_patch(data, excluded.data), updated_at = excluded.updated_at""",
                        (self.id, episode_id, step, family, level, group_id, status, reward, _dumps(data or {}), now,
                         now))

    def reset_episode(self, episode_id: str) -> None:
        """Forget an unfinished episode's transcript and probes before it is played again."""
        with self.db:
            self.db.execute("DELETE FROM messages WHERE run_id = ? AND episode_id = ?", (self.id, episode_id))
            self.db.execute("DELETE FROM probes WHERE run_id = ? AND episode_id = ?", (self.id, episode_id))

    def add_message(self, episode_id: str, message: dict[str, Any]) -> int:
        with self.db:  # one transaction: seq is read and written together
            row = self.db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE run_id = ? AND episode_id = ?",
                                  (self.id, episode_id)).fetchone()
            seq = row[0]
            self.db.execute("INSERT INTO messages VALUES (?, ?, ?, ?, ?)",
                            (self.id, episode_id, seq, _dumps(message), time.time()))
        return seq

    def episodes(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT * FROM episodes WHERE run_id = ? ORDER BY created_at, id", (self.id,))
        return [_decode(row, "data") for row in rows]

    def transcript(self, episode_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT message FROM messages WHERE run_id = ? AND episode_id = ? ORDER BY seq",
                               (self.id, episode_id))
        return [json.loads(row["message"]) for row in rows]

    # -- probes and jobs -------------------------------------------------------------------------------------
    def add_probe(self, episode_id: str, attempt: int, ok: bool, problems: list[str], seconds: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO probes VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (self.id, episode_id, attempt, int(ok), _dumps(problems), seconds, time.time()))

    def probes(self, episode_id: str | None = None) -> list[dict[str, Any]]:
        query = "SELECT * FROM probes WHERE run_id = ?" + (" AND episode_id = ?" if episode_id else "")
        args = (self.id, episode_id) if episode_id else (self.id,)
        return [_decode(row, "problems") for row in self.db.execute(query + " ORDER BY created_at, attempt", args)]

    def upsert_job(self, job_id: str, *, status: str, episode_id: str | None = None, backend: str | None = None,
                   handle: dict[str, Any] | None = None, cost_usd: float | None = None, wall_s: float | None = None,
                   result: dict[str, Any] | None = None) -> None:
        now = time.time()
        self.db.execute("""
            INSERT INTO jobs (run_id, id, episode_id, status, backend, handle, cost_usd, wall_s, result, created_at,
                              updated_at)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (run_id, id) DO UPDATE SET status = excluded.status,
              episode_id = COALESCE(excluded.episode_id, episode_id), backend = COALESCE(excluded.backend, backend),
              handle = COALESCE(excluded.handle, handle), cost_usd = COALESCE(excluded.cost_usd, cost_usd),
              wall_s = COALESCE(excluded.wall_s, wall_s), result = json_patch(result, excluded.result),
              updated_at = excluded.updated_at""",
                        (self.id, job_id, episode_id, status, backend, _dumps(handle) if handle is not None else None,
                         cost_usd, wall_s, _dumps(result or {}), now, now))

    def jobs(self, status: str | None = None) -> list[dict[str, Any]]:
        query = "SELECT * FROM jobs WHERE run_id = ?" + (" AND status = ?" if status else "") + " ORDER BY created_at"
        rows = self.db.execute(query, (self.id, status) if status else (self.id,))
        return [_decode(row, "result", "handle") for row in rows]

    # -- everything else: scores, rewards, costs, timings, metrics --------------------------------------------
    def event(self, kind: str, **data: Any) -> None:
        self.db.execute("INSERT INTO events (run_id, kind, data, created_at) VALUES (?, ?, ?, ?)",
                        (self.id, kind, _dumps(data), time.time()))

    def events(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        query = "SELECT * FROM events WHERE run_id = ?" + (" AND kind = ?" if kind else "") + " ORDER BY seq"
        for row in self.db.execute(query, (self.id, kind) if kind else (self.id,)).fetchall():
            yield _decode(row, "data")


def _decode(row: sqlite3.Row, *json_fields: str) -> dict[str, Any]:
    data = dict(row)
    for field in json_fields:
        if data.get(field) is not None:
            data[field] = json.loads(data[field])
    return data


def _live_status(status: str, run_dir: Path) -> str:
    """``running`` only while a process holds the run's lock; a killed runner leaves it ``interrupted``."""
    if status != "running":
        return status
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return "interrupted"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return "running"
    finally:
        os.close(fd)
    return "interrupted"
