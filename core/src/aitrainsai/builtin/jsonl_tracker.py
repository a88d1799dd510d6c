"""The built-in tracker: every point as one JSON line, for scripts and for a look with ``jq`` (no dependency)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from aitrainsai import hookimpl
from aitrainsai.components import ComponentConfig
from aitrainsai.trackers import RunEnd, TrackedRun, Tracker

MAX_LINE = 1_000_000  # a line longer than this was not written by this tracker: not read back


class JsonlConfig(ComponentConfig):
    path: Path | None = Field(None, description="the file (default: <run>/trackers/jsonl/points.jsonl)")


class JsonlTracker(Tracker):
    """Appends each point (``{"kind", "axis", "x", ...}``), the start and the end to a JSON-lines file, strict JSON
    (a value that is not finite is ``null``, named in the point's ``nonfinite``). A resumed run appends to the same
    file, skipping a point whose ``(axis, x)`` the file already holds."""

    name = "jsonl"
    Config = JsonlConfig
    config: JsonlConfig

    def __init__(self, config: ComponentConfig | None = None, *, run_dir: Path):
        super().__init__(config, run_dir=run_dir)
        self.path = self.config.path or self.folder / "points.jsonl"
        self._seen: set[tuple[str, int]] = set()
        self._file: Any = None

    def start(self, run: TrackedRun) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if run.resumed and self.path.exists():
            with self.path.open("rb") as lines:
                for line in lines:
                    if len(line) > MAX_LINE:
                        continue
                    try:
                        point = json.loads(line)
                        self._seen.add((str(point["axis"]), int(point["x"])))
                    except (ValueError, KeyError, TypeError):
                        continue  # a start or end line, or one cut short by a kill
        self._file = self.path.open("a", encoding="utf-8")
        self._write({"kind": "start", **run.model_dump(mode="json", exclude={"config"})})

    def log(self, points: list[Any]) -> None:
        for point in points:
            key = (point.axis, point.x)
            if key not in self._seen:
                self._seen.add(key)
                self._write(point.model_dump(mode="json"), flush=False)
        self._file.flush()

    def finish(self, end: RunEnd) -> None:
        self._write({"kind": "end", **end.model_dump(mode="json")})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, data: dict[str, Any], flush: bool = True) -> None:
        self._file.write(json.dumps(data, allow_nan=False) + "\n")  # strict JSON: the records hold finite numbers
        if flush:
            self._file.flush()


@hookimpl
def register_trackers(register):
    register(JsonlTracker)
