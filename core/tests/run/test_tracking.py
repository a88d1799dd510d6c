"""The built-in JSON-lines tracker through the conformance kit (the feed from a ledger: tests/test_loop.py)."""

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from aitrainsai import AnyPoint
from aitrainsai.builtin.jsonl_tracker import JsonlTracker
from aitrainsai.testing import TrackerConformance

POINT = TypeAdapter(AnyPoint)


class TestJsonlTracker(TrackerConformance):
    tracker = JsonlTracker
    distribution = "aitrainsai"

    def read_back(self, run_dir: Path, options: dict[str, Any]):
        rows = []
        for line in (run_dir / "trackers" / "jsonl" / "points.jsonl").read_text().splitlines():
            data = json.loads(line)
            if data["kind"] not in ("start", "end"):
                point = POINT.validate_python(data)
                rows += [(point.axis, name, point.x, value) for name, value in point.scalars().items()]
        return rows
