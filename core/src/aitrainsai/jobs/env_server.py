"""A job's verifiers environment (classic, or a v1 taskset), served inside the sandbox:
``python -I -m aitrainsai.jobs.env_server``.

It reads one JSON request per line on stdin and writes one JSON answer per line on stdout (agent code's own prints
go to stderr). The trusted side (:class:`aitrainsai.jobs.remote_env.RemoteEnvironment`) treats every answer as untrusted
data: the job's code runs in this process and may answer anything, so an answer only ever tells what the job's
environment does, never a verdict.

Methods: ``load`` (the environment's interface and row count), ``rows`` (a page of training rows), ``start`` (a
rollout's state, from a row index or a given row), ``tool`` (run a tool call of a rollout), ``score`` (the rubric's
reward for a rollout's completion; the rollout's state is dropped), ``reward_errors``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any
from collections.abc import Callable

from aitrainsai.jobs.format import V1_VARIABLE, job_format

JOB = Path(os.environ.get("AITRAINSAI_JOB_DIR", "/tmp/job"))  # where the sandbox shows the job
MAX_STATES = 4_096


class Server:
    def __init__(self, job: Path):
        self.job = job
        self.env: Any = None  # the job's JobEnvironment, once loaded
        self.rows: list[dict[str, Any]] = []
        self.states: dict[int, tuple[dict, Any]] = {}
        self.next_state = 0

    def load(self) -> dict[str, Any]:
        if job_format(os.listdir(self.job)) == "verifiers-v1":
            from aitrainsai.jobs.taskset_env import JobTaskset

            self.env = JobTaskset(self.job)
        else:
            from aitrainsai.jobs.verifiers_env import JobEnvironment

            self.env = JobEnvironment(self.job)
        self.rows = [_plain(row) for row in self.env.rows()]
        return {"system_prompt": self.env.system_prompt, "max_turns": self.env.max_turns,
                "tool_names": self.env.tool_names(), "tool_schemas": self.env.tool_schemas(), "rows": len(self.rows),
                "reward_funcs": self.env.reward_funcs()}

    def page(self, start: int, count: int) -> list[dict[str, Any]]:
        return [{"prompt": row["prompt"], "answer": str(row.get("answer", "")), "info": row.get("info")}
                for row in self.rows[start:start + count]]

    def start(self, row: int | None = None, row_data: dict | None = None) -> int:
        if len(self.states) >= MAX_STATES:
            raise RuntimeError(f"more than {MAX_STATES} rollouts open at once")
        data = self.rows[row] if row is not None else dict(row_data or {})
        state_id = self.next_state
        self.next_state += 1
        self.states[state_id] = (data, self.env.new_state(data))
        return state_id

    def tool(self, state: int, name: str, arguments: str) -> str:
        from aitrainsai.tools import call_tool_async

        _, env_state = self.states[state]
        return asyncio.run(call_tool_async(self.env.tools(env_state), name, arguments))  # a tool may be a coroutine

    def score(self, state: int, completion: list[dict]) -> dict[str, Any]:
        row, env_state = self.states.pop(state)
        reward, metrics = asyncio.run(self.env.score(row, completion, env_state))
        return {"reward": reward, "metrics": metrics}

    def reward_errors(self) -> list[str]:
        return sorted(set(self.env.reward_errors))[:20]


def _plain(row: dict) -> dict:
    """A row as JSON can carry it."""
    return json.loads(json.dumps(row, default=str))


def error_location(exc: BaseException, job: Path) -> tuple[str | None, int | None]:
    """The job file and line an exception came from: its innermost frame in ``job``, or for a file that does not
    compile that file's line (not the import of it); ``(None, None)`` when none is the job's."""
    file, line = None, None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.parent == job:
            file, line = path.name, frame.lineno
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).parent == job:
        file, line = Path(exc.filename).name, exc.lineno
    return file, line


def _error(exc: BaseException, job: Path) -> dict[str, Any]:
    """Where in the job's files an exception came from, and what it says."""
    file, line = error_location(exc, job)
    return {"message": f"{type(exc).__name__}: {exc}"[:2000], "file": file, "line": line}


def main() -> None:
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # the job's prints go to stderr, never into the answers
    job = Path(sys.argv[1]) if len(sys.argv) > 1 else JOB
    runtime = os.environ.get(V1_VARIABLE)
    if runtime and job_format(os.listdir(job)) == "verifiers-v1":  # before anything imports the job's verifiers
        sys.path.insert(0, runtime)
    server = Server(job)
    methods: dict[str, Callable[..., Any]] = {
        "load": server.load, "rows": server.page, "start": server.start, "tool": server.tool, "score": server.score,
        "reward_errors": server.reward_errors}
    for line in requests:
        request = json.loads(line)
        try:
            answer = {"result": methods[request["method"]](**request.get("params", {}))}
        except BaseException as exc:  # noqa: BLE001 - the job's failures are answers, not crashes
            answer = {"error": _error(exc, job)}
        answers.write(json.dumps(answer, default=str).encode() + b"\n")
        answers.flush()


if __name__ == "__main__":
    main()
