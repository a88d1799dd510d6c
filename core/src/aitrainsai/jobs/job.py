"""The job format: the four files an agent writes, their template, and what freezes and hashes an accepted job.

A job is four files the agent writes in its workspace:

- ``environment.py`` — a verifiers (0.2.x, classic API) environment: ``load_environment(**kwargs)`` presenting the
  family's eval interface (system prompt, tools, answer format) over the rows of ``dataset.jsonl``;
- ``rubric.py`` — the reward functions the inner GRPO optimises (``build_rubric(parser) -> vf.Rubric``);
- ``dataset.py`` — ``build() -> list[dict]``, the training rows ``{"question", "answer", "world"}``; the probe runs it
  once and freezes the result as ``dataset.jsonl``;
- ``trainer.toml`` — the trainer config, whose schema the inner trainer owns.

A job in the verifiers v1 format (:mod:`aitrainsai.jobs.format`) has ``taskset.py`` in place of ``environment.py``:
a verifiers 0.4.0 taskset over ``dataset.jsonl`` whose task has the family's tools and turn limit, with ``rubric.py``'s
``@vf.reward`` methods mixed in; ``dataset.py`` and ``trainer.toml`` are the same in both formats.

The probe writes two files into the frozen job itself: ``dataset.jsonl`` (the rows ``build()`` returned, all of them,
checked) and ``probe.json`` (the eval's system prompt, which frames every row, the environment's tools and turn limit
as the probe saw them, and which rows are hidden-eval items, never trained on). ``probe.json`` is the trusted side's
alone: no sandbox shows it to the job's code, which sees the same ``dataset.jsonl`` in the probe and in training and
so cannot tell which of its rows were hidden. Training reads exactly those rows, framed by the trusted side
(:func:`frozen_rows`); the job's environment must serve the same rows or the job dies.

An accepted job is content-hashed (:func:`job_digest`); trainers check the hash before training and before the
evaluation. See :mod:`aitrainsai.jobs.verifiers_env` and :mod:`aitrainsai.jobs.taskset_env` for how each format's
code is driven.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from aitrainsai.jobs.format import JOB_FILES, JobFormat
from aitrainsai.parsing import has_lone_surrogate, printable
from aitrainsai.trainers import Problem
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    from aitrainsai.families import TaskSpec

REQUIRED_FILES = JOB_FILES["verifiers"]  # the classic format's
DATASET_FILE = "dataset.jsonl"
PROBE_FILE = "probe.json"  # what the probe froze beside the rows: the system prompt that frames them
PROBE_WRITTEN = (DATASET_FILE, PROBE_FILE)  # written by the probe into the frozen job; an agent's own are left out
FROZEN_DIR = "job"
MAX_ROW_BYTES = 65_536  # one training row, as JSON
MAX_DATASET_BYTES = 32 * 2**20  # all of them: bounds the trusted checks' time (the overlap check is linear in it)
MAX_JOB_FILES = 64
MAX_JOB_BYTES = 10_000_000


def job_template(spec: TaskSpec, trainer_config: str, job_format: JobFormat = "verifiers") -> dict[str, str]:
    """The files of a working job for ``spec`` in ``job_format``: what the task spec shows the agent."""
    if job_format == "verifiers-v1":
        return {**_v1_files(spec), "dataset.py": _dataset_file(spec), "trainer.toml": trainer_config}
    package = spec.public_modules[0]
    interface = spec.eval_interface
    environment = f'''"""Training environment for {spec.family}: a verifiers (0.2.x) environment with the eval's interface."""

import json
import typing
from pathlib import Path

import verifiers as vf
from datasets import Dataset

from aitrainsai import takes_world
from {package} import TOOLS
from rubric import build_rubric

SYSTEM_PROMPT = {interface.system_prompt!r}
MAX_TURNS = {interface.turn_limit}
HERE = Path(__file__).resolve().parent


class FamilyEnv(vf.StatefulToolEnv):
    """The family's tools; a tool whose first parameter is `world` gets the item's world from the row's info."""

    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        for tool in TOOLS:
            tool.__annotations__ = typing.get_type_hints(tool)  # resolved, so that verifiers can read them
            hidden = ["world"] if takes_world(tool) else []  # the core's own rule
            self.add_tool(tool, args_to_skip=hidden)

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        if "world" in self.skipped_args.get(tool_name, []):
            if "world" not in state:  # one copy per rollout, so tools that keep state keep it for this rollout only
                info = state["info"]
                state["world"] = (json.loads(info) if isinstance(info, str) else info)["world"]
            tool_args["world"] = state["world"]
        return tool_args


def load_environment(**kwargs):
    rows = [json.loads(line) for line in (HERE / "dataset.jsonl").read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([
        {{"question": row["question"], "answer": str(row["answer"]), "info": json.dumps({{"world": row["world"]}})}}
        for row in rows
    ])
    parser = vf.XMLParser(["answer"], answer_field="answer")
    return FamilyEnv(dataset=dataset, system_prompt=SYSTEM_PROMPT, parser=parser, rubric=build_rubric(parser),
                     max_turns=MAX_TURNS, **kwargs)
'''
    rubric = '''"""Reward functions for the inner GRPO: what the small model is trained to maximise."""

import verifiers as vf


def correct_answer(completion, answer, parser, **kwargs) -> float:
    """1.0 when the final <answer> equals the reference answer."""
    given = parser.parse_answer(completion) or ""
    return float(given.strip() == str(answer).strip())


def build_rubric(parser):
    return vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
'''
    return {"environment.py": environment, "rubric.py": rubric, "dataset.py": _dataset_file(spec),
            "trainer.toml": trainer_config}


def _dataset_file(spec: TaskSpec) -> str:
    package = spec.public_modules[0]
    return f'''"""Training rows: build() returns them; the probe runs it once and saves dataset.jsonl.

Each row is {{"question": str, "answer": str, "world": dict}}. The family's public generator makes rows like the
eval's; rows that are hidden-eval items are dropped (more than chance: refused).
"""

from {package} import generate

SEED = 20240
ITEMS_PER_LEVEL = {{{spec.level}: 256}}


def build() -> list[dict]:
    rows = []
    for level, count in ITEMS_PER_LEVEL.items():
        for item in generate(SEED + level, level, count):
            rows.append({{"question": item.question, "answer": item.answer, "world": item.world}})
    return rows
'''


def _v1_files(spec: TaskSpec) -> dict[str, str]:
    """``taskset.py`` and ``rubric.py`` of a verifiers v1 (0.4.0) job: a taskset over ``dataset.jsonl`` whose task
    has the family's tools, turn limit and answer format, and reward methods mixed in from the rubric."""
    package = spec.public_modules[0]
    interface = spec.eval_interface
    taskset = f'''"""Training taskset for {spec.family}: a verifiers v1 (0.4.0) taskset with the eval's interface."""

import copy
import functools
import inspect
import json
import typing
from pathlib import Path

import verifiers.v1 as vf

from aitrainsai import takes_world
from {package} import TOOLS
from rubric import Rubric

SYSTEM_PROMPT = {interface.system_prompt!r}
MAX_TURNS = {interface.turn_limit}
HERE = Path(__file__).resolve().parent


class FamilyData(vf.TaskData):
    answer: str
    world: dict = {{}}


class FamilyTools(vf.Toolset[vf.ToolsetConfig]):
    """The family's tools, one server per rollout: each rollout gets its own copy of the item's world."""

    TOOL_PREFIX = None  # the eval calls the tools by their own names

    async def setup_task(self, task):
        self.world = copy.deepcopy(task.world)


def _method(tool):
    """`tool` as a method of FamilyTools; a tool whose first parameter is `world` gets the rollout's world."""
    world = takes_world(tool)  # the core's own rule
    signature = inspect.signature(tool)
    params = list(signature.parameters.values())[1 if world else 0:]

    @functools.wraps(tool)
    def method(self, *args, **kwargs):
        return tool(self.world, *args, **kwargs) if world else tool(*args, **kwargs)

    method.__signature__ = signature.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    method.__annotations__ = {{k: v for k, v in typing.get_type_hints(tool).items() if k != "world"}}
    return vf.tool(method)


for _tool in TOOLS:
    setattr(FamilyTools, _tool.__name__, _method(_tool))


class FamilyTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    max_turns: int = MAX_TURNS


class FamilyTask(Rubric, vf.Task[FamilyData, vf.State, FamilyTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [FamilyTools(config.tools)]

    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= self.config.max_turns


class FamilyConfig(vf.TasksetConfig):
    task: FamilyTaskConfig = FamilyTaskConfig()


class FamilyTaskset(vf.Taskset[FamilyTask, FamilyConfig]):
    def load(self):
        for line in (HERE / "dataset.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                data = FamilyData(prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=str(row["answer"]),
                                  world=row["world"])
                yield FamilyTask(data, self.config.task)


__all__ = ["FamilyTaskset"]

if __name__ == "__main__":  # verifiers starts a rollout's tool server as `python -m taskset`
    FamilyTools.run()
'''
    rubric = '''"""Reward functions for the inner GRPO: what the small model is trained to maximise. Each @vf.reward
method scores a finished rollout (trace.assistant_messages are the model's replies, self.data the task's row); the
task's reward is their weighted sum."""

import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(trace):
    """The last <answer> the model gave: in its last reply that has one (a final tool call has none)."""
    for message in reversed(trace.assistant_messages):
        found = ANSWER.findall(message.content or "")
        if found:
            return found[-1].strip()
    return None


class Rubric:
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        """1.0 when the final <answer> equals the reference answer."""
        return float((parse_answer(trace) or "") == self.data.answer.strip())
'''
    return {"taskset.py": taskset, "rubric.py": rubric}


class TrainingRow(BaseModel):
    """One row of ``dataset.jsonl``, as the trusted side accepts it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    question: str = Field(min_length=1)
    answer: str
    world: dict[str, Any] = Field(default_factory=dict)



class JobChanged(RuntimeError, AitrainsaiError):
    """A frozen job's files are not the ones that were accepted."""



def job_design(frozen: Path, details: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """What an accepted job chose, for the report whatever agent wrote it: ``rubric`` (its reward functions as its
    environment named them in the probe, ``name*weight`` where the weight is not 1) and ``trainer.toml``'s top-level
    scalars. Labels only (a function's name is the agent's to choose); never a verdict or a score."""
    import tomllib

    design: dict[str, str | int | float | bool] = {}
    funcs = details.get("reward_funcs") or []
    if funcs:
        design["rubric"] = printable("+".join(
            f["name"] if f.get("weight") in (None, 1.0) else f"{f['name']}*{f['weight']:g}" for f in funcs))[:200]
    try:
        with open(frozen / "trainer.toml", "rb") as handle:
            config = tomllib.loads(handle.read(MAX_JOB_BYTES).decode())
    except (OSError, ValueError, RecursionError):
        return design
    for key, value in list(config.items())[:32]:
        if isinstance(value, str):
            value = printable(value)[:80]
        elif not isinstance(value, (bool, int, float)):
            continue
        design.setdefault(printable(key)[:40], value)
    return design


def freeze(workspace: Path, frozen: Path) -> list[Problem]:
    """Copy the workspace's regular files into ``frozen`` (trusted: no link followed, caps counted on what is read).
    The agent's own ``dataset.jsonl`` and ``probe.json`` and bytecode caches are left out: the probe writes those
    two itself."""
    problems: list[Problem] = []
    frozen.mkdir(parents=True)
    budget = [MAX_JOB_FILES, MAX_JOB_BYTES]

    def copy(source_fd: int, target: Path, depth: int) -> None:
        for name in sorted(os.listdir(source_fd)):
            if name == "__pycache__" or (depth == 0 and name in PROBE_WRITTEN):
                continue
            if has_lone_surrogate(name):  # bytes that are not UTF-8: no API could send the name, nor hash it as text
                problems.append(Problem(file=printable(name), message=(
                    "the file name is not UTF-8 text; delete the file or give it a plain name")))
                continue
            info = os.stat(name, dir_fd=source_fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode) and depth < 8:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=source_fd)
                try:
                    (target / name).mkdir()
                    copy(child, target / name, depth + 1)
                finally:
                    os.close(child)
            elif stat.S_ISREG(info.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=source_fd)
                with os.fdopen(fd, "rb") as handle:
                    data = handle.read(budget[1] + 1)
                budget[0] -= 1
                budget[1] -= len(data)
                if budget[0] < 0 or budget[1] < 0:
                    problems.append(Problem(file=name, message=(
                        f"the job holds more than {MAX_JOB_FILES} files or {MAX_JOB_BYTES} bytes")))
                    return
                (target / name).write_bytes(data)

    source = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        copy(source, frozen, 0)
    finally:
        os.close(source)
    return problems


def job_digest(job_dir: Path) -> str:
    """The content hash of a frozen job: every file's relative path (its bytes on disk, so that a name that is not
    UTF-8 is hashed too, never an error) and bytes."""
    digest = hashlib.sha256()
    root = Path(job_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(os.fsencode(path.relative_to(root).as_posix()) + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def verify_job(job_dir: Path, digest: str | None) -> None:
    """Raise :class:`JobChanged` unless ``job_dir`` holds exactly the job accepted with ``digest``."""
    if not digest:
        raise JobChanged("the job has no recorded hash: it was never accepted")
    if not Path(job_dir).is_dir():
        raise JobChanged(f"the frozen job {job_dir} is gone")
    if job_digest(job_dir) != digest:
        raise JobChanged("the frozen job's files changed after it was accepted")



def read_dataset(path: Path, max_rows: int) -> tuple[list[dict], list[Problem]]:
    """Parse ``dataset.jsonl`` strictly: every line a JSON object with ``question``, ``answer`` and ``world``, at most
    ``MAX_ROW_BYTES`` each, ``MAX_DATASET_BYTES`` and ``max_rows`` in all. Any bad line is a problem (never "no
    rows")."""
    rows: list[dict] = []
    size = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(iter(lambda: handle.readline(MAX_ROW_BYTES + 1), b""), 1):
            size += len(line)
            if len(line) > MAX_ROW_BYTES:
                return [], [Problem(file="dataset.py", message=(
                    f"row {number - 1} is larger than {MAX_ROW_BYTES} bytes as JSON; keep rows small"))]
            if size > MAX_DATASET_BYTES:
                return [], [Problem(file="dataset.py", message=(
                    f"the rows are larger than {MAX_DATASET_BYTES // 2**20} MB as JSON; keep the dataset small"))]
            if len(rows) >= max_rows:
                return [], [Problem(file="dataset.py",
                                    message=f"build() returned more rows than the cap of {max_rows}")]
            try:
                row = TrainingRow.model_validate_json(line)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "the row"
                return [], [Problem(file="dataset.py", message=(
                    f"row {number - 1} is not a training row ({where}: {first['msg']}); each row is "
                    "{'question': str, 'answer': str, 'world': dict}"))]
            except RecursionError:
                return [], [Problem(file="dataset.py", message=f"row {number - 1} is nested too deeply")]
            rows.append(row.model_dump())
    if not rows:
        return [], [Problem(file="dataset.py", message="build() returned no rows")]
    return rows, []



class ProbeSample(BaseModel):
    """One completion the probe had the job's rubric score: the row it started from (as the environment takes it),
    the completion, and the reward it got. Training scores it again before it starts: a rubric that tells the probe
    from training by its sandbox scores the two differently."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(max_length=200)
    row_data: dict[str, Any]
    completion: list[dict[str, Any]] = Field(max_length=64)
    reward: float


class FrozenRows(BaseModel):
    """What training reads of a frozen job: the rows the probe checked (``dataset.jsonl``), and from ``probe.json`` the
    system prompt that frames each of them (a training prompt is that system message, then the row's question) and
    the environment's tools and turn limit as the probe saw them (None: not recorded)."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str
    rows: list[TrainingRow]
    tool_schemas: list[dict[str, Any]] | None = None
    max_turns: int | None = None
    left_out: list[int] = Field(default_factory=list, description=(
        "rows that are hidden-eval items: served and rolled out like the others, so that the job's code cannot tell "
        "them apart, but every rollout of theirs is rewarded 0, so a group of them has no advantage and trains "
        "nothing"))
    samples: list[ProbeSample] = Field(default_factory=list, description="what the probe had the rubric score")

    _left: frozenset[int] = PrivateAttr(default_factory=frozenset)

    def model_post_init(self, context: Any) -> None:
        self._left = frozenset(self.left_out)

    def trained(self, index: int) -> bool:
        """Whether row ``index`` is trained on (not a hidden-eval item)."""
        return index not in self._left

    def prompt(self, index: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.rows[index].question}]

    def row_data(self, index: int) -> dict[str, Any]:
        """Row ``index`` as the job's environment takes it to start a rollout (``info`` as a classic job's rows carry
        it: JSON text)."""
        row = self.rows[index]
        return {"prompt": self.prompt(index), "answer": row.answer, "info": json.dumps({"world": row.world}),
                "example_id": index}


class _ProbeRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system_prompt: str = Field(max_length=65_536)
    tool_schemas: list[dict[str, Any]] | None = Field(None, max_length=64)
    max_turns: int | None = Field(None, ge=1, le=1_000)
    left_out: list[int] = Field(default_factory=list)
    samples: list[ProbeSample] = Field(default_factory=list, max_length=256)


def write_frozen_rows(job_dir: Path, rows: list[dict[str, Any]], system_prompt: str, *,
                      tool_schemas: list[dict[str, Any]] | None = None, max_turns: int | None = None,
                      left_out: list[int] | None = None, samples: list[ProbeSample] | None = None) -> None:
    """Write ``rows``, the system prompt that frames them and (where known) the environment's tools and turn limit,
    and the rows never trained on, into ``job_dir``: the probe's part of a frozen job."""
    write_rows(job_dir, rows)
    (Path(job_dir) / PROBE_FILE).write_text(_ProbeRecord(
        system_prompt=system_prompt, tool_schemas=tool_schemas, max_turns=max_turns,
        left_out=sorted(set(left_out or [])), samples=samples or []).model_dump_json())


def write_rows(job_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as the frozen job's ``dataset.jsonl``."""
    (Path(job_dir) / DATASET_FILE).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def frozen_rows(job_dir: Path, max_rows: int = 100_000) -> FrozenRows:
    """The rows the probe froze in ``job_dir`` and the system prompt framing them; :class:`JobChanged` when they
    cannot be read as the probe wrote them (a job frozen before the probe wrote ``probe.json`` included)."""
    job_dir = Path(job_dir)
    try:
        with open(job_dir / PROBE_FILE, "rb") as handle:
            record = _ProbeRecord.model_validate_json(handle.read(1 << 20))
        rows, problems = read_dataset(job_dir / DATASET_FILE, max_rows)
    except (OSError, ValueError, RecursionError) as exc:
        raise JobChanged(f"the frozen rows cannot be read ({type(exc).__name__}): the probe wrote {DATASET_FILE} "
                         f"and {PROBE_FILE}") from None
    if problems:
        raise JobChanged(f"the frozen rows cannot be read: {problems[0].message}")
    if any(not 0 <= i < len(rows) for i in record.left_out):
        raise JobChanged(f"the frozen rows cannot be read: {PROBE_FILE} leaves out a row that {DATASET_FILE} lacks")
    return FrozenRows(system_prompt=record.system_prompt, rows=[TrainingRow.model_validate(r) for r in rows],
                      tool_schemas=record.tool_schemas, max_turns=record.max_turns, left_out=record.left_out,
                      samples=record.samples)
