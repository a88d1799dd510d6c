"""The trusted side's handle on a job's environment: it runs in a sandbox (:mod:`aitrainsai.jobs.env_server`) and is
asked questions over a pipe; every answer is read with a byte cap and a deadline and checked against a typed model
before it is used. Nothing here imports agent code.

The probe asks it whether the environment loads, presents the eval's interface and scores samples sensibly; the
local inner trainer asks it for training rows, tool results and rewards while the trainer itself (trusted code,
outside the sandbox) samples, updates and saves the model.
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aitrainsai.jobs.format import ENTRY_FILE, V1_VARIABLE, job_format, verifiers_v1_path
from aitrainsai.isolation import Limits, SandboxResult, SandboxUnavailable, make_sandbox

from aitrainsai.jobs.job import PROBE_FILE
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    from aitrainsai.chat import Message
    from aitrainsai.jobs.job import FrozenRows

ANSWER_BYTES = 1 << 20
ROWS_PAGE = 64
ROWS_PAGE_BYTES = 16 << 20
TOOL_RESULT_CHARS = 8_000
MAX_ROWS = 100_000


class JobEnvironmentError(RuntimeError, AitrainsaiError):
    """The job's environment failed: ``file``/``line`` name where in the job's files, when the job's code raised."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None):
        super().__init__(message)
        self.message, self.file, self.line = message, file, line


class EnvironmentBroken(JobEnvironmentError):
    """The environment process stopped answering, answered out of protocol, or ran out of time. Where the sandbox
    printed something (bubblewrap's error, the interpreter's traceback), the message's first line ends with its last
    line and the lines after it are its tail."""


class SandboxFailed(EnvironmentBroken):
    """The environment's sandbox could not be started here (no bubblewrap, namespaces refused, not root for the
    container isolation, no sandbox uid free): this machine's failure, not the job's."""


class RowsChanged(JobEnvironmentError):
    """The job's environment serves other rows than the probe froze (``dataset.jsonl``, framed by the eval's system
    prompt): what a model trains on is never what the job's code says later, only what the probe checked."""


class RubricChanged(JobEnvironmentError):
    """The job's rubric scores what the probe had it score otherwise in training (a rubric that tells the probe from
    training, by its sandbox or its timing, and rewards the two differently)."""


SAMPLE_TOLERANCE = 1e-3  # a rubric's score of a probe sample may move this much in training (float noise, jitter)


class ToolSchema(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: dict[str, Any]


class RewardFunc(BaseModel):
    """One of the job's reward functions as its environment names it (a label the agent chose, never a verdict)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=100)
    weight: float | None = Field(None, allow_inf_nan=False)


class EnvironmentInfo(BaseModel):
    """What ``load_environment()`` presents."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str | None = Field(None, max_length=65_536)
    max_turns: int = Field(ge=1, le=1_000)
    tool_names: list[str] = Field(max_length=64)
    tool_schemas: list[ToolSchema] = Field(max_length=64)
    rows: int = Field(ge=0, le=MAX_ROWS)
    reward_funcs: list[RewardFunc] = Field(default_factory=list, max_length=64)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(pattern="^(system|user|assistant|tool)$")
    content: str | None = Field("", max_length=65_536)


class EnvironmentRow(BaseModel):
    """A training row as the environment presents it: the prompt messages, the answer, the info its tools read."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[ChatMessage] = Field(min_length=1, max_length=64)
    answer: str = Field("", max_length=65_536)
    info: Any = None

    def messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.prompt]


class Score(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float
    metrics: dict[str, float] = Field(default_factory=dict, max_length=64)


class RemoteEnvironment:
    """The environment of the job in ``job_dir``, served from a sandbox; use as a context manager."""

    def __init__(self, job_dir: Path, *, limits: Limits | None = None, hide: Sequence[Path] = (),
                 env: dict[str, str] | None = None, call_timeout_s: float = 120.0):
        self.job_dir = Path(job_dir)
        self.limits = limits or Limits()
        self.call_timeout_s = call_timeout_s
        runtime = verifiers_v1_path()  # a v1 job's env server puts it first on its path
        # threads from the sandbox's CPU share, never the trusted process's: the same in the probe and in training
        cpus = self.limits.cpus
        threads = str(max(1, int(cpus)) if cpus is not None else len(os.sched_getaffinity(0)))
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **(env or {}),
               **({V1_VARIABLE: str(runtime)} if runtime is not None else {})}
        hide = [*hide, self.job_dir / PROBE_FILE]  # the trusted side's record of the job: never the job's to read
        try:
            self.sandbox = make_sandbox([sys.executable, "-I", "-m", "aitrainsai.jobs.env_server"],
                                        job_dir=self.job_dir, limits=self.limits, hide=hide, env=env, talk=True)
        except SandboxUnavailable as exc:  # no strategy here (AITRAINSAI_ISOLATION names none)
            raise SandboxFailed(f"the environment's sandbox could not start: {_one_line(exc)}") from None
        self.result: SandboxResult | None = None
        self._buffer = b""
        self._wait_s = call_timeout_s

    def __enter__(self) -> RemoteEnvironment:
        try:
            self.sandbox.start()
        except (SandboxUnavailable, OSError) as exc:
            raise SandboxFailed(f"the environment's sandbox could not start: {_one_line(exc)}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> SandboxResult:
        """Stop the environment (closing its input ends it; the sandbox kills what is left)."""
        if self.result is None:
            process = self.sandbox.process
            if process is not None and process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
            self.result = self.sandbox.wait(timeout=10)
        return self.result

    def cpu_seconds(self) -> float | None:
        """The CPU time the environment's sandbox has used so far, all its processes (None where it is not counted,
        or once it is closed)."""
        return self.sandbox.cpu_seconds() if self.result is None else None

    # -- the questions ---------------------------------------------------------------------------------------------
    def load(self, timeout_s: float | None = None) -> EnvironmentInfo:
        return self._typed(EnvironmentInfo, self.call("load", timeout_s=timeout_s))

    def rows(self, count: int) -> list[EnvironmentRow]:
        """The first ``count`` training rows."""
        rows: list[EnvironmentRow] = []
        for start in range(0, min(count, MAX_ROWS), ROWS_PAGE):
            page = self.call("rows", {"start": start, "count": min(ROWS_PAGE, count - start)},
                             max_bytes=ROWS_PAGE_BYTES)
            if not isinstance(page, list):
                raise EnvironmentBroken("rows: the environment did not answer a list")
            rows += [self._typed(EnvironmentRow, row) for row in page]
        if len(rows) != count:
            raise EnvironmentBroken(f"rows: the environment gave {len(rows)} rows, not the {count} it announced")
        return rows

    def checked_rows(self, info: EnvironmentInfo, frozen: FrozenRows) -> None:
        """Check that the environment serves exactly ``frozen``'s rows, in order: each row's prompt is the system
        prompt and the row's question, its answer and its world are the row's; and that its tools (their schemas,
        which the training prompt shows) and turn limit are those the probe saw, where it recorded them.
        :class:`RowsChanged` names the first thing that differs and how. Training then reads ``frozen``, never these
        answers."""
        entry = ENTRY_FILE[job_format(os.listdir(self.job_dir))]
        if frozen.tool_schemas is not None and [s.model_dump() for s in info.tool_schemas] != frozen.tool_schemas:
            raise RowsChanged("the environment's tools (their names, descriptions or parameters) are not the ones "
                              "the probe saw", file=entry)
        if frozen.max_turns is not None and info.max_turns != frozen.max_turns:
            raise RowsChanged(f"the environment's turn limit is {info.max_turns}, not the {frozen.max_turns} the "
                              "probe saw", file=entry)
        if info.rows != len(frozen.rows):
            raise RowsChanged(f"the environment serves {info.rows} rows but the probe froze {len(frozen.rows)} "
                              "(dataset.jsonl): it must serve dataset.jsonl's rows as they are", file=entry)
        for index, served in enumerate(self.rows(info.rows)):
            try:
                why = _difference(served, frozen, index)
            except RecursionError:
                why = "it is nested too deeply to compare"
            if why:
                raise RowsChanged(f"row {index} of the environment is not row {index} of dataset.jsonl ({why}): it "
                                  "must serve dataset.jsonl's rows as they are", file=entry)

    def checked_samples(self, frozen: FrozenRows) -> None:
        """Score again what the probe had the rubric score (``frozen.samples``), here, before any training step:
        :class:`RubricChanged` names the first sample whose reward moved more than ``SAMPLE_TOLERANCE``."""
        entry = ENTRY_FILE[job_format(os.listdir(self.job_dir))]
        for sample in frozen.samples:
            completion = cast("list[Message]", sample.completion)
            again = self.score(self.start(row_data=sample.row_data), completion).reward
            if not abs(again - sample.reward) <= SAMPLE_TOLERANCE:
                raise RubricChanged(f"the rubric scored {sample.label} {sample.reward:g} in the probe and {again:g} "
                                    "in training: a job's code that scores the probe and training differently is "
                                    "refused", file=entry)

    def start(self, row: int | None = None, row_data: dict[str, Any] | None = None) -> int:
        state = self.call("start", {"row": row} if row_data is None else {"row_data": row_data})
        if not isinstance(state, int) or isinstance(state, bool):
            raise EnvironmentBroken("start: the environment did not answer a rollout id")
        return state

    def tool(self, state: int, name: str, arguments: str) -> str:
        result = self.call("tool", {"state": state, "name": name, "arguments": arguments})
        if not isinstance(result, str):
            raise EnvironmentBroken("tool: the environment did not answer text")
        return result[:TOOL_RESULT_CHARS]

    def score(self, state: int, completion: list[Message]) -> Score:
        score = self._typed(Score, self.call("score", {"state": state, "completion": completion}))
        if not math.isfinite(score.reward):
            raise JobEnvironmentError(f"the rubric returned {score.reward}; a reward must be a finite number",
                                    file="rubric.py")
        return score

    def reward_errors(self) -> list[str]:
        errors = self.call("reward_errors")
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise EnvironmentBroken("reward_errors: the environment did not answer a list of text")
        return [e[:500] for e in errors[:20]]

    # -- the wire --------------------------------------------------------------------------------------------------
    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float | None = None,
             max_bytes: int = ANSWER_BYTES) -> Any:
        """Ask one question; the answer's ``result``, or :class:`JobEnvironmentError` for the job's own failure."""
        process = self.sandbox.process
        if process is None or self.result is not None:
            raise EnvironmentBroken("the environment is not running")
        self._wait_s = timeout_s or self.call_timeout_s
        deadline = min(time.monotonic() + self._wait_s, self._wall_deadline())
        self._write(json.dumps({"method": method, "params": params or {}}).encode() + b"\n", deadline, method)
        line = self._read_line(deadline, max_bytes, method)
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):
            raise EnvironmentBroken(f"{method}: the environment's answer is not JSON") from None
        if not isinstance(answer, dict) or not ({"result"} == set(answer) or {"error"} == set(answer)):
            raise EnvironmentBroken(f"{method}: the environment answered out of protocol")
        if "error" in answer:
            error = answer["error"] if isinstance(answer["error"], dict) else {}
            file = error.get("file") if isinstance(error.get("file"), str) else None
            line_no = error.get("line") if isinstance(error.get("line"), int) else None
            message = str(error.get("message", "failed"))[:2000]
            raise JobEnvironmentError(message, file=file and file[:100], line=line_no)
        return answer["result"]

    def _write(self, data: bytes, deadline: float, method: str) -> None:
        fd = _pipe(self.sandbox.running.stdin)
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                self._late(method)
            _, ready, _ = select.select([], [fd], [], left)
            if ready:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
                except OSError:
                    raise self._ended(method) from None

    def _read_line(self, deadline: float, max_bytes: int, method: str) -> bytes:
        fd = _pipe(self.sandbox.running.stdout)
        while b"\n" not in self._buffer:
            if len(self._buffer) > max_bytes:
                self._fail(f"{method}: the environment's answer is larger than {max_bytes} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                self._late(method)
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._ended(method)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > max_bytes:
            self._fail(f"{method}: the environment's answer is larger than {max_bytes} bytes")
        return line

    def _wall_deadline(self) -> float:
        return self.sandbox.started + self.limits.wall_s

    def _late(self, method: str) -> None:
        if self.sandbox.running.poll() is not None:  # it ended meanwhile: say how, not that it was slow
            raise self._ended(method)
        if time.monotonic() >= self._wall_deadline():
            self._fail(f"{method}: the environment ran out of wall-clock time ({self.limits.wall_s:g} s)")
        self._fail(f"{method}: the environment did not answer within {self._wait_s:g} s")

    def _fail(self, message: str) -> None:
        """Stop the sandbox and raise ``message`` with what the sandbox printed (a stuck start says why there)."""
        self.sandbox.kill()
        raise EnvironmentBroken(_with_output(message, self.close(), silent="its sandbox printed nothing"))

    def _ended(self, method: str) -> EnvironmentBroken:
        result = self.close()
        return EnvironmentBroken(_with_output(
            f"{method}: the environment process ended ({result.reason or 'exit code 0'})", result))

    @staticmethod
    def _typed(model: type[BaseModel], value: Any) -> Any:
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise EnvironmentBroken(f"the environment's answer is malformed ({where}: {first['msg']})") from None


def _difference(served: EnvironmentRow, frozen: FrozenRows, index: int) -> str:
    """How ``served`` differs from row ``index`` of ``frozen``, in a few words; empty when it does not."""
    if served.messages() != frozen.prompt(index):
        return "its prompt is not the eval's system prompt and the row's question"
    row = frozen.rows[index]
    if served.answer != row.answer:
        return "its answer differs"
    info = served.info
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except (ValueError, RecursionError):
            return "its info is not JSON"
    if not isinstance(info, dict) or info.get("world") != row.world:
        return "its world differs"
    return ""


def _with_output(message: str, result: SandboxResult, silent: str = "") -> str:
    """``message``, then the sandbox's last stderr line on the same line, then its stderr's tail below (capped)."""
    tail = (result.stderr or "")[-1500:].rstrip()
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return f"{message}; {silent}" if silent else message
    head = f"{message}: {lines[-1][:300]}"
    return head if len(lines) == 1 else f"{head}\n{tail}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _pipe(stream: IO[bytes] | None) -> int:
    assert stream is not None, "the sandbox was started with talk=True"
    return stream.fileno()
