"""The job format, its template, and the validation probe.

A job is four files the agent writes in its workspace:

- ``environment.py`` — a verifiers (0.2.x, classic API) environment: ``load_environment(**kwargs)`` presenting the
  family's eval interface (system prompt, tools, answer format) over the rows of ``dataset.jsonl``;
- ``rubric.py`` — the reward functions the inner GRPO optimises (``build_rubric(parser) -> vf.Rubric``);
- ``dataset.py`` — ``build() -> list[dict]``, the training rows ``{"question", "answer", "world"}``; the probe runs it
  once and freezes the result as ``dataset.jsonl``;
- ``trainer.toml`` — the trainer config, whose schema the inner trainer owns.

The probe freezes the workspace first (a trusted copy of its regular files) and checks only the frozen copy:
statically (files, the trainer's config schema and budget), then by running the job's code in the sandbox: ``build()``
once, whose rows come back as data that the trusted side parses strictly, checks (size, hidden-eval overlap) and writes
as ``dataset.jsonl``; then the environment is loaded in a sandbox and asked for its interface and for rubric scores of
samples (:mod:`aitrainsai.remote_env`). Every verdict is computed here, by trusted code, from what it checked itself.
An accepted job is content-hashed (:func:`job_digest`); trainers check the hash before training and before the
evaluation. See :mod:`aitrainsai.verifiers_env` for why verifiers 0.2.x.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aitrainsai.parsing import has_lone_surrogate, printable
from aitrainsai.trainers import Problem

if TYPE_CHECKING:
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.trainers import InnerTrainer

REQUIRED_FILES = ("environment.py", "rubric.py", "dataset.py", "trainer.toml")
DATASET_FILE = "dataset.jsonl"
FROZEN_DIR = "job"
PROBLEMS_FILE = "problems.json"
SANDBOX_OUT = "sandbox-out"
CHANCE_DRAW_ROWS = 1_000  # rows per level of the reference draw that measures a family's chance overlap
CHANCE_DRAW_SEED = 0x0A17_5EED  # that draw's seed (plus the level): a fixed, public one, like an honest job's
CHANCE_CONFIDENCE = 0.05  # the reference draw's chance rate is bounded from above at this error
CHANCE_REFUSAL = 1e-4  # an honest draw holds more chance matches than allowed at most this often
MAX_ROW_BYTES = 65_536  # one training row, as JSON
MAX_DATASET_BYTES = 32 * 2**20  # all of them: bounds the trusted checks' time (the overlap check is linear in it)
MAX_JOB_FILES = 64
MAX_JOB_BYTES = 10_000_000
SAMPLE_ROWS = 8


@dataclass
class ProbeReport:
    ok: bool
    problems: list[Problem]
    seconds: float
    job_dir: Path | None = None
    rows: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None

    def text(self) -> str:
        if self.ok:
            removed = self.details.get("removed_hidden_rows", 0)
            note = f"; {removed} rows equal to hidden-eval items were removed" if removed else ""
            return f"accepted: the job is valid ({self.rows} training rows{note})"
        return "rejected; fix these and call submit_job again:\n" + "\n".join(f"- {p}" for p in self.problems)


def job_template(spec: "TaskSpec", trainer_config: str) -> dict[str, str]:
    """The files of a working job for ``spec``: what the task spec shows the agent."""
    package = spec.public_modules[0]
    interface = spec.eval_interface
    environment = f'''"""Training environment for {spec.family}: a verifiers (0.2.x) environment with the eval's interface."""

import json
import typing
from pathlib import Path

import verifiers as vf
from datasets import Dataset

from aitrainsai.tools import takes_world
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
    dataset = f'''"""Training rows: build() returns them; the probe runs it once and saves dataset.jsonl.

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
    return {"environment.py": environment, "rubric.py": rubric, "dataset.py": dataset, "trainer.toml": trainer_config}


class TrainingRow(BaseModel):
    """One row of ``dataset.jsonl``, as the trusted side accepts it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    question: str = Field(min_length=1)
    answer: str
    world: dict[str, Any] = Field(default_factory=dict)


class ChildProblem(BaseModel):
    """A problem the sandboxed ``build()`` run reports (the job's own traceback): shown to the agent, not a verdict."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(max_length=100)
    message: str = Field(max_length=2_000)
    line: int | None = None


class JobChanged(RuntimeError):
    """A frozen job's files are not the ones that were accepted."""


def probe_job(workspace: Path, out_dir: Path, spec: "TaskSpec", family: "TaskFamily", trainer: "InnerTrainer",
              *, hide: list[Path], wall_s: float = 90.0) -> ProbeReport:
    """Check the job in ``workspace``; on success its frozen copy is ``out_dir/job`` and the report holds its hash.
    ``out_dir`` is emptied first; ``hide``: paths the sandbox must not show even inside the folders it shows (the
    session's :func:`aitrainsai.isolation.view.hidden_paths`)."""
    start = time.monotonic()
    deadline = start + wall_s
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    frozen = out_dir / FROZEN_DIR
    problems = freeze(Path(workspace), frozen)
    for name in REQUIRED_FILES:
        if not (frozen / name).is_file():
            problems.append(Problem(file=name, message="missing: write it (the task spec shows a template)"))
    if (frozen / "trainer.toml").is_file():
        problems.extend(trainer.probe(frozen, spec))
    if any(not (frozen / name).is_file() for name in ("environment.py", "rubric.py", "dataset.py")):
        return ProbeReport(False, problems, time.monotonic() - start)

    details: dict[str, Any] = {}
    rows, dataset_problems = _build_dataset(frozen, out_dir / SANDBOX_OUT, spec, family, hide, deadline, details)
    problems += dataset_problems
    if rows is not None:
        problems += _check_environment(frozen, spec, family, len(rows), hide, deadline, details)
    ok = not problems
    digest = job_digest(frozen) if ok else None
    return ProbeReport(ok, problems, time.monotonic() - start, frozen if ok else None, len(rows or []), details,
                       digest)


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
    The agent's own ``dataset.jsonl`` and bytecode caches are left out: the probe writes the dataset itself."""
    problems: list[Problem] = []
    frozen.mkdir(parents=True)
    budget = [MAX_JOB_FILES, MAX_JOB_BYTES]

    def copy(source_fd: int, target: Path, depth: int) -> None:
        for name in sorted(os.listdir(source_fd)):
            if name == "__pycache__" or (depth == 0 and name == DATASET_FILE):
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


def _build_dataset(frozen: Path, out: Path, spec: "TaskSpec", family: "TaskFamily", hide, deadline: float,
                   details: dict) -> tuple[list[dict] | None, list[Problem]]:
    """Run ``build()`` in the sandbox, then parse, check and write ``dataset.jsonl`` here."""
    from aitrainsai.sandbox import Limits, run_sandboxed

    wall = max(5.0, deadline - time.monotonic())
    max_rows = spec.constraints.max_dataset_size
    result = run_sandboxed([sys.executable, "-I", "-m", "aitrainsai.probe_child"], job_dir=frozen, out_dir=out,
                           limits=Limits(wall_s=wall, cpu_s=int(wall), memory_mb=4_096,
                                         out_mb=MAX_DATASET_BYTES // 2**20 + 1), hide=hide)
    problems = _child_problems(out / PROBLEMS_FILE)
    if problems:
        return None, problems
    if (result.returncode != 0 or not (out / DATASET_FILE).is_file() or result.export_problems
            or problems is None):
        tail = (result.stderr or result.stdout)[-1500:]
        reason = result.reason or "; ".join(result.export_problems[:3]) or "it wrote no dataset"
        return None, [Problem(file="dataset.py", message=f"the probe could not run build(): {reason}\n{tail}")]
    rows, problems = read_dataset(out / DATASET_FILE, max_rows)
    if problems:
        return None, problems
    overlap = check_overlap(family, rows)
    leaked = overlap.leaked
    problems = []
    if overlap.refused:
        shown = ", ".join(str(i) for i in leaked[:10])
        problems.append(Problem(file="dataset.py", message=(
            f"{len(leaked)} rows are hidden-eval items (rows {shown}{', ...' if len(leaked) > 10 else ''}); an "
            f"honest draw of {overlap.rows} rows from the family's generator holds at most {overlap.allowed} by "
            "chance; training on the eval is not allowed: generate with another seed")))
    if leaked:  # matched rows are dropped, refused or not: a leak never reaches training
        skip = set(leaked)
        rows = [row for i, row in enumerate(rows) if i not in skip]
        if not rows and not problems:
            problems.append(Problem(file="dataset.py", message=(
                "every row is a hidden-eval item, so none is left to train on: generate with another seed")))
    (frozen / DATASET_FILE).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    details["removed_hidden_rows"] = len(leaked)
    details["hidden_rows_allowed"] = overlap.allowed
    return rows, problems


@dataclass(frozen=True)
class OverlapCheck:
    """What the probe found of the hidden eval in a dataset: ``leaked``, the rows that hold a hidden item (all of
    them are dropped); ``rows`` and ``matched``, the distinct rows and distinct matched rows (a repeated row counts
    once); ``allowed``, how many distinct matches an honest draw of ``rows`` rows holds by chance."""

    leaked: list[int]
    rows: int
    matched: int
    allowed: int

    @property
    def refused(self) -> bool:
        return self.matched > self.allowed


def check_overlap(family: "TaskFamily", rows: list[dict], leaked: list[int] | None = None) -> OverlapCheck:
    """The probe's overlap rule: drop every row that holds a hidden-eval item, and refuse the job when more rows match
    than an honest dataset of its size would by chance.

    Why both. Dropping alone makes a found leak worthless, but a disguise the matcher misses (it is fuzzy, not
    perfect) would still train, and the agent would learn nothing from leaking; refusing alone cannot tell a leak from
    the chance collisions of a generator whose low levels have a small item space (calc_chain level 1 draws "Kofi
    starts at 19 and multiplies by 9" again now and then), so a fixed share refused honest small datasets (2% of 32
    rows allows none). So the allowance is the family's own chance rate: :func:`chance_overlap` measures it on a
    reference draw of the family's public generator at every level, bounded from above, and ``allowed`` is the count
    that a binomial of that rate exceeds with probability under ``CHANCE_REFUSAL``: for the installed families 2-3
    rows of 16 or 32, 4-6 of 128, 8-12 of 512, 31-54 of 5,000. An honest draw is then refused about never (measured
    by ``core/benchmarks/overlap_false_refusals.py``); a leak of more is refused; and whatever is accepted has its
    matched rows removed. Rows are counted once each (an oversampled honest dataset repeats its collisions).
    ``leaked``: ``family.overlap(rows)`` where the caller has it already (the benchmark)."""
    leaked = family.overlap(rows) if leaked is None else leaked
    distinct = len({json.dumps(row, sort_keys=True) for row in rows})
    matched = len({json.dumps(rows[i], sort_keys=True) for i in leaked})
    return OverlapCheck(leaked, distinct, matched, chance_allowance(chance_overlap(family), distinct))


def chance_overlap(family: "TaskFamily") -> float:
    """An upper bound on the share of an honest family's rows that match hidden items by chance: the reference draw
    (``CHANCE_DRAW_ROWS`` items per level from the public generator, a fixed seed) matched like a job's rows, each
    level's rate bounded at ``CHANCE_CONFIDENCE`` (Clopper-Pearson), the worst level's kept. Measured once per
    family instance and options (a fraction of a second to two seconds)."""
    import threading

    key = (type(family), _options_key(family))
    with _CHANCE_LOCK.setdefault(key, threading.Lock()):
        if key not in _CHANCE_RATES:
            rates = []
            for level in family.levels:
                seed = CHANCE_DRAW_SEED + level
                seed += seed in (family.eval_seed, family.dev_seed)
                items = family.generate(seed, level, CHANCE_DRAW_ROWS)
                rows = [{"question": i.question, "answer": i.answer, "world": i.world} for i in items]
                rates.append(_upper_rate(len(family.overlap(rows)), len(rows), CHANCE_CONFIDENCE))
            _CHANCE_RATES[key] = max(rates)
    return _CHANCE_RATES[key]


def chance_allowance(rate: float, rows: int) -> int:
    """The most matches among ``rows`` honest rows, each matching with probability ``rate``, that are exceeded with
    probability at most ``CHANCE_REFUSAL``: the smallest k with P[Binomial(rows, rate) > k] <= CHANCE_REFUSAL."""
    if rows <= 0 or rate <= 0.0:
        return 0
    if rate >= 1.0:
        return rows
    left = 1.0  # P[X > k], k counting up from -1
    for k in range(rows + 1):
        left -= _binomial_pmf(k, rows, rate)
        if left <= CHANCE_REFUSAL:
            return k
    return rows


def _upper_rate(hits: int, draws: int, error: float) -> float:
    """The one-sided Clopper-Pearson upper bound on a rate from ``hits`` in ``draws``: the p at which P[Binomial(draws,
    p) <= hits] = ``error`` (by bisection)."""
    if hits >= draws:
        return 1.0
    low, high = hits / draws, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if sum(_binomial_pmf(k, draws, middle) for k in range(hits + 1)) > error:
            low = middle
        else:
            high = middle
    return high


def _binomial_pmf(k: int, n: int, p: float) -> float:
    import math

    return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                    + k * math.log(p) + (n - k) * math.log1p(-p))


def _options_key(family: "TaskFamily") -> str:
    config = getattr(family, "config", None)
    return config.model_dump_json() if isinstance(config, BaseModel) else repr(config)


_CHANCE_RATES: dict[tuple, float] = {}
_CHANCE_LOCK: dict[tuple, Any] = {}


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


def _child_problems(path: Path) -> list[Problem] | None:
    """The job's own failures as the sandboxed run reported them; None when that report cannot be read."""
    if not path.is_file():
        return []
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(65_536))
        return [Problem(**ChildProblem.model_validate(p).model_dump()) for p in data[:20]]
    except (ValueError, TypeError, RecursionError, ValidationError):
        return None


def _check_environment(frozen: Path, spec: "TaskSpec", family: "TaskFamily", rows: int, hide, deadline: float,
                       details: dict) -> list[Problem]:
    """Load the job's environment in a sandbox and judge what it shows: the eval's system prompt and tools, the
    frozen rows, finite rubric scores that tell a right answer from a wrong one on dev examples and samples."""
    from aitrainsai.remote_env import JobEnvironmentError, RemoteEnvironment, SandboxFailed
    from aitrainsai.sandbox import Limits

    wall = max(10.0, deadline - time.monotonic())
    problems: list[Problem] = []
    try:
        with RemoteEnvironment(frozen, limits=Limits(wall_s=wall, cpu_s=int(wall), memory_mb=6_144), hide=hide,
                               call_timeout_s=wall) as env:
            info = env.load()
            if info.system_prompt != spec.eval_interface.system_prompt:
                problems.append(Problem(file="environment.py", message=(
                    "SYSTEM_PROMPT differs from the eval interface's system prompt; the hidden eval shows the model "
                    f"exactly {spec.eval_interface.system_prompt!r}")))
            expected = [t["function"]["name"] for t in spec.eval_interface.tools]
            missing = sorted(set(expected) - set(info.tool_names))
            if missing:
                problems.append(Problem(file="environment.py", message=(
                    f"the environment lacks the eval's tools {', '.join(missing)}; the hidden eval offers them")))
            if info.rows != rows:
                problems.append(Problem(file="environment.py", message=(
                    f"load_environment() has {info.rows} rows but dataset.jsonl has {rows}: train on dataset.jsonl")))
            details.update(rows=info.rows, tool_names=info.tool_names,
                           reward_funcs=[f.model_dump() for f in info.reward_funcs])
            scores = _sample_scores(env, spec, family, min(info.rows, SAMPLE_ROWS))
            details["rubric_scores"] = scores
            errors = env.reward_errors()
            if errors:
                problems.append(Problem(file="rubric.py", message=(
                    "reward functions failed while scoring samples (verifiers scores a failure 0): "
                    + "; ".join(errors[:5]))))
            elif len({round(s, 9) for s in scores}) == 1:
                problems.append(Problem(file="rubric.py", message=(
                    f"every sample scored {scores[0]:g} (right answers, wrong answers, empty replies alike): a GRPO "
                    "group with no variance teaches nothing; reward what the eval checks")))
    except SandboxFailed:
        raise  # this machine cannot sandbox: nothing the job could fix (as when build() could not be sandboxed)
    except JobEnvironmentError as exc:
        problems.append(Problem(file=exc.file or "environment.py", line=exc.line,
                                message=f"the probe could not run your job: {exc.message}"))
    return problems


def _sample_scores(env, spec: "TaskSpec", family: "TaskFamily", sample_rows: int) -> list[float]:
    """Rubric scores of the dev examples' reference transcripts, and of right, wrong and empty replies to rows."""
    from aitrainsai.remote_env import JobEnvironmentError

    samples: list[tuple[dict | int, list[dict], str]] = []
    for example in spec.dev_examples:
        item = example.item
        row = {"prompt": [{"role": "system", "content": spec.eval_interface.system_prompt},
                          {"role": "user", "content": item.question}],
               "answer": item.answer, "info": json.dumps({"world": item.world}), "example_id": -1}
        completion = example.transcript[len(family.initial_messages(item)):]
        samples.append((row, completion, "a dev example's reference transcript"))
    rows = env.rows(sample_rows) if sample_rows else []
    for index, row in enumerate(rows):
        right = [{"role": "assistant", "content": f"<answer>{row.answer}</answer>"}]
        samples.append((index, right, "the right answer"))
        samples.append((index, [{"role": "assistant", "content": "<answer>no idea</answer>"}], "a wrong answer"))
        samples.append((index, [{"role": "assistant", "content": ""}], "an empty reply"))
    scores = []
    for row, completion, label in samples:
        try:
            state = env.start(row=row) if isinstance(row, int) else env.start(row_data=row)
            scores.append(env.score(state, completion).reward)
        except JobEnvironmentError as exc:
            raise JobEnvironmentError(f"scoring {label}: {exc.message}", exc.file or "rubric.py", exc.line) from None
    return scores
