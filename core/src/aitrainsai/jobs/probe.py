"""The validation probe (what ``submit_job`` runs).

The probe freezes the workspace first (a trusted copy of its regular files, :func:`~aitrainsai.jobs.job.freeze`) and
checks only the frozen copy: statically (files, the trainer's config schema and budget), then by running the job's
code in the sandbox: ``build()`` once, whose rows come back as data that the trusted side parses strictly, checks
(size, hidden-eval overlap) and writes as ``dataset.jsonl``; then the environment is loaded in a sandbox and asked for
its interface, its rows (exactly ``dataset.jsonl``'s) and rubric scores of samples
(:mod:`aitrainsai.jobs.remote_env`). Every verdict is computed here, by trusted code, from what it checked itself.

The probe is no membership oracle: nothing the agent sees of it depends on which rows match the hidden eval. Matched
rows never refuse a job (a verdict on a count would flip on one row the agent controls, and tell it whether that row
is hidden); they are hidden from training instead, and the ledger alone records whether there were more of them than
an honest draw holds by chance. An accepted job's message counts the rows ``build()`` returned. The frozen
``dataset.jsonl`` holds all of them, in the probe and in training alike, and which are hidden-eval items is written
only in ``probe.json``, which no sandbox shows the job's code: those rows are rolled out like the others in training
and rewarded 0, so they train nothing and the job's code cannot tell them from the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aitrainsai.jobs.format import ENTRY_FILE, JOB_FILES, job_format
from aitrainsai.jobs.job import (DATASET_FILE, FROZEN_DIR, MAX_DATASET_BYTES, FrozenRows, ProbeSample, TrainingRow,
                                 freeze, job_digest, read_dataset, write_frozen_rows)
from aitrainsai.trainers import Problem

if TYPE_CHECKING:
    from aitrainsai.chat import Message
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.trainers import InnerTrainer

PROBLEMS_FILE = "problems.json"
SANDBOX_OUT = "sandbox-out"
CHANCE_DRAW_ROWS = 1_000  # rows per level of the reference draw that measures a family's chance overlap
CHANCE_DRAW_SEED = 0x0A17_5EED  # that draw's seed (plus the level): a fixed, public one, like an honest job's
CHANCE_CONFIDENCE = 0.05  # the reference draw's chance rate is bounded from above at this error
CHANCE_REFUSAL = 1e-4  # an honest draw holds more chance matches than allowed (is flagged) at most this often
SAMPLE_ROWS = 8
MIN_DISTINCT_ROWS = 8  # fewer distinct rows are no dataset to train on (decided before any row is matched)
MAX_STRETCH = 8.0  # the most the probe's wall-clock net stretches with the machine's load
JOB_MEMORY_MB = 4_096  # the memory of a sandbox that runs job code, as in training (the local trainer's memory_gb)


@dataclass
class ProbeReport:
    ok: bool
    problems: list[Problem]
    seconds: float
    job_dir: Path | None = None
    rows: int = 0  # the rows frozen for training (build()'s, less those that are hidden-eval items)
    details: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None
    built: int = 0  # the rows build() returned
    shared_from: Path | None = None  # the accepted job whose verdict this probe took (:class:`SharedVerdicts`)

    def text(self) -> str:
        """What the agent is told: never how many rows matched the hidden eval (see the module's docstring)."""
        if self.ok:
            return (f"accepted: the job is valid ({self.built} rows from build(); any that are hidden-eval items are "
                    "left out of training)")
        return "rejected; fix these and call submit_job again:\n" + "\n".join(f"- {p}" for p in self.problems)



class ChildProblem(BaseModel):
    """A problem the sandboxed ``build()`` run reports (the job's own traceback): shown to the agent, not a verdict."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(max_length=100)
    message: str = Field(max_length=2_000)
    line: int | None = None



def probe_job(workspace: Path, out_dir: Path, spec: TaskSpec, family: TaskFamily, trainer: InnerTrainer,
              *, hide: list[Path], wall_s: float = 90.0, verdicts: SharedVerdicts | None = None) -> ProbeReport:
    """Check the job in ``workspace``; on success its frozen copy is ``out_dir/job`` and the report holds its hash.
    ``out_dir`` is emptied first; ``hide``: paths the sandbox must not show even inside the folders it shows (the
    session's :func:`aitrainsai.isolation.view.hidden_paths`). ``wall_s``: the job's code's budget, in the seconds of
    a quiet machine; the wall clock is a net over it scaled to the machine's load (:func:`wall_net`), so that a loaded
    machine does not refuse a job a quiet one accepts. The sandboxes' other limits are training's (each process's CPU
    time the task's ``max_wall_seconds``, :data:`JOB_MEMORY_MB` of memory): nothing in them tells the probe from
    training. ``verdicts``: the run's accepted verdicts, which an identical job takes once two probes of it agreed
    (:class:`SharedVerdicts`)."""
    start = time.monotonic()
    deadline = start + wall_net(wall_s)
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    frozen = out_dir / FROZEN_DIR
    problems = freeze(Path(workspace), frozen)
    key = verdicts.key(frozen, spec, family, trainer, hide, wall_s) if verdicts is not None and not problems else None
    shared = verdicts.take(key, frozen) if verdicts is not None and key is not None else None
    if shared is not None:
        shared.seconds = time.monotonic() - start
        return shared
    form = job_format(os.listdir(frozen))
    for name in JOB_FILES[form]:
        if not (frozen / name).is_file():
            problems.append(Problem(file=name, message="missing: write it (the task spec shows a template)"))
    if (frozen / "trainer.toml").is_file():
        problems.extend(trainer.probe(frozen, spec))
    if any(not (frozen / name).is_file() for name in JOB_FILES[form] if name != "trainer.toml"):
        return ProbeReport(False, problems, time.monotonic() - start)

    details: dict[str, Any] = {}
    rows, leaked, dataset_problems = _build_dataset(frozen, out_dir / SANDBOX_OUT, spec, family, hide, deadline,
                                                    details)
    problems += dataset_problems
    if rows is not None:
        system_prompt = spec.eval_interface.system_prompt
        # build()'s rows, all of them: what the job's code sees, in the probe and in training; beside them the record
        # no sandbox shows it (there in the probe as in training, so that nothing tells the two apart)
        write_frozen_rows(frozen, rows, system_prompt, left_out=leaked)
        frame = FrozenRows(system_prompt=system_prompt, rows=[TrainingRow.model_validate(r) for r in rows])
        problems += _check_environment(frozen, spec, family, frame, hide, deadline, details)
        # matched rows are left out of training: a leak never trains
        write_frozen_rows(frozen, rows, system_prompt, tool_schemas=details.get("tool_schemas"),
                          max_turns=details.get("max_turns"), left_out=leaked, samples=details.pop("samples", None))
    ok = not problems
    digest = job_digest(frozen) if ok else None
    report = ProbeReport(ok, problems, time.monotonic() - start, frozen if ok else None,
                         len(rows or []) - len(set(leaked)), details, digest, built=len(rows or []))
    if verdicts is not None and key is not None:
        verdicts.record(key, report)
    return report


class SharedVerdicts:
    """Accepted verdicts that identical jobs share, in this process (one per run: the episodes' context).

    A probe's verdict is shared only on evidence, as a training is (:class:`aitrainsai.run.job_phase.SharedJobs`):
    two probes of the same job (its files as frozen, the task spec, the family and its options, the trainer and its
    settings, the hidden paths, the wall budget: :meth:`key`) both accepted it and froze the same job, byte for byte
    (the rows ``build()`` returned and the rubric's scores of the samples included), with the same details. Every
    later probe of that key takes the first's frozen job, copied and checked against its digest, instead of running
    the job's code again. A probe that refuses the key's job, or freezes it otherwise, refuses the key: every probe of
    it runs (a ``build()`` or a rubric that reads the clock or ``os.urandom`` is probed each time)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._first: dict[str, ProbeReport] = {}  # key -> the first accepted probe of it
        self._confirmed: set[str] = set()  # keys whose first two probes agreed
        self._refused: set[str] = set()  # keys probed each time

    @staticmethod
    def key(frozen: Path, spec: TaskSpec, family: TaskFamily, trainer: InnerTrainer, hide: list[Path],
            wall_s: float) -> str:
        """What makes two probes the same probe, as a sha256 (hex); ``frozen``: the job as frozen from the workspace,
        before the probe writes anything into it."""
        import hashlib

        parts = {"files": job_digest(frozen), "spec": spec.model_dump(mode="json"),
                 "family": [f"{type(family).__module__}.{type(family).__qualname__}", family.name,
                            _options_key(family)],
                 "trainer": trainer.name, "settings": trainer.config.model_dump(mode="json"),
                 "hide": sorted(str(p) for p in hide), "wall_s": wall_s}
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def take(self, key: str, frozen: Path) -> ProbeReport | None:
        """The key's confirmed verdict with its frozen job copied into ``frozen`` (replacing what is there), or
        None: the key is not confirmed, or its frozen job is no longer what was accepted (the key is refused)."""
        with self._lock:
            first = self._first.get(key) if key in self._confirmed else None
        if first is None or first.job_dir is None:
            return None
        staged = frozen.with_name(frozen.name + ".shared")
        try:
            shutil.copytree(first.job_dir, staged, symlinks=True)
            plain = all(not p.is_symlink() and (p.is_file() or p.is_dir()) for p in staged.rglob("*"))
            same = plain and job_digest(staged) == first.digest
        except OSError:
            same = False
        if not same:
            shutil.rmtree(staged, ignore_errors=True)
            self._refuse(key)
            return None
        shutil.rmtree(frozen)
        staged.rename(frozen)
        return ProbeReport(True, [], 0.0, frozen, first.rows, copy.deepcopy(first.details), first.digest,
                           built=first.built, shared_from=first.job_dir)

    def record(self, key: str, report: ProbeReport) -> None:
        """A probe of ``key`` that ran: the first accepted is kept, the second confirms it or refuses the key."""
        with self._lock:
            if key in self._refused or key in self._confirmed:
                return
            first = self._first.get(key)
            if not report.ok:
                self._refuse_locked(key)
            elif first is None:
                self._first[key] = dataclasses.replace(report, details=copy.deepcopy(report.details))
            elif (report.digest, report.rows, report.built, report.details) == (first.digest, first.rows,
                                                                               first.built, first.details):
                self._confirmed.add(key)
            else:
                self._refuse_locked(key)

    def _refuse(self, key: str) -> None:
        with self._lock:
            self._refuse_locked(key)

    def _refuse_locked(self, key: str) -> None:
        self._refused.add(key)
        self._confirmed.discard(key)
        self._first.pop(key, None)



def _build_dataset(frozen: Path, out: Path, spec: TaskSpec, family: TaskFamily, hide, deadline: float,
                   details: dict) -> tuple[list[dict] | None, list[int], list[Problem]]:
    """Run ``build()`` in the sandbox, then parse and check its rows here: the rows, the indices of those that are
    hidden-eval items (hidden from training, never a problem), and the problems."""
    from aitrainsai.isolation import Limits, run_sandboxed

    wall = max(5.0, deadline - time.monotonic())
    max_rows = spec.constraints.max_dataset_size
    result = run_sandboxed([sys.executable, "-I", "-m", "aitrainsai.jobs.probe_child"], job_dir=frozen, out_dir=out,
                           limits=Limits(wall_s=wall, cpu_s=spec.constraints.max_wall_seconds,
                                         memory_mb=JOB_MEMORY_MB,
                                         out_mb=MAX_DATASET_BYTES // 2**20 + 1), hide=hide)
    problems = _child_problems(out / PROBLEMS_FILE)
    if problems:
        return None, [], problems
    if (result.returncode != 0 or not (out / DATASET_FILE).is_file() or result.export_problems
            or problems is None):
        tail = (result.stderr or result.stdout)[-1500:]
        reason = result.reason or "; ".join(result.export_problems[:3]) or "it wrote no dataset"
        return None, [], [Problem(file="dataset.py", message=f"the probe could not run build(): {reason}\n{tail}")]
    rows, problems = read_dataset(out / DATASET_FILE, max_rows)
    if problems:
        return None, [], problems
    distinct = len({json.dumps(row, sort_keys=True) for row in rows})
    if distinct < MIN_DISTINCT_ROWS:  # decided before any row is matched: a verdict on a few rows would tell which
        return None, [], [Problem(file="dataset.py", message=(
            f"build() returned {distinct} distinct rows; at least {MIN_DISTINCT_ROWS} are needed"))]
    overlap = check_overlap(family, rows)
    details["removed_hidden_rows"] = len(overlap.leaked)  # the ledger's, never the agent's
    details["hidden_rows_allowed"] = overlap.allowed
    details["overlap_beyond_chance"] = overlap.beyond_chance
    return rows, overlap.leaked, []


def wall_net(budget_s: float) -> float:
    """The probe's wall-clock limit for a job's code budget of ``budget_s`` CPU seconds: the budget on a quiet
    machine, stretched by how much the machine slows this process when the probe starts (:func:`contention`, at most
    ``MAX_STRETCH`` times): a job that sleeps or hangs still meets it, a loaded machine does not."""
    return budget_s * contention()


def contention(*, loops: int = 3, size: int = 300_000) -> float:
    """How much the machine's load stretches this process's wall time now: the wall time over this thread's CPU time
    of a short fixed loop (the median of ``loops``), from 1 (quiet) to ``MAX_STRETCH``. Only what takes the CPU
    counts: processes that wait (which a job can start by the hundred, raising the load average) do not."""
    ratios = []
    for _ in range(loops):
        wall, cpu = time.perf_counter(), time.thread_time()
        total = 0
        for index in range(size):
            total += index
        ratios.append((time.perf_counter() - wall) / max(time.thread_time() - cpu, 1e-4))
    return min(MAX_STRETCH, max(1.0, statistics.median(ratios)))


@dataclass(frozen=True)
class OverlapCheck:
    """What the probe found of the hidden eval in a dataset: ``leaked``, the rows that hold a hidden item (all of
    them are hidden from training); ``rows`` and ``matched``, the distinct rows and distinct matched rows (a repeated
    row counts once); ``allowed``, how many distinct matches an honest draw of ``rows`` rows holds by chance."""

    leaked: list[int]
    rows: int
    matched: int
    allowed: int

    @property
    def beyond_chance(self) -> bool:
        """More matches than chance explains: a leak (recorded in the ledger; the agent is not told)."""
        return self.matched > self.allowed


def check_overlap(family: TaskFamily, rows: list[dict], leaked: list[int] | None = None) -> OverlapCheck:
    """The probe's overlap rule: hide every row that holds a hidden-eval item from training, and flag the job (in the
    ledger) when more rows match than an honest dataset of its size would by chance.

    Why no refusal. A refusal on a count of matches is a membership oracle: padded with rows known to match up to the
    allowance, a dataset is refused exactly when one more row, the candidate, is a hidden item (a review read the
    hidden set this way, one probe a bit). Hidden rows make a found leak worthless without telling the agent anything.
    The flag tells a leak from the chance collisions of a generator whose low levels have a small item space
    (calc_chain level 1 draws "Kofi starts at 19 and multiplies by 9" again now and then): the allowance is the
    family's own chance rate, :func:`chance_overlap`, measured on a reference draw of the family's public generator at
    every level, bounded from above, and ``allowed`` is the count that a binomial of that rate exceeds with
    probability under ``CHANCE_REFUSAL``: for the installed families 2-3 rows of 16 or 32, 4-6 of 128, 8-12 of 512,
    31-54 of 5,000 (an honest draw is flagged about never: ``core/benchmarks/overlap_false_refusals.py``). Rows are
    counted once each (an oversampled honest dataset repeats its collisions). ``leaked``: ``family.overlap(rows)``
    where the caller has it already (the benchmark)."""
    leaked = family.overlap(rows) if leaked is None else leaked
    distinct = len({json.dumps(row, sort_keys=True) for row in rows})
    matched = len({json.dumps(rows[i], sort_keys=True) for i in leaked})
    return OverlapCheck(leaked, distinct, matched, chance_allowance(chance_overlap(family), distinct))


def chance_overlap(family: TaskFamily) -> float:
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


def _options_key(family: TaskFamily) -> str:
    config = getattr(family, "config", None)
    return config.model_dump_json() if isinstance(config, BaseModel) else repr(config)


_CHANCE_RATES: dict[tuple, float] = {}
_CHANCE_LOCK: dict[tuple, Any] = {}



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


def _check_environment(frozen: Path, spec: TaskSpec, family: TaskFamily, rows: FrozenRows, hide, deadline: float,
                       details: dict) -> list[Problem]:
    """Load the job's environment in a sandbox and judge what it shows: the eval's system prompt and tools, exactly
    the rows of ``dataset.jsonl``, finite rubric scores that tell a right answer from a wrong one on dev examples and
    samples."""
    from aitrainsai.jobs.remote_env import (
        JobEnvironmentError,
        RemoteEnvironment,
        SandboxFailed,
    )
    from aitrainsai.isolation import Limits

    wall = max(10.0, deadline - time.monotonic())
    problems: list[Problem] = []
    entry = ENTRY_FILE[job_format(os.listdir(frozen))]  # environment.py, or a v1 job's taskset.py
    try:
        limits = Limits(wall_s=wall, cpu_s=spec.constraints.max_wall_seconds, memory_mb=JOB_MEMORY_MB)
        with RemoteEnvironment(frozen, limits=limits, hide=hide, call_timeout_s=wall) as env:
            info = env.load()
            if info.system_prompt != spec.eval_interface.system_prompt:
                problems.append(Problem(file=entry, message=(
                    "SYSTEM_PROMPT differs from the eval interface's system prompt; the hidden eval shows the model "
                    f"exactly {spec.eval_interface.system_prompt!r}")))
            expected = [t["function"]["name"] for t in spec.eval_interface.tools]
            missing = sorted(set(expected) - set(info.tool_names))
            if missing:
                problems.append(Problem(file=entry, message=(
                    f"the environment lacks the eval's tools {', '.join(missing)}; the hidden eval offers them")))
            env.checked_rows(info, rows)
            details.update(rows=info.rows, tool_names=info.tool_names,
                           reward_funcs=[f.model_dump() for f in info.reward_funcs],
                           tool_schemas=[s.model_dump() for s in info.tool_schemas], max_turns=info.max_turns)
            samples = _sample_scores(env, spec, family, rows)
            scores = [sample.reward for sample in samples]
            details["rubric_scores"] = scores
            details["samples"] = samples  # into probe.json, not the ledger
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
        problems.append(Problem(file=exc.file or entry, line=exc.line,
                                message=f"the probe could not run your job: {exc.message}"))
    return problems


def _sample_scores(env, spec: TaskSpec, family: TaskFamily, rows: FrozenRows) -> list[ProbeSample]:
    """Rubric scores of the dev examples' reference transcripts, and of right, wrong and empty replies to the first
    ``SAMPLE_ROWS`` rows."""
    from aitrainsai.jobs.remote_env import JobEnvironmentError

    samples: list[tuple[dict[str, Any], list[Message], str]] = []
    for example in spec.dev_examples:
        item = example.item
        dev = {"prompt": [{"role": "system", "content": spec.eval_interface.system_prompt},
                          {"role": "user", "content": item.question}],
               "answer": item.answer, "info": json.dumps({"world": item.world}), "example_id": -1}
        completion = example.transcript[len(family.initial_messages(item)):]
        samples.append((dev, completion, "a dev example's reference transcript"))
    for index, row in enumerate(rows.rows[:SAMPLE_ROWS]):
        data = rows.row_data(index)
        right: list[Message] = [{"role": "assistant", "content": f"<answer>{row.answer}</answer>"}]
        samples.append((data, right, "the right answer"))
        samples.append((data, [{"role": "assistant", "content": "<answer>no idea</answer>"}], "a wrong answer"))
        samples.append((data, [{"role": "assistant", "content": ""}], "an empty reply"))
    scored = []
    for sample, completion, label in samples:
        try:
            state = env.start(row_data=sample)
            reward = env.score(state, completion).reward
        except JobEnvironmentError as exc:
            raise JobEnvironmentError(f"scoring {label}: {exc.message}", exc.file or "rubric.py", exc.line) from None
        scored.append(ProbeSample(label=label, row_data=sample, completion=completion, reward=reward))
    return scored
