"""The ``tensorboard`` tracker: a run's points as TensorBoard event files, one TensorBoard run (folder) per axis.

Layout: ``<root>/step``, ``<root>/episode``, ``<root>/job``, ``<root>/eval-<family>``; in each, one event file per
process that wrote to it, each point one event at step ``point.x`` (wall time ``point.at``) holding its
:meth:`~aitrainsai.trackers.Point.scalars` as scalars (``simple_value``) under their names (``reward``,
``component/validation``, ``update/loss``). The step folder also holds the run's config (and plugin versions) as
text at step 0, written by the process that finds the step folder empty. A value a float32 cannot hold is left out,
never written as inf: a point whose record named values that are not finite (``Point.nonfinite``), or held one beyond
a float32's range, has a text ``nonfinite`` at its step naming them.

Replayed points are replaced, not duplicated, by TensorBoard's own restart rule: every event file this tracker opens
starts with a ``SessionLog.START`` event at the step of the first point it writes, and TensorBoard's Python readers
drop the events that earlier files in that folder hold at that step or later (the Rust data server drops a series'
points at or after each new point's step, which the same replay triggers). A process opens an axis's file lazily, at
its first point there, so after a kill the points fed again replace the ones the killed process wrote. New file
names sort after every file already in the folder: the readers read a folder's files in name order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from aitrainsai import ComponentConfig, EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker

CONFIG_STEP = 0  # the step the config text is written at, in the step folder
FLOAT32_MAX = 3.4028234663852886e38  # a simple_value is a float32: a double beyond this would read back as inf
NONFINITE_TAG = "nonfinite"  # the text, at a point's step, naming the values left out of it
FILE_PREFIX = "events.out.tfevents."
_STAMP = re.compile(re.escape(FILE_PREFIX) + r"(\d+)\.")


class TensorBoardConfig(ComponentConfig):
    logdir: str | None = Field(
        None, description="write under LOGDIR/<run_id>/ (a relative path is taken from the run's folder) instead of "
                          "the run's trackers/tensorboard/; point `tensorboard --logdir` at LOGDIR to compare runs")


def axis_folder(axis: str) -> str:
    """The folder (TensorBoard run) of an axis: ``eval/arith`` -> ``eval-arith``."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", axis.replace("/", "-"))


def _file_name(folder: Path) -> str:
    """A new event file's name, sorting after every event file already in ``folder`` (readers go in name order)."""
    stamps = [int(m.group(1)) for p in folder.iterdir() if (m := _STAMP.match(p.name))]
    stamp = max([int(time.time()), *(s + 1 for s in stamps)])
    return f"{FILE_PREFIX}{stamp:010d}.{socket.gethostname()}.{os.getpid()}.aitrainsai"


class _EventFile:
    """One event file, written synchronously: the file version, a START at ``purge_step``, then what is added."""

    def __init__(self, folder: Path, purge_step: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / _file_name(folder)
        self._file = open(self.path, "xb")  # never another writer's file
        self._records = RecordWriter(self._file)
        self.last = purge_step - 1  # the newest point's step
        now = time.time()
        self.add(event_pb2.Event(wall_time=now, file_version="brain.Event:2"))
        self.add(event_pb2.Event(wall_time=now, step=purge_step,
                                 session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def scalars(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(wall_time=wall_time, step=step)
        for tag, value in values.items():  # simple_value: every reader takes it, and each purges it on a START
            event.summary.value.add(tag=tag, simple_value=value)
        self.add(event)

    def text(self, step: int, wall_time: float, values: dict[str, str]) -> None:
        import numpy as np
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.text import metadata
        from tensorboard.util import tensor_util

        event = event_pb2.Event(wall_time=wall_time, step=step)
        for tag, value in values.items():
            event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(np.array(value, dtype=np.object_)),
                                    metadata=metadata.create_summary_metadata(display_name=None, description=None))
        self.add(event)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``run_dir/trackers/tensorboard`` (or ``logdir/<run_id>``)."""

    name = "tensorboard"
    description = "TensorBoard event files: a folder per axis (step, episode, job, eval-<family>), the config as text"
    Config = TensorBoardConfig
    config: TensorBoardConfig

    def __init__(self, config: ComponentConfig | None = None, *, run_dir: Path):
        super().__init__(config, run_dir=run_dir)
        self._files: dict[str, _EventFile] = {}
        self._run: TrackedRun | None = None
        self._root: Path | None = None

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        problems = []
        if importlib.util.find_spec("tensorboard") is None:
            problems.append("the tensorboard package is not installed (pip install tensorboard==2.21.0)")
        logdir = getattr(config, "logdir", None)
        if logdir is not None:
            path = Path(logdir).expanduser()
            if not logdir.strip():
                problems.append("logdir is empty: leave it out to write under the run's folder")
            elif path.is_absolute():
                existing = next((p for p in (path, *path.parents) if p.exists()), None)
                if existing is not None and not existing.is_dir():
                    problems.append(f"logdir {logdir!r} cannot be a folder: {existing} is a file")
        return problems

    def root(self, run_id: str) -> Path:
        """Where the axis folders go."""
        logdir = self.config.logdir
        if logdir is None:
            return self.folder
        return (self.run_dir / Path(logdir).expanduser()) / run_id  # an absolute logdir replaces run_dir

    def start(self, run: TrackedRun) -> None:
        self._run = run
        self._root = self.root(run.run_id)
        self._root.mkdir(parents=True, exist_ok=True)
        step_folder = self._root / axis_folder("step")
        if not (step_folder.is_dir() and any(_STAMP.match(p.name) for p in step_folder.iterdir())):
            self._open("step", CONFIG_STEP)  # writes the config; a store that has a step file has it already
            self._files["step"].flush()

    def log(self, points: list[StepPoint | EpisodePoint | JobPoint | EvalPoint]) -> None:
        touched: dict[str, _EventFile] = {}
        for point in points:
            file = self._files.get(point.axis)
            if file is None or point.x <= file.last:  # a point fed again: a new file replaces from it on
                file = self._open(point.axis, point.x)
            values = point.scalars()
            left_out = {f"{name}: {kind}" for name, kind in point.nonfinite.items()}
            left_out |= {f"{name}: {value:g} (beyond a float32)" for name, value in values.items()
                         if abs(value) > FLOAT32_MAX}
            values = {name: value for name, value in values.items() if abs(value) <= FLOAT32_MAX}
            if values:
                file.scalars(point.x, point.at or time.time(), values)
            if left_out:
                file.text(point.x, point.at or time.time(), {NONFINITE_TAG: "\n".join(sorted(left_out))})
            file.last = point.x
            touched[point.axis] = file
        for file in touched.values():
            file.flush()

    def finish(self, end: RunEnd) -> None:
        for file in self._files.values():
            file.flush()

    def close(self) -> None:
        files, self._files = list(self._files.values()), {}
        for file in files:
            file.close()

    def _open(self, axis: str, purge_step: int) -> _EventFile:
        if self._root is None:
            raise RuntimeError("log before start")
        old = self._files.pop(axis, None)
        if old is not None:
            old.close()
        file = self._files[axis] = _EventFile(self._root / axis_folder(axis), purge_step)
        if axis == "step" and purge_step <= CONFIG_STEP and self._run is not None:
            file.text(CONFIG_STEP, time.time(), self._texts(self._run))  # the START just dropped any earlier copy
        return file

    @staticmethod
    def _texts(run: TrackedRun) -> dict[str, str]:
        texts = {"config": _markdown_code(json.dumps(run.config, indent=2, sort_keys=True, default=str))}
        if run.plugins:
            texts["plugins"] = "\n".join(f"- {name} {version}" for name, version in sorted(run.plugins.items()))
        return texts
