"""The job format, its template, and the validation probe.

A job is four files the agent writes in its workspace:

- ``environment.py`` — a verifiers (0.2.x, classic API) environment: ``load_environment(**kwargs)`` presenting the
  family's eval interface (system prompt, tools, answer format) over the rows of ``dataset.jsonl``;
- ``rubric.py`` — the reward functions the inner GRPO optimises (``build_rubric(parser) -> vf.Rubric``);
- ``dataset.py`` — ``build() -> list[dict]``, the training rows ``{"question", "answer", "world"}``; the probe runs it
  once and freezes the result as ``dataset.jsonl``;
- ``trainer.toml`` — the trainer config, whose schema the inner trainer owns.

The probe checks a job statically (files, config schema, constraints) and then dynamically inside the sandbox
(imports, dataset, rubric on the dev examples and on samples). An accepted job is frozen into a directory of its own:
the workspace files plus ``dataset.jsonl``. See :mod:`aitrainsai.verifiers_env` for why verifiers 0.2.x.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitrainsai.trainers import Problem

if TYPE_CHECKING:
    from aitrainsai.families import TaskFamily, TaskSpec
    from aitrainsai.trainers import InnerTrainer

REQUIRED_FILES = ("environment.py", "rubric.py", "dataset.py", "trainer.toml")
DATASET_FILE = "dataset.jsonl"
FROZEN_DIR = "job"
REPORT_FILE = "report.json"
INPUT_FILE = "probe_input.json"
ACCIDENTAL_OVERLAP = 0.02  # up to this share of rows may match hidden items by chance; they are removed


@dataclass
class ProbeReport:
    ok: bool
    problems: list[Problem]
    seconds: float
    job_dir: Path | None = None
    rows: int = 0
    details: dict[str, Any] = field(default_factory=dict)

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

from {package} import TOOLS
from rubric import build_rubric

SYSTEM_PROMPT = {interface.system_prompt!r}
MAX_TURNS = {interface.turn_limit}
HERE = Path(__file__).resolve().parent


class FamilyEnv(vf.StatefulToolEnv):
    """The family's tools; their hidden first argument, the item's world, comes from the row's info."""

    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        for tool in TOOLS:
            tool.__annotations__ = typing.get_type_hints(tool)  # resolved, so that verifiers can read them
            hidden = ["world"] if tool.__code__.co_varnames[:1] == ("world",) else []
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
eval's; rows that are hidden-eval items are refused.
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


def private_paths(families: list[type]) -> list[Path]:
    """Files agent code must not read: every module of each family package that is not public, and bytecode caches."""
    import importlib
    import importlib.util

    hidden: set[Path] = set()
    for family in families:
        package = importlib.import_module(family.__module__.split(".")[0])
        root = Path(package.__file__).resolve().parent
        public = {Path(importlib.util.find_spec(name).origin).resolve() for name in family.public_modules}
        hidden.update(path for path in root.rglob("*.py") if path.resolve() not in public)
        hidden.update(root.rglob("__pycache__"))
    return sorted(hidden)


def probe_job(workspace: Path, out_dir: Path, spec: "TaskSpec", family: "TaskFamily", trainer: "InnerTrainer",
              *, hide: list[Path] = (), expose: list[Path] = (), wall_s: float = 90.0) -> ProbeReport:
    """Check a job; on success its frozen copy is ``out_dir/job``."""
    from aitrainsai.sandbox import Limits, run_sandboxed

    start = time.monotonic()
    workspace = Path(workspace)
    problems: list[Problem] = []
    for name in REQUIRED_FILES:
        if not (workspace / name).is_file():
            problems.append(Problem(file=name, message="missing: write it (the task spec shows a template)"))
    if (workspace / "trainer.toml").is_file():
        problems.extend(trainer.probe(workspace, spec))
    if any(not (workspace / name).is_file() for name in ("environment.py", "rubric.py", "dataset.py")):
        return ProbeReport(False, problems, time.monotonic() - start)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = []
    for example in spec.dev_examples:
        prompt = family.initial_messages(example.item)
        dev.append({"question": example.item.question, "answer": example.item.answer, "world": example.item.world,
                    "completion": example.transcript[len(prompt):]})
    (out_dir / INPUT_FILE).write_text(json.dumps({
        "system_prompt": spec.eval_interface.system_prompt,
        "tool_names": [t["function"]["name"] for t in spec.eval_interface.tools],
        "max_rows": spec.constraints.max_dataset_size,
        "dev_examples": dev,
    }))
    result = run_sandboxed([sys.executable, "-m", "aitrainsai.probe_child"], job_dir=workspace, out_dir=out_dir,
                           limits=Limits(wall_s=wall_s, cpu_s=int(wall_s), memory_mb=6_144), hide=hide, expose=expose)
    report_path = out_dir / REPORT_FILE
    report: dict[str, Any] = {}
    if report_path.is_file():
        try:
            report = json.loads(report_path.read_text())
        except ValueError:
            report = {}
    if not report:
        reason = result.reason or "it wrote no report"
        tail = (result.stderr or result.stdout)[-1500:]
        problems.append(Problem(file="environment.py", message=f"the probe could not run your job: {reason}\n{tail}"))
        return ProbeReport(False, problems, time.monotonic() - start)
    problems.extend(Problem(**p) for p in report.get("problems", []))
    frozen = out_dir / FROZEN_DIR
    rows = _read_rows(frozen / DATASET_FILE)
    removed = 0
    if rows:
        leaked = family.overlap(rows)
        if len(leaked) > ACCIDENTAL_OVERLAP * len(rows):
            shown = ", ".join(str(i) for i in leaked[:10])
            problems.append(Problem(file="dataset.py", message=(
                f"{len(leaked)} rows are hidden-eval items (rows {shown}{', ...' if len(leaked) > 10 else ''}); "
                "training on the eval is not allowed: generate with another seed")))
        elif leaked:  # a few chance collisions of a generator with a small question space: drop them
            skip = set(leaked)
            rows = [row for i, row in enumerate(rows) if i not in skip]
            (frozen / DATASET_FILE).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
            removed = len(skip)
        if len(rows) > spec.constraints.max_dataset_size:
            problems.append(Problem(file="dataset.py", message=(
                f"build() returned {len(rows)} rows; the cap is {spec.constraints.max_dataset_size}")))
    ok = not problems
    report["removed_hidden_rows"] = removed
    return ProbeReport(ok, problems, time.monotonic() - start, frozen if ok else None, len(rows), report)


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                return []
    return rows
