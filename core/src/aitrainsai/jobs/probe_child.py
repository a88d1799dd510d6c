"""The probe's run of ``build()``, inside the sandbox: ``python -I -m aitrainsai.jobs.probe_child``.

It imports the job's ``dataset.py`` from ``/tmp/job``, calls ``build()`` once and writes the rows, one JSON object
per line, to ``/tmp/out/dataset.jsonl``; where the job's code fails it writes ``/tmp/out/problems.json`` (file, line
and message from the traceback). Both are data for the trusted side, which parses and checks them itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(os.environ.get("AITRAINSAI_OUT_DIR", "/tmp/out"))
JOB = Path(os.environ.get("AITRAINSAI_JOB_DIR", "/tmp/job"))  # where the sandbox shows the job


def main() -> None:
    me = os.getpid()
    sys.path.insert(0, str(JOB))
    problems: list[dict] = []
    try:
        import dataset  # the job's dataset.py

        rows = dataset.build()
        if not isinstance(rows, list):
            problems.append({"file": "dataset.py", "message": f"build() must return a list of dicts, not "
                                                              f"{type(rows).__name__}"})
        else:
            _write(rows, problems)
    except BaseException as exc:  # report whatever the job's code raised
        problems.append(_problem(exc))
    if problems and os.getpid() == me:  # not from processes the job forked
        (OUT / "problems.json").write_text(json.dumps(problems))


def _write(rows: list, problems: list[dict]) -> None:
    with open(OUT / "dataset.jsonl", "w") as handle:
        for index, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
                problems.append({"file": "dataset.py", "message": (
                    f"row {index} must be a dict with 'question' (str), 'answer' and 'world' (dict); "
                    f"got {str(row)[:120]}")})
                return
            try:
                line = json.dumps({"question": row["question"], "answer": str(row["answer"]),
                                   "world": row.get("world", {})}, sort_keys=True)
            except (TypeError, ValueError) as exc:
                problems.append({"file": "dataset.py", "message": f"row {index} is not JSON-serialisable: {exc}"})
                return
            handle.write(line + "\n")


def _problem(exc: BaseException) -> dict:
    from aitrainsai.jobs.env_server import error_location

    file, line = error_location(exc, JOB)
    return {"file": file or "dataset.py", "line": line, "message": f"{type(exc).__name__}: {exc}"[:2000]}


if __name__ == "__main__":
    main()
