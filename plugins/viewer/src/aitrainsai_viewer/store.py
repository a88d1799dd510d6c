"""Read-only access to a runs directory: the ledger opened read-only (``Ledger(runs_dir, readonly=True)``: SQLite's
``mode=ro``, nothing created), every row read on its own and checked, and an accepted job's own files.

A row is what the loop wrote, unless the file was damaged or tampered with; and what it holds is the agent's. So no
row is trusted to parse or to have the types the pages read: each is bounded (:data:`MAX_ROW_CHARS`, nested at most
:data:`MAX_DEPTH` deep, bad UTF-8 read as U+FFFD) and typed, and one that is not comes back as :class:`Damaged`, named
and shown in its place, never failing the page."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

import aitrainsai
from aitrainsai import (RUN_ID, AgentPrompt, BackendEvent, EpisodeRow, Job, JobState, Ledger, LedgerError, OuterStep,
                        Run, run_is_live)

MAX_DEPTH = 64  # the loop's rows nest about 10 deep; deeper is damage (and stays far from Python's recursion limit)
MAX_ROW_CHARS = 8_000_000  # one row's JSON, decoded whole (a message over MESSAGE_CHARS is shown in part instead)
MESSAGE_CHARS = 500_000  # a stored message longer than this is not decoded on a page: its start is shown as stored
PREVIEW_CHARS = 20_000  # what a page shows of a message's stored text when it does not decode it
RAW_CHARS = 32_000_000  # the most of one stored message its raw view serves
RAW_FILE_BYTES = 10_000_000  # the most of one job file its raw view serves (the workspace's cap on a whole job)
MAX_LISTED = 256  # files listed from a frozen job (the workspace holds at most 64)

M = TypeVar("M", bound=BaseModel)


@contextlib.contextmanager
def open_ledger(runs_dir: Path) -> Iterator[Ledger]:
    """The ledger of ``runs_dir`` for one request, read-only (never created, written or migrated), closed after it.
    Text that is not UTF-8 reads with U+FFFD in place of its bad bytes, never failing the query that met it."""
    ledger = Ledger(runs_dir, readonly=True)
    ledger.db.connection.text_factory = lambda data: data.decode("utf-8", errors="replace")
    try:
        yield ledger
    finally:
        ledger.close()


class RunNotFound(LookupError):
    """No run of that id (the page is a 404)."""


def find_run(ledger: Ledger, run_id: str) -> CheckedRun:
    """The run of exactly ``run_id`` (no prefixes, names or ``latest``: links carry ids)."""
    row = ledger.db.one("SELECT id FROM runs WHERE id = ?", (run_id,))
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.runs_dir}")
    if not RUN_ID.fullmatch(run_id):  # a tampered row: its folder would be a path, not a name
        raise RunNotFound(f"the run {run_id!r} has an id that is not a folder name: its row is damaged")
    if not (ledger.runs_dir / run_id).is_dir():
        raise RunNotFound(f"run {run_id} is in the ledger but its folder {ledger.runs_dir / run_id} is missing")
    return CheckedRun(ledger, run_id)


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


# -- checking a row --------------------------------------------------------------------------------------------------
class RowError(ValueError):
    """Why a row cannot be shown, in one line."""


@dataclass(frozen=True)
class Damaged:
    """A row that could not be read, in its place: what it is, and why (one line)."""

    what: str
    why: str
    id: str | None = None  # an episode's, whose page still shows what can be read of it


def one_line(text: object, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "…"


def decode(text: Any, limit: int = MAX_ROW_CHARS) -> Any:
    """A JSON column's value: text of at most ``limit`` characters, nested at most :data:`MAX_DEPTH` deep; else
    :class:`RowError`. The parse is linear, and stops at Python's recursion limit (a RecursionError, caught) before
    the depth is checked without recursion."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise RowError(f"a {type(text).__name__}, not JSON text")
    if len(text) > limit:
        raise RowError(f"{len(text)} characters, more than the {limit} a row may hold here")
    try:
        value = json.loads(text)
    except RecursionError:
        raise RowError(f"nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:
        raise RowError(f"not valid JSON ({one_line(getattr(exc, 'msg', str(exc)), 120)})") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise RowError(f"nested more than {MAX_DEPTH} deep")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


def typed(model: type[M], value: Any) -> M:
    """``value`` as ``model``, or :class:`RowError` naming the first field that does not fit."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise RowError(why(exc)) from None


def why(exc: Exception) -> str:
    """What is wrong with a row, in one line (a validation error: its first field and what it should be)."""
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return one_line(f"{where + ': ' if where else ''}{error['msg']}", 200)
    return one_line(exc)


# -- the rows the pages read, typed (an episode's: aitrainsai.EpisodeRow) ---------------------------------------------
class ProbeRow(BaseModel):
    attempt: int
    ok: bool
    seconds: float | None = None
    problems: list[str]


class RunRow(BaseModel):
    """One run as the index lists it."""

    id: str
    name: str | None = None
    status: str
    created_at: float | None = None
    steps: int = 0
    episodes: int = 0
    last_reward: float | None = None
    damaged: str | None = None  # why part of it could not be read (the row is still listed)


@dataclass(frozen=True)
class RunInfo:
    id: str
    name: str | None
    status: str
    created_at: Any
    config: dict[str, Any]


def _status(status: Any, run_dir: Path) -> str:
    """``running`` only while a process holds the run's lock; a killed runner leaves it ``interrupted``."""
    if not isinstance(status, str):
        return "?"
    return status if status != "running" else ("running" if run_is_live(run_dir) else "interrupted")


# a training episode's data without its turns (each up to a few MB), and the one thing collect() reads of them
_EPISODE_COLUMNS = """id, step, family, level, group_id, status, reward, created_at, updated_at,
    CASE WHEN json_valid(data) THEN json_remove(data, '$.turns') ELSE data END AS data,
    CASE WHEN json_valid(data) AND json_type(data, '$.turns') = 'array' THEN
      (SELECT json_extract(t.value, '$.meta.chosen') FROM json_each(data, '$.turns') AS t
       WHERE CASE WHEN t.type = 'object' THEN json_type(t.value, '$.meta.chosen') END = 'object' LIMIT 1)
    END AS chosen"""


class CheckedRun(Run):
    """A run as the viewer reads it: each row on its own, bounded and typed. What :func:`aitrainsai.collect` reads
    (events, episodes, jobs) leaves a damaged row out and names it in :attr:`damaged`; the pages' own reads return
    it as :class:`Damaged`, in its place."""

    def __init__(self, ledger: Ledger, run_id: str):
        super().__init__(ledger, run_id)
        self.damaged: dict[str, str] = {}  # what -> why, for the rows left out

    def _left_out(self, what: str, why: str) -> None:
        self.damaged.setdefault(what, why)

    def checked_info(self) -> RunInfo:
        row = self.db.one("SELECT id, name, status, created_at, config FROM runs WHERE id = ?", (self.id,))
        if row is None:
            raise RunNotFound(f"run {self.id} is no longer in {self.ledger.path}")
        try:
            config = decode(row["config"])
            if not isinstance(config, dict):
                raise RowError(f"a JSON {type(config).__name__}, not an object")
        except RowError as exc:
            self._left_out("the run's config", str(exc))
            config = {}
        name = row["name"] if isinstance(row["name"], str) else None
        return RunInfo(id=self.id, name=name, status=_status(row["status"], self.dir), created_at=row["created_at"],
                       config=config)

    # -- what collect() reads ----------------------------------------------------------------------------------
    def records(self, kind: type[Any]) -> list[Any]:
        if kind is BackendEvent:  # open kinds: never read by the viewer
            return super().records(kind)
        found = []
        for row in self.db.rows("SELECT seq, kind, data FROM events WHERE run_id = ? AND kind = ? ORDER BY seq",
                                (self.id, kind.KIND)):
            try:
                data = decode(row["data"])
                found.append(typed(kind, {**data, "kind": row["kind"]} if isinstance(data, dict) else data))
            except RowError as exc:
                self._left_out(f"{kind.KIND} event {row['seq']}", str(exc))
        return found

    def episodes(self, group_id: str | None = None) -> list[EpisodeRow]:
        return [row for row in self.episode_rows(group_id) if isinstance(row, EpisodeRow)]

    def episode(self, episode_id: str) -> EpisodeRow | None:
        row = self.episode_row(episode_id)
        return row if isinstance(row, EpisodeRow) else None

    def jobs(self, state: JobState | None = None) -> list[Job]:
        found = []
        for row in self.db.rows("SELECT id FROM jobs WHERE run_id = ? ORDER BY created_at", (self.id,)):
            try:
                job = self.job(row["id"])
            except (LedgerError, ValidationError, RecursionError, TypeError, ValueError) as exc:
                self._left_out(f"job {one_line(row['id'], 100)}", why(exc))
            else:
                if job is not None and (state is None or job.state is state):
                    found.append(job)
        return found

    def groups(self) -> dict[str, Any]:
        try:
            return super().groups()
        except (TypeError, ValueError) as exc:  # an episode's group or family of another type
            self._left_out("the run's groups", one_line(f"{type(exc).__name__}: {exc}"))
            return {}

    def agent_prompts(self) -> dict[str, AgentPrompt]:
        return {}  # no page shows them: not read

    # -- what the pages read --------------------------------------------------------------------------------------
    def episode_rows(self, group_id: str | None = None) -> list[EpisodeRow | Damaged]:
        """The run's episodes (one group's, with ``group_id``), oldest first, each typed or :class:`Damaged`."""
        query = f"SELECT {_EPISODE_COLUMNS} FROM episodes WHERE run_id = ?" + (" AND group_id = ?" if group_id else "")
        rows = self.db.rows(query + " ORDER BY created_at, id", (self.id, group_id) if group_id else (self.id,))
        return [self._episode(row) for row in rows]

    def episode_row(self, episode_id: str) -> EpisodeRow | Damaged | None:
        row = self.db.one(f"SELECT {_EPISODE_COLUMNS} FROM episodes WHERE run_id = ? AND id = ?",
                          (self.id, episode_id))
        return None if row is None else self._episode(row)

    def _episode(self, row: Any) -> EpisodeRow | Damaged:
        what = f"episode {one_line(str(row['id']), 100)}"
        try:
            data = decode(row["data"])
            if not isinstance(data, dict):
                raise RowError(f"its data is a JSON {type(data).__name__}, not an object")
            chosen = decode(row["chosen"]) if row["chosen"] is not None else None
            # the turns are not loaded: only the one that holds what collect() reads of them
            turns = [{"message": {"role": "assistant"}, "meta": {"chosen": chosen}}] if chosen is not None else []
            return typed(EpisodeRow, {**{k: row[k] for k in row.keys() if k != "chosen"},
                                      "data": {**data, "turns": turns}})
        except RowError as exc:
            self._left_out(what, str(exc))
            return Damaged(what, str(exc), row["id"] if isinstance(row["id"], str) else None)

    def probe_rows(self, episode_id: str) -> list[ProbeRow | Damaged]:
        found: list[ProbeRow | Damaged] = []
        for row in self.db.rows("SELECT attempt, ok, seconds, problems FROM probes WHERE run_id = ? AND "
                                "episode_id = ? ORDER BY created_at, attempt", (self.id, episode_id)):
            try:
                found.append(typed(ProbeRow, {**dict(row), "problems": decode(row["problems"])}))
            except RowError as exc:
                found.append(Damaged(f"probe attempt {one_line(str(row['attempt']), 40)}", str(exc)))
        return found

    def message_count(self, episode_id: str) -> tuple[int, Any]:
        """How many messages the episode's transcript holds, and when the last was written."""
        row = self.db.one("SELECT COUNT(*), MAX(created_at) FROM messages WHERE run_id = ? AND episode_id = ?",
                          (self.id, episode_id))
        return (int(row[0]), row[1]) if row is not None else (0, None)

    def messages(self, episode_id: str, offset: int, limit: int) -> list[StoredMessage]:
        """A page of an episode's transcript, in order: each message decoded, or (longer than
        :data:`MESSAGE_CHARS`) the start of its stored text, or :class:`Damaged`."""
        rows = self.db.rows(f"""
            SELECT seq, length(message) AS chars,
                   CASE WHEN length(message) > {MESSAGE_CHARS} THEN substr(message, 1, {PREVIEW_CHARS})
                        ELSE message END AS message
            FROM messages WHERE run_id = ? AND episode_id = ? ORDER BY seq LIMIT ? OFFSET ?""",
                            (self.id, episode_id, limit, offset))
        found = []
        for row in rows:
            chars = row["chars"] if isinstance(row["chars"], int) else 0
            if chars > MESSAGE_CHARS:
                text = row["message"]
                preview = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)
                found.append(StoredMessage(row["seq"], chars, None, preview))
                continue
            try:
                found.append(StoredMessage(row["seq"], chars, decode(row["message"]), None))
            except RowError as exc:
                found.append(StoredMessage(row["seq"], chars, Damaged(f"message {row['seq']}", str(exc)), None))
        return found

    def message_text(self, episode_id: str, seq: int) -> str | None:
        """One stored message as the ledger holds it (JSON), at most :data:`RAW_CHARS` of it; None: no such one."""
        row = self.db.one(f"SELECT substr(message, 1, {RAW_CHARS}) AS text, length(message) AS chars FROM messages "
                          "WHERE run_id = ? AND episode_id = ? AND seq = ?", (self.id, episode_id, seq))
        if row is None:
            return None
        text = row["text"]
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)
        more = (row["chars"] or 0) - len(text)
        return text + (f"\n[{more} more characters not served]" if more > 0 else "")


@dataclass(frozen=True)
class StoredMessage:
    """One row of a transcript: ``value`` decoded (any JSON; the page checks its shape) or :class:`Damaged`, or None
    with ``preview`` the start of its stored text (a message too long to decode on a page)."""

    seq: Any
    chars: int
    value: Any
    preview: str | None


def run_count(ledger: Ledger) -> int:
    row = ledger.db.one("SELECT COUNT(*) FROM runs")
    return int(row[0]) if row is not None else 0


def run_rows(ledger: Ledger, offset: int, limit: int) -> list[RunRow | Damaged]:
    """The runs, newest first, a page of them: each as the index lists it, a damaged one marked (or, where not even
    its id can be read, :class:`Damaged`)."""
    rows = ledger.db.rows("SELECT id, name, status, created_at FROM runs ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
                          (limit, offset))
    return [_run_row(ledger, row) for row in rows]


def _run_row(ledger: Ledger, row: Any) -> RunRow | Damaged:
    run_id = row["id"]
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        return Damaged(f"run {one_line(repr(run_id), 100)}", "its id is not a run's id (one plain folder name)")
    counts = ledger.db.one("SELECT (SELECT COUNT(*) FROM events WHERE run_id = ? AND kind = 'outer_step'), "
                           "(SELECT COUNT(*) FROM episodes WHERE run_id = ?)", (run_id, run_id))
    steps, episodes = (int(counts[0]), int(counts[1])) if counts is not None else (0, 0)
    problems = []
    last = None
    latest = ledger.db.one("SELECT seq, data FROM events WHERE run_id = ? AND kind = 'outer_step' ORDER BY seq DESC "
                           "LIMIT 1", (run_id,))
    if latest is not None:
        try:
            data = decode(latest["data"])
            last = typed(OuterStep, {**data, "kind": OuterStep.KIND} if isinstance(data, dict) else data).mean_reward
        except RowError as exc:
            problems.append(f"its last outer step (event {latest['seq']}): {exc}")
    folder = ledger.runs_dir / run_id
    if not folder.is_dir():
        problems.append(f"its folder {folder} is missing")
    fields = {"id": run_id, "name": row["name"] if isinstance(row["name"], str) else None,
              "status": _status(row["status"], folder), "steps": steps, "episodes": episodes, "last_reward": last}
    created = row["created_at"]
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        fields["created_at"] = created
    elif created is not None:
        problems.append(f"its created_at is {one_line(repr(created), 60)}, not a time")
    return RunRow(**fields, damaged="; ".join(problems) or None)


# -- an accepted job's files -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobFile:
    name: str  # relative to the job's folder, with "/"
    size: int | None  # None: not a regular file (``problem`` says what)
    problem: str | None = None


def list_job(folder: Path) -> tuple[list[JobFile], list[str]]:
    """A frozen job's files, by name (at most :data:`MAX_LISTED`), walked by file descriptor without following a
    link; dot files and ``eval`` folders are left out. And notes on what was left out."""
    files: list[JobFile] = []
    notes: list[str] = []
    for top, dirs, names, top_fd in os.fwalk(folder, follow_symlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "eval")
        relative_top = Path(top).relative_to(folder)
        for name in sorted(names):
            if name.startswith("."):
                continue
            if len(files) >= MAX_LISTED:
                notes.append(f"more than {MAX_LISTED} files: the rest are not listed")
                return sorted(files, key=lambda f: f.name), notes
            relative = (relative_top / name).as_posix()
            try:
                info = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            except OSError as exc:
                files.append(JobFile(relative, None, f"unreadable ({exc.strerror})"))
                continue
            if stat.S_ISREG(info.st_mode):
                files.append(JobFile(relative, info.st_size))
            else:
                files.append(JobFile(relative, None, "a link" if stat.S_ISLNK(info.st_mode) else
                                     "not a regular file"))
    return sorted(files, key=lambda f: f.name), notes


def read_job_file(folder: Path, name: str, limit: int) -> bytes:
    """The first ``limit`` bytes of the job file ``name`` (one of :func:`list_job`'s), opened one component at a time
    from the job's folder, none of them a link; OSError if it is not there as a regular file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    *folders, last = name.split("/")
    fd = os.open(folder, flags | os.O_DIRECTORY)
    try:
        for part in folders:
            inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        file_fd = os.open(last, flags, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(f"{name} is not a regular file")
        return handle.read(limit)


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
