"""The run ledger: everything a run produces, persisted as it happens.

Storage is one SQLite database (stdlib ``sqlite3``) in the runs directory, plus a directory per run for files (job
workspaces, checkpoints, reports). Why SQLite: each write is a transaction that is durable once ``commit`` returns,
so a run killed at any instant (SIGKILL included) loses nothing that had finished, and never leaves a half-written
record; WAL mode lets ``aitrainsai show`` read a run while it is being written; and it needs no server.
``synchronous=NORMAL`` in WAL mode survives a killed process; only a power cut could drop the last commits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path, PurePath
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from aitrainsai.chat import Message
from aitrainsai.errors import AitrainsaiError
from aitrainsai.parsing import read_json
from aitrainsai.run.record import (AgentPrompt, BackendEvent, BaselineRow, EpisodeData, EpisodeRow, EventRow,
                                   GroupLaunched, GroupRef, Job, JobProgress, JobState, ProbeRow, Record, RunInfo,
                                   check_job_move, legacy_group, parse_record)

R = TypeVar("R", bound=Record)
M = TypeVar("M", bound=BaseModel)

DB_NAME = "ledger.sqlite"
LOCK_NAME = ".orchestrator.lock"  # held (flock) by the process running the loop: one runner per run
PROMPTS_DIR = "agent_prompt"  # the agent's opening prompt per family, FAMILY.json (Run.record_agent_prompt)
MAX_PROMPT_BYTES = 16 * 2**20  # a recorded prompt file read back: opening messages and tool schemas

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    config TEXT NOT NULL, plugins TEXT NOT NULL, selection TEXT
);
CREATE TABLE IF NOT EXISTS episodes (
    run_id TEXT NOT NULL, id TEXT NOT NULL, step INTEGER, family TEXT, level INTEGER, group_id TEXT,
    status TEXT NOT NULL, reward REAL, data TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE TABLE IF NOT EXISTS messages (
    run_id TEXT NOT NULL, episode_id TEXT NOT NULL, seq INTEGER NOT NULL, message TEXT NOT NULL,
    created_at REAL NOT NULL,
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
    created_at REAL NOT NULL, engine TEXT
);
"""


class LedgerError(AitrainsaiError):
    """A run that cannot be found, or a ledger that cannot be opened, read or written."""


# Our own mistakes (a broken query, a key written twice) stay exceptions; everything else SQLite reports is the file's.
_BUGS = (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)


def _ledger_error(path: Path, exc: Exception) -> LedgerError:
    """One line that names the file and says what to do."""
    where = path.parent
    if isinstance(exc, OSError):
        reason = exc.strerror or " ".join(str(exc).split())
        return LedgerError(f"cannot use the runs directory {where}: {reason}"
                           f"{f' ({exc.filename})' if exc.filename else ''}; give a writable one with --runs-dir")
    said = " ".join(str(exc).split())  # SQLite's own words, on one line
    if isinstance(exc, sqlite3.OperationalError):
        if "locked" in said or "busy" in said:
            return LedgerError(f"the run ledger {path} is busy ({said}); try again when the other process is done")
        return LedgerError(f"cannot use the run ledger {path}: {said}; check that {where} is writable and has space, "
                           f"or give another --runs-dir")
    return LedgerError(f"the run ledger {path} is damaged or is not a run ledger ({said}); move it aside to start a "
                       f"new one, or give another --runs-dir")


class _Database:
    """The ledger's SQLite connection. Rows are fetched at once, and a database that cannot be opened, read or
    written (damaged, not a database, read-only, full) is a :class:`LedgerError` naming the file: SQLite may notice
    damage only when a query reaches the bad page, so every query is guarded, not just the opening."""

    def __init__(self, path: Path, *, readonly: bool = False):
        self.path = path
        self._depth = 0
        self.readonly = readonly
        if readonly:  # never creates, migrates or writes: a reader beside a live run (``aitrainsai view``)
            with self.guard():
                if not path.is_file():
                    raise OSError(errno.ENOENT, "no run ledger here")
                self.connection = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=5,
                                                  check_same_thread=False)
                self.connection.row_factory = sqlite3.Row
                self.connection.execute("PRAGMA query_only = ON")
                self.connection.execute("SELECT COUNT(*) FROM runs").fetchone()  # not a ledger: fails here
            return
        with self.guard():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):  # SQLite would only say "unable to open database file"
                raise OSError(errno.EACCES, "not writable (a read-only file system, or no permission)")
            self.connection = sqlite3.connect(path, isolation_level=None, timeout=30)
            self.connection.row_factory = sqlite3.Row
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")
            self.connection.executescript(SCHEMA)
            columns = {row[1] for row in self.connection.execute("PRAGMA table_info(runs)")}
            if "selection" not in columns:  # a ledger from before runs recorded their plugin selection
                self.connection.execute("ALTER TABLE runs ADD COLUMN selection TEXT")
            columns = {row[1] for row in self.connection.execute("PRAGMA table_info(baselines)")}
            if "engine" not in columns:  # a ledger from before baselines recorded the engine that scored them
                self.connection.execute("ALTER TABLE baselines ADD COLUMN engine TEXT")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except _BUGS:
            raise
        except (sqlite3.DatabaseError, OSError) as exc:
            raise _ledger_error(self.path, exc) from exc

    def rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self.guard():
            return self.connection.execute(sql, args).fetchall()

    def one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self.guard():
            return self.connection.execute(sql, args).fetchone()

    def write(self, sql: str, args: tuple = ()) -> None:
        if self.readonly:
            raise LedgerError(f"{self.path} was opened read-only")
        with self.guard():
            self.connection.execute(sql, args)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All writes in the block commit together or not at all (nested blocks join the outer one)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.write("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
            self.write("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.connection.execute("ROLLBACK")
            raise
        finally:
            self._depth = 0

    def check(self) -> None:
        problems = [row[0] for row in self.rows("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise _ledger_error(self.path, sqlite3.DatabaseError("; ".join(problems[:3])))

    def close(self) -> None:
        self.connection.close()


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
    agent_cost_usd: float | None = None  # the outer trainer's spending at its last step, where it reports one


class Ledger:
    """The runs directory: ``ledger.sqlite`` and one sub-directory per run."""

    def __init__(self, runs_dir: Path | str, *, readonly: bool = False):
        """``readonly``: open an existing ledger only to read it (a missing one is a :class:`LedgerError`); its runs
        create no folders and every write is refused."""
        self.runs_dir = Path(runs_dir)
        self.path = self.runs_dir / DB_NAME
        self.db = _Database(self.path, readonly=readonly)

    def close(self) -> None:
        self.db.close()

    def check(self) -> None:
        """Read every page once (``PRAGMA quick_check``): a damaged ledger fails here, before a run starts on it."""
        self.db.check()

    def create_run(self, config: dict[str, Any], plugins: list[dict[str, Any]], name: str | None = None,
                   selection: str | None = None) -> Run:
        """A new run: its resolved config, its loaded plugins (name, version, ...) and their selection as one
        ``--plugins`` string (:meth:`aitrainsai.plugins.Plugins.selection_string`), which a resume loads again."""
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        now = time.time()
        run_dir = self.runs_dir / run_id
        with self.db.guard():  # the directory first: a run that cannot hold files leaves no row behind
            run_dir.mkdir(parents=True)
        try:
            self.db.write("INSERT INTO runs (id, name, status, created_at, updated_at, config, plugins, selection) "
                          "VALUES (?, ?, 'running', ?, ?, ?, ?, ?)",
                          (run_id, name, now, now, _dumps(config), _dumps(plugins), selection))
        except LedgerError:
            run_dir.rmdir()
            raise
        return Run(self, run_id)

    def run(self, ref: str) -> Run:
        """A run by id, unique id prefix, name, or ``latest``."""
        if ref == "latest":
            row = self.db.one("SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
            if row is None:
                raise LedgerError(f"no runs in {self.runs_dir}")
            return Run(self, row["id"])
        rows = self.db.rows("SELECT id FROM runs WHERE id = ? OR name = ? OR id LIKE ? ORDER BY created_at",
                            (ref, ref, ref.replace("%", "") + "%"))
        exact = [r["id"] for r in rows if r["id"] == ref]
        ids = exact or sorted({r["id"] for r in rows})
        if not ids:
            raise LedgerError(f"no run {ref!r} in {self.runs_dir} (see `aitrainsai runs`)")
        if len(ids) > 1:
            raise LedgerError(f"{ref!r} matches {len(ids)} runs: {', '.join(ids[:5])}; give more of the id")
        return Run(self, ids[0])

    # -- untrained baselines, shared by every run -------------------------------------------------------------
    def baseline(self, key: str) -> BaselineRow | None:
        """The cached untrained score under ``key`` (None: none cached)."""
        row = self.db.one("SELECT score, item_scores, engine FROM baselines WHERE key = ?", (key,))
        if row is None:
            return None
        return _typed(self.path, BaselineRow, f"baseline {key}", _decode(self.path, row, "item_scores", "engine"))

    def save_baseline(self, key: str, *, family: str, level: int, base_model: str, eval_seed: int, eval_size: int,
                      score: float, item_scores: list[float], engine: dict[str, Any] | None = None) -> None:
        self.db.write("INSERT OR REPLACE INTO baselines (key, family, level, base_model, eval_seed, eval_size, score, "
                      "item_scores, created_at, engine) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (key, family, level, base_model, eval_seed, eval_size, score, _dumps(item_scores), time.time(),
                       None if engine is None else _dumps(engine)))

    def summaries(self) -> list[RunSummary]:
        rows = self.db.rows("""
            SELECT r.id, r.name, r.status, r.created_at, r.updated_at,
              (SELECT COUNT(*) FROM episodes e WHERE e.run_id = r.id) AS episodes,
              (SELECT COUNT(*) FROM jobs j WHERE j.run_id = r.id AND j.status = 'done') AS jobs_done,
              (SELECT COUNT(*) FROM jobs j WHERE j.run_id = r.id AND j.status = 'dead') AS jobs_dead,
              (SELECT AVG(reward) FROM episodes e WHERE e.run_id = r.id AND reward IS NOT NULL) AS mean_reward,
              (SELECT COALESCE(SUM(cost_usd), 0) FROM jobs j WHERE j.run_id = r.id) AS cost_usd,
              (SELECT json_extract(v.data, '$.metrics.cost_usd_total') FROM events v
                 WHERE v.run_id = r.id AND v.kind = 'outer_step' ORDER BY v.seq DESC LIMIT 1) AS agent_cost_usd
            FROM runs r ORDER BY r.created_at""")
        return [RunSummary(**{**dict(row), "status": _live_status(row["status"], self.runs_dir / row["id"])})
                for row in rows]


class Run:
    """One run's records. Every method writes through at once."""

    def __init__(self, ledger: Ledger, run_id: str):
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):  # a damaged or foreign ledger's row
            raise LedgerError(f"the ledger's run id {_shown(run_id, 100)!r} is not a run id (one plain name): not "
                              "opened")
        self.ledger = ledger
        self.db = ledger.db
        self.id = run_id
        self.dir = ledger.runs_dir / run_id
        if not self.db.readonly:
            with self.db.guard():
                self.dir.mkdir(parents=True, exist_ok=True)

    # -- the run ---------------------------------------------------------------------------------------------
    def info(self) -> RunInfo:
        """The run's row (its status ``interrupted`` where no live process runs it any more)."""
        row = self.db.one("SELECT * FROM runs WHERE id = ?", (self.id,))
        if row is None:
            raise LedgerError(f"run {self.id} is no longer in {self.ledger.path}")
        data = _decode(self.ledger.path, row, "config", "plugins")
        data["status"] = _live_status(data["status"], self.dir)
        return _typed(self.ledger.path, RunInfo, f"run {self.id}", data)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Be this run's only runner while the block runs; LedgerError if another live process is running it."""
        with self.db.guard():
            fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LedgerError(f"run {self.id} is being run by another process right now") from None
            yield
        finally:
            os.close(fd)

    def set_config(self, config: dict[str, Any]) -> None:
        """Replace the recorded config (a resume that raised a budget); the caller records why in an event."""
        self.db.write("UPDATE runs SET config = ?, updated_at = ? WHERE id = ?", (_dumps(config), time.time(), self.id))

    def set_status(self, status: str) -> None:
        self.db.write("UPDATE runs SET status = ?, updated_at = ? WHERE id = ?", (status, time.time(), self.id))

    def _touch(self) -> None:
        self.db.write("UPDATE runs SET updated_at = ? WHERE id = ?", (time.time(), self.id))

    # -- episodes and their transcripts ----------------------------------------------------------------------
    def upsert_episode(self, episode_id: str, *, status: str, step: int | None = None, family: str | None = None,
                       level: int | None = None, group_id: str | None = None, reward: float | None = None,
                       data: EpisodeData | None = None) -> None:
        """Write an episode's row: fields not given keep their value, ``data`` sets the fields it was made with."""
        now = time.time()
        self.db.write("""
            INSERT INTO episodes (run_id, id, step, family, level, group_id, status, reward, data,
                                  created_at, updated_at)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (run_id, id) DO UPDATE SET status = excluded.status,
              step = COALESCE(excluded.step, step), family = COALESCE(excluded.family, family),
              level = COALESCE(excluded.level, level), group_id = COALESCE(excluded.group_id, group_id),
              reward = COALESCE(excluded.reward, reward),
              data = json_patch(data, excluded.data), updated_at = excluded.updated_at""",
                      (self.id, episode_id, step, family, level, group_id, status, reward,
                       _dumps(data.model_dump(mode="json", include=data.model_fields_set) if data else {}), now, now))

    def reset_episode(self, episode_id: str) -> None:
        """Forget an unfinished episode's transcript and probes before it is played again."""
        with self.db.transaction():
            self.db.write("DELETE FROM messages WHERE run_id = ? AND episode_id = ?", (self.id, episode_id))
            self.db.write("DELETE FROM probes WHERE run_id = ? AND episode_id = ?", (self.id, episode_id))

    def add_message(self, episode_id: str, message: Message) -> int:
        with self.db.transaction():  # seq is read and written together
            row = self.db.one("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE run_id = ? AND episode_id = ?",
                              (self.id, episode_id))
            seq = row[0] if row is not None else 0
            self.db.write("INSERT INTO messages VALUES (?, ?, ?, ?, ?)",
                          (self.id, episode_id, seq, _dumps(message), time.time()))
        return seq

    def episode(self, episode_id: str) -> EpisodeRow | None:
        """One episode of this run, as :meth:`episodes` gives it (None: no such episode)."""
        row = self.db.one("SELECT * FROM episodes WHERE run_id = ? AND id = ?", (self.id, episode_id))
        return None if row is None else self._read_episode(row)

    def episodes(self, group_id: str | None = None) -> list[EpisodeRow]:
        """This run's episodes (only one group's, if ``group_id`` is given), oldest first."""
        query = "SELECT * FROM episodes WHERE run_id = ?" + (" AND group_id = ?" if group_id else "")
        rows = self.db.rows(query + " ORDER BY created_at, id", (self.id, group_id) if group_id else (self.id,))
        return [self._read_episode(row) for row in rows]

    def _read_episode(self, row: sqlite3.Row) -> EpisodeRow:
        data = _decode(self.ledger.path, row, "data")
        del data["run_id"]
        return _typed(self.ledger.path, EpisodeRow, f"episode {data['id']}", data)

    def transcript(self, episode_id: str) -> list[dict[str, Any]]:
        rows = self.db.rows("SELECT message FROM messages WHERE run_id = ? AND episode_id = ? ORDER BY seq",
                            (self.id, episode_id))
        return [_loads(self.ledger.path, row["message"]) for row in rows]

    def transcript_lines(self, episode_id: str, *, max_bytes: int) -> list[bytes]:
        """The transcript's messages as recorded: each one's JSON as bytes, neither decoded nor parsed, and cut after
        ``max_bytes + 1`` (enough to see that it is longer), for a reader that parses each on its own, bounded
        (:func:`aitrainsai.load_json`): a damaged message (not UTF-8, not JSON, too deep, too large) is refused
        alone."""
        rows = self.db.rows("SELECT substr(CAST(message AS BLOB), 1, ?) FROM messages WHERE run_id = ? AND "
                            "episode_id = ? ORDER BY seq", (max_bytes + 1, self.id, episode_id))
        return [bytes(row[0] or b"") for row in rows]

    def record_agent_prompt(self, family: str, prompt: dict[str, Any]) -> None:
        """The exact prompt the agent sees in ``family`` (its opening messages and tool schemas), once per family: a
        file in the run's folder (``agent_prompt/FAMILY.json``), kept out of the database, whose rows stay small."""
        path = self.dir / PROMPTS_DIR / f"{family}.json"
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(prompt, ensure_ascii=False))
        os.replace(scratch, path)

    def agent_prompts(self) -> dict[str, AgentPrompt]:
        """The recorded prompts by family (:meth:`record_agent_prompt`); a file that is not a prompt, or refused as
        :func:`aitrainsai.read_json` refuses (too large, too deep, a link), is left out."""
        folder = self.dir / PROMPTS_DIR
        found = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                found[path.stem] = AgentPrompt.model_validate(read_json(path, max_bytes=MAX_PROMPT_BYTES))
            except ValueError:  # UntrustedInputError (unreadable included), or not a prompt (pydantic's)
                continue
        return found

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Writes in the block are recorded together or not at all (a kill inside it loses all of them)."""
        with self.db.transaction():
            yield

    # -- probes and jobs -------------------------------------------------------------------------------------
    def add_probe(self, episode_id: str, attempt: int, ok: bool, problems: list[str], seconds: float) -> None:
        self.db.write("INSERT OR REPLACE INTO probes VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (self.id, episode_id, attempt, int(ok), _dumps(problems), seconds, time.time()))

    def probes(self, episode_id: str | None = None) -> list[ProbeRow]:
        """This run's probe attempts (one episode's, if ``episode_id`` is given), oldest first."""
        query = "SELECT * FROM probes WHERE run_id = ?" + (" AND episode_id = ?" if episode_id else "")
        args = (self.id, episode_id) if episode_id else (self.id,)
        found = []
        for row in self.db.rows(query + " ORDER BY created_at, attempt", args):
            data = _decode(self.ledger.path, row, "problems")
            del data["run_id"]
            found.append(_typed(self.ledger.path, ProbeRow, f"probe attempt {data['attempt']} of episode "
                                f"{data['episode_id']}", data))
        return found

    def upsert_job(self, job_id: str, *, status: JobState | str, episode_id: str | None = None,
                   backend: str | None = None, handle: dict[str, Any] | None = None, cost_usd: float | None = None,
                   wall_s: float | None = None, progress: JobProgress | None = None) -> None:
        """Move a job to ``status`` (:data:`aitrainsai.run.record.JOB_MOVES`; :class:`JobStateError` where it may not
        go), with what is known now: fields not given keep their value, ``progress`` sets the progress fields it
        names (:meth:`JobProgress.adding`)."""
        now = time.time()
        with self.db.transaction():  # the state and progress are read and moved together
            row = self.db.one("SELECT status, result FROM jobs WHERE run_id = ? AND id = ?", (self.id, job_id))
            known = self._progress(job_id, row["result"]) if row is not None else JobProgress()
            if progress is not None:
                known = known.adding(progress)
            state = check_job_move(job_id, None if row is None else row["status"], status,
                                   shared=known.shared_with is not None)
            self.db.write("""
                INSERT INTO jobs (run_id, id, episode_id, status, backend, handle, cost_usd, wall_s, result,
                                  created_at, updated_at)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (run_id, id) DO UPDATE SET status = excluded.status,
                  episode_id = COALESCE(excluded.episode_id, episode_id), backend = COALESCE(excluded.backend, backend),
                  handle = COALESCE(excluded.handle, handle), cost_usd = COALESCE(excluded.cost_usd, cost_usd),
                  wall_s = COALESCE(excluded.wall_s, wall_s), result = excluded.result,
                  updated_at = excluded.updated_at""",
                          (self.id, job_id, episode_id, state.value, backend,
                           _dumps(handle) if handle is not None else None, cost_usd, wall_s,
                           _dumps(known.stored()), now, now))

    def _progress(self, job_id: str, text: str | None) -> JobProgress:
        try:
            return JobProgress.model_validate(_loads(self.ledger.path, text) if text else {})
        except ValidationError as exc:
            raise _ledger_error(self.ledger.path, sqlite3.DatabaseError(
                f"job {job_id}'s progress does not fit its type: {exc.errors()[0]['msg']}")) from exc

    def job(self, job_id: str) -> Job | None:
        """One job's row, typed (None where the run has none of that id)."""
        row = self.db.one("SELECT * FROM jobs WHERE run_id = ? AND id = ?", (self.id, job_id))
        return None if row is None else self._job(row)

    def jobs(self, state: JobState | None = None) -> list[Job]:
        """This run's jobs (only those in ``state``, if given), oldest first, typed."""
        query = "SELECT * FROM jobs WHERE run_id = ?" + (" AND status = ?" if state else "") + " ORDER BY created_at"
        return [self._job(row) for row in self.db.rows(query, (self.id, state.value) if state else (self.id,))]

    def jobs_cost(self, episode_ids: list[str] | None = None) -> float:
        """Dollars the backend charged for this run's jobs (training and evaluation), or for those of some episodes."""
        query = "SELECT COALESCE(SUM(cost_usd), 0) AS total FROM jobs WHERE run_id = ?"
        args: tuple = (self.id,)
        if episode_ids is not None:
            query += f" AND episode_id IN ({', '.join('?' * len(episode_ids))})"
            args += tuple(episode_ids)
        row = self.db.one(query, args)
        return float(row["total"]) if row is not None else 0.0

    # -- everything else: scores, rewards, costs, timings, metrics --------------------------------------------
    def record(self, record: Record) -> None:
        """Write one event (:mod:`aitrainsai.run.record`): its kind and its data as JSON."""
        self.db.write("INSERT INTO events (run_id, kind, data, created_at) VALUES (?, ?, ?, ?)",
                      (self.id, record.kind, _dumps(record.data()), time.time()))

    def records(self, kind: type[R]) -> list[R]:
        """This run's events of one type, oldest first, as that type (``BackendEvent``: every backend's)."""
        args: tuple[str, ...] = ()
        if kind is BackendEvent:
            query = "kind LIKE 'backend\\_%' ESCAPE '\\'"
        else:
            query, args = "kind = ?", (kind.KIND,)
        rows = self.db.rows(f"SELECT kind, data FROM events WHERE run_id = ? AND {query} ORDER BY seq",
                            (self.id, *args))
        return [record for record in map(self._parse, rows) if isinstance(record, kind)]  # all are: the query's

    def _parse(self, row: sqlite3.Row) -> Record:
        try:
            return parse_record(row["kind"], _loads(self.ledger.path, row["data"]))
        except ValidationError as exc:
            raise _ledger_error(self.ledger.path, sqlite3.DatabaseError(
                f"a {row['kind']} event does not fit its type: {exc.errors()[0]['msg']}")) from exc

    def events(self, kind: str | None = None, *, after: int = 0) -> Iterator[EventRow]:
        """The events as stored, unparsed, those past ``seq`` ``after`` (a row that is not a JSON object is left
        out): for a count by kind, for what reads the run as it goes (the trackers' feed), and for tests that read a
        backend's own fields; code that wants one type reads :meth:`records`."""
        query = ("SELECT seq, kind, data, created_at FROM events WHERE run_id = ? AND seq > ?"
                 + (" AND kind = ?" if kind else "") + " ORDER BY seq")
        for row in self.db.rows(query, (self.id, after, kind) if kind else (self.id, after)):
            try:
                yield _typed(self.ledger.path, EventRow, f"event {row['seq']}", _decode(self.ledger.path, row, "data"))
            except LedgerError:  # a damaged or foreign row is left out: one bad row never ends a reader's feed
                continue

    def _job(self, row: sqlite3.Row) -> Job:
        data = _decode(self.ledger.path, row, "handle")  # the progress is in the column ``result``, its old name
        return _typed(self.ledger.path, Job, f"job {data['id']}", {
            "id": data["id"], "state": data["status"], "episode_id": data["episode_id"], "backend": data["backend"],
            "handle": data["handle"], "cost_usd": data["cost_usd"], "wall_s": data["wall_s"],
            "progress": self._progress(data["id"], data["result"]), "created_at": data["created_at"],
            "updated_at": data["updated_at"]})

    def groups(self) -> dict[str, GroupRef]:
        """The groups the loop made, by id: from their :class:`GroupLaunched` records, and for a run recorded
        before those, from the ids of its episodes' groups (:func:`legacy_group`)."""
        found = {event.group.id: event.group for event in self.records(GroupLaunched)}
        for row in self.db.rows("SELECT DISTINCT group_id, family FROM episodes WHERE run_id = ? AND group_id IS NOT "
                                "NULL ORDER BY created_at", (self.id,)):
            if row["group_id"] not in found and (ref := legacy_group(row["group_id"], row["family"] or "")):
                found[row["group_id"]] = ref
        return found


def _loads(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the interpreter's limit
        raise _ledger_error(path, sqlite3.DatabaseError(f"a record is not valid JSON: {exc}")) from exc


def _typed(path: Path, model: type[M], what: str, data: dict[str, Any]) -> M:
    """A row as its model; a row that does not fit is the ledger's damage (:class:`LedgerError` naming it)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise _ledger_error(path, sqlite3.DatabaseError(
            f"{_shown(what, 150)}'s row does not fit its type: {where + ': ' if where else ''}{error['msg']}")) from exc


def _decode(path: Path, row: sqlite3.Row, *json_fields: str) -> dict[str, Any]:
    data = dict(row)
    for field in json_fields:
        if data.get(field) is not None:
            data[field] = _loads(path, data[field])
    return data


def _live_status(status: str, run_dir: Path) -> str:
    """``running`` only while a process holds the run's lock; a killed runner leaves it ``interrupted``."""
    if status != "running":
        return status
    return "running" if run_is_live(run_dir) else "interrupted"


def run_is_live(run_dir: Path) -> bool:
    """A live process is running the run in ``run_dir`` (it holds the lock :meth:`Run.hold` takes)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a run's or an episode's id: one plain path component
_PROBE_DIR = re.compile(r"probe-\d{1,6}")


def _shown(value: Any, limit: int) -> str:
    """A value a ledger row holds, on one line of printable text (for a message)."""
    return "".join(c if c.isprintable() else "?" for c in " ".join(str(value).split()))[:limit]


class FrozenJobError(ValueError, AitrainsaiError):
    """An episode's row names no frozen job folder that may be read; the message says why, in one line."""


def frozen_job_folder(run_dir: Path, episode_id: str, stored: Any) -> Path:
    """The episode's frozen job folder, ``RUN/episodes/ID/probe-N/job``, that its row names (``frozen_job``), or
    :class:`FrozenJobError`: a row naming anything else (the episode's ``eval/``, a path with ``..``, another run's
    folder, a path through a link) is refused, and nothing is read from it. What reads a ledger that may be damaged or
    foreign (the viewer, ``aitrainsai export``) asks here before it opens a job's files."""
    if not isinstance(episode_id, str) or not RUN_ID.fullmatch(episode_id):
        raise FrozenJobError(f"the episode id {_shown(episode_id, 100)!r} is not one plain name: its job not read")
    if not isinstance(stored, str) or not stored:
        raise FrozenJobError("no job was accepted in this episode")
    parts = PurePath(stored).parts
    shown = _shown(stored, 200)
    if (".." in parts or len(parts) < 4 or parts[-4:-2] != ("episodes", episode_id)
            or not _PROBE_DIR.fullmatch(parts[-2]) or parts[-1] != "job"):
        raise FrozenJobError(f"the episode's row names {shown!r}, not its frozen job (episodes/{episode_id}/probe-N/"
                             "job): not read")
    expected = Path(run_dir).resolve() / "episodes" / episode_id / parts[-2] / "job"  # the runs folder may be a link
    try:
        real = Path(os.path.realpath(stored, strict=True))
    except OSError:
        raise FrozenJobError(f"the frozen job's folder {parts[-2]}/job is gone") from None
    if real != expected or Path(os.path.realpath(expected)) != expected:
        raise FrozenJobError(f"the episode's row names {shown!r}, which is not this run's frozen job folder (or is "
                             "reached through a link): not read")
    return expected
