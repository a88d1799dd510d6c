"""The ``wandb`` tracker: one Weights & Biases run per aitrainsai run, written as offline run files by default.

Each point is one history row ``{"<axis>/x": x, "<axis>/<name>": value, ...}`` (:meth:`Point.scalars`), and every
axis is charted against its own x (``define_metric("<axis>/*", step_metric="<axis>/x")``). wandb's ``_step`` counts
rows across all processes of the run: a resumed process goes on after the highest ``_step`` its earlier files hold,
so the run's files read as one history (offline, wandb itself would start again from 0).

Write-through: wandb's service (``wandb-core``) buffers the run's ``.wandb`` file and writes it every 15 s by default;
a killed run loses what it had not written. The tracker asks for a write every ``FLUSH_S`` and :meth:`log` returns
only when its rows are in the file (read back from the file's tail).

Resume: before reopening the run, the tracker reads every ``.wandb`` file the run already has in its folder with
wandb's own reader (``wandb-core leet inspect --json``, what ``wandb leet inspect`` runs) and, online, the summary the
server returns; per axis it keeps the highest x found and drops any point at or below it, so a point written just
before a kill and fed again is not written twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from aitrainsai import ComponentConfig, EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker

FLUSH_S = 0.1  # how often wandb-core writes the run's file (its x_transaction_log_flush_interval; default 15 s)
WRITE_WAIT_S = 60.0  # the longest log() waits for its rows to reach the file
READ_TIMEOUT_S = 300.0  # the longest one earlier file may take to read back
# Offline, while the run opens (when wandb reads its settings and starts its service): no sends of any kind.
OFFLINE_ENV: dict[str, str | None] = {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}


class WandbConfig(ComponentConfig):
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: run files only, nothing sent (upload later with `wandb sync`); online: "
                               "streamed to W&B as well (needs WANDB_API_KEY or a `wandb login`)")
    project: str = Field("aitrainsai", description="the W&B project")
    entity: str | None = Field(None, description="the W&B entity (user or team); default: the account's own")
    dir: Path | None = Field(None, description="where wandb keeps its files (default: <run>/trackers/wandb)")


def wandb_id(run_id: str) -> str:
    """The W&B run id for an aitrainsai run id: itself when it is made of letters, digits, ``-`` and ``_`` (a
    run id the core makes, ``20260101-120000-ab12``, is); otherwise the other characters become ``-`` and a short
    hash of the original keeps two such ids apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:48]
    if safe == run_id:
        return safe
    return f"{safe}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


class WandbTracker(Tracker):
    """Logs a run's points to one W&B run (``wandb_id(run_id)``, named after the run), offline by default; a resumed
    run reopens it (``resume="allow"``) and drops a point whose ``(axis, x)`` the run already holds."""

    name = "wandb"
    description = "one Weights & Biases run per aitrainsai run (offline run files by default)"
    Config = WandbConfig
    config: WandbConfig

    def __init__(self, config: ComponentConfig | None = None, *, run_dir: Path):
        super().__init__(config, run_dir=run_dir)
        self.dir = Path(self.config.dir) if self.config.dir is not None else self.folder
        self.wandb_id: str | None = None
        self.file: Path | None = None  # this process's .wandb file
        self.written: dict[str, int] = {}  # axis -> the highest x the W&B run holds (or will, once flushed)
        self._run: Any = None
        self._step = 0  # the next history row's _step
        self._axes: set[str] = set()  # axes whose metrics this process has defined
        self._tail: _Tail | None = None
        self._started = False
        self._finished = False

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        assert isinstance(config, WandbConfig)
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            return [f"wandb cannot be imported ({exc}); install aitrainsai-tracker-wandb"]
        problems = []
        if config.mode == "online" and not _has_credentials():
            problems.append("mode = \"online\" needs W&B credentials: set WANDB_API_KEY or run `wandb login` "
                            "(or use mode = \"offline\" and `wandb sync` later)")
        if config.dir is not None and config.dir.exists() and not config.dir.is_dir():
            problems.append(f"dir {config.dir} is a file, not a folder")
        return problems

    # -- the contract ----------------------------------------------------------------------------------------------
    def start(self, run: TrackedRun) -> None:
        import wandb

        self._started = True
        self.dir.mkdir(parents=True, exist_ok=True)
        # the folder takes files (wandb would fall back to the system temp folder with a warning)
        tempfile.TemporaryFile(dir=self.dir).close()
        self.wandb_id = wandb_id(run.run_id)
        for earlier in self._files():
            self._read_back(earlier)
        settings = wandb.Settings(
            mode=self.config.mode, reinit="create_new", silent=True, console="off", symlink=False,
            disable_code=True, save_code=False, disable_git=True, disable_job_creation=True, label_disable=True,
            sagemaker_disable=True, x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
            x_save_requirements=False, x_transaction_log_flush_interval=FLUSH_S)
        config = {**run.config, "aitrainsai": {"run_id": run.run_id, "plugins": run.plugins,
                                               "created_at": run.created_at}}
        # A service of our own (not one a parent process advertises in WANDB_SERVICE), its log kept with the run's
        # files (not in ~/.cache/wandb/logs); the run's process gets its environment back after.
        environ: dict[str, str | None] = {"WANDB_SERVICE": None, "WANDB_CACHE_DIR": str(self.dir / "service")}
        if self.config.mode == "offline":
            environ |= OFFLINE_ENV
        with _environ(environ), _process_hooks_kept():
            self._run = wandb.init(project=self.config.project, entity=self.config.entity, dir=str(self.dir),
                                   id=self.wandb_id, name=run.name or run.run_id, config=config, resume="allow",
                                   settings=settings)
        self.file = Path(self._run.settings.sync_file)
        if not self.file.resolve().is_relative_to(self.dir.resolve()):
            raise RuntimeError(f"wandb writes the run to {self.file}, not under {self.dir}")
        self._tail = _Tail(self.file)
        # Online, the server's summary holds each axis's last x and the run's next _step.
        for key, value in dict(self._run.summary).items():
            if key.endswith("/x") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._high(key[:-2], int(value))
        self._step = max(self._step, int(self._run.step or 0))

    def log(self, points: list[StepPoint | EpisodePoint | JobPoint | EvalPoint]) -> None:
        run = self._open_run()
        logged: dict[str, int] = {}
        for point in points:
            if point.x <= self.written.get(point.axis, point.x - 1):
                continue  # the W&B run has it already (written before a kill, fed again)
            if point.axis not in self._axes:
                run.define_metric(f"{point.axis}/x")
                run.define_metric(f"{point.axis}/*", step_metric=f"{point.axis}/x")
                self._axes.add(point.axis)
            row: dict[str, Any] = {f"{point.axis}/{name}": value for name, value in point.scalars().items()}
            row[f"{point.axis}/x"] = point.x
            run.log(row, step=self._step, commit=True)  # with a step given, wandb commits a row only when told
            self._step += 1
            self.written[point.axis] = logged[point.axis] = point.x
        if logged:
            self._wait_written(logged)

    def finish(self, end: RunEnd) -> None:
        run = self._open_run()
        run.summary.update({"aitrainsai/status": end.status, "aitrainsai/reason": end.reason or "",
                            "aitrainsai/steps": end.steps})
        self._finished = True
        run.finish(exit_code=0 if end.status == "finished" else 1)

    def close(self) -> None:
        if not self._started:
            return
        import wandb

        try:
            if self._run is not None and not self._finished:
                self._finished = True
                self._run.finish(exit_code=1)  # the run did not end here: marked failed until a resume
        finally:
            try:
                wandb.teardown()  # stops wandb-core and waits for it
            except SystemExit as exc:  # teardown exits when the service did; never the run's thread
                raise RuntimeError(f"wandb's service ended with code {exc.code}") from None
            self._run = None

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _open_run(self) -> Any:
        if self._run is None or self._finished:
            raise RuntimeError("the wandb tracker has no open run (not started, finished or closed)")
        return self._run

    def _high(self, axis: str, x: int) -> None:
        self.written[axis] = max(x, self.written.get(axis, x))

    def _files(self) -> list[Path]:
        """The run's .wandb files already in the folder, one per earlier process."""
        return sorted({path.resolve() for path in (self.dir / "wandb").glob(f"*/run-{self.wandb_id}.wandb")})

    def _read_back(self, path: Path) -> None:
        """Learns, from an earlier process's file, each axis's highest x and the highest ``_step``, with wandb's
        own reader (it reads a file cut short by a kill up to its last whole record)."""
        for record in read_records(path):
            if record.get("type") != "history":
                continue
            item = record["history"].get("item") or {}
            for key, value in item.items():
                if key.endswith("/x") and isinstance(value, (int, float)):
                    self._high(key[:-2], int(value))
            if isinstance(item.get("_step"), (int, float)):
                self._step = max(self._step, int(item["_step"]) + 1)

    def _wait_written(self, targets: dict[str, int]) -> None:
        """Returns once this process's file holds, for each axis, a row with x at or above ``targets[axis]``."""
        assert self._tail is not None
        deadline = time.monotonic() + WRITE_WAIT_S
        while True:
            on_disk = self._tail.read()
            if all(on_disk.get(axis, x - 1) >= x for axis, x in targets.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"wandb did not write the run's rows to {self.file} within {WRITE_WAIT_S:.0f} s")
            time.sleep(FLUSH_S / 4)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` file as wandb's reader prints it (``wandb leet inspect --json``: one JSON object
    a record; a history row is ``{"type": "history", "history": {"item": {key: value, ...}}}``)."""
    from wandb.util import get_core_path

    done = subprocess.run(
        [get_core_path(), "leet", "inspect", "--json", "--no-observability", "--run-file", str(path),
         str(path.parent.parent)],
        capture_output=True, text=True, timeout=READ_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wandb could not read {path}: {done.stderr.strip()[-300:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


class _Tail:
    """Follows the history rows that reach one ``.wandb`` file: a leveldb-style log (a 7-byte ``:W&B`` header, then
    32 KiB blocks of chunks ``crc32 | length | type | data``) of wandb's ``Record`` protobufs. Reads only what was
    added since the last call; keeps each axis's highest ``<axis>/x``."""

    HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    BLOCK = 32768
    FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0  # where the next unread chunk starts
        self.partial = b""  # a record's chunks so far, when it spans blocks
        self.high: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return self.high
        pos = 0
        if self.offset == 0:
            if len(data) < len(self.HEADER):
                return self.high
            if data[:len(self.HEADER)] != self.HEADER:
                raise RuntimeError(f"{self.path} is not a .wandb file of the version this tracker reads")
            pos = len(self.HEADER)
        for chunk in self._chunks(data, pos):
            self._record(chunk)
        return self.high

    def _chunks(self, data: bytes, pos: int) -> Iterator[bytes]:
        while True:
            left = self.BLOCK - (self.offset + pos) % self.BLOCK
            if left < 7:  # a block's tail too short for a chunk is padding
                if len(data) - pos < left:
                    break
                pos += left
                continue
            if len(data) - pos < 7:
                break
            crc, length, kind = struct.unpack_from("<IHB", data, pos)
            body = data[pos + 7:pos + 7 + length]
            if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
                break  # not (all) written yet
            pos += 7 + length
            if kind == self.FULL:
                yield body
            elif kind == self.FIRST:
                self.partial = body
            elif kind == self.MIDDLE:
                self.partial += body
            elif kind == self.LAST:
                yield self.partial + body
                self.partial = b""
        self.offset += pos

    def _record(self, chunk: bytes) -> None:
        from wandb.proto import wandb_internal_pb2

        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") != "history":
            return
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.endswith("/x"):
                continue
            kind = item.WhichOneof("value")
            value = getattr(item, kind) if kind else json.loads(item.value_json or "null")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                axis = key[:-2]
                self.high[axis] = max(int(value), self.high.get(axis, int(value)))


def _has_credentials() -> bool:
    """Whether wandb would find an account without asking: the environment or a netrc entry for the host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    from wandb.sdk.lib import wbauth

    try:
        return bool(wbauth.read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"))
    except Exception:  # noqa: BLE001 - an unreadable netrc is no login
        return False


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """Sets (or, for None, removes) environment variables for the block, then puts back what was there."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            _set_env(key, value)
        yield
    finally:
        for key, value in saved.items():
            _set_env(key, value)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


@contextlib.contextmanager
def _process_hooks_kept() -> Iterator[None]:
    """wandb's service start replaces ``sys.exit`` and ``sys.excepthook`` for good; the run keeps its own."""
    saved = sys.exit, sys.excepthook
    try:
        yield
    finally:
        sys.exit, sys.excepthook = saved
