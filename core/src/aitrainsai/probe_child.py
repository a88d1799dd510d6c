"""The dynamic half of the validation probe. Runs inside the sandbox: agent code is imported here and nowhere
trusted. Reads ``/tmp/out/probe_input.json``; writes ``/tmp/out/report.json`` and the frozen job in ``/tmp/out/job``."""

from __future__ import annotations

import json
import math
import shutil
import sys
import traceback
from pathlib import Path

OUT = Path("/tmp/out")
SOURCE = Path("/tmp/job")
SAMPLE_ROWS = 8


def main() -> None:
    spec = json.loads((OUT / "probe_input.json").read_text())
    job = OUT / "job"
    shutil.copytree(SOURCE, job, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "dataset.jsonl"))
    sys.path.insert(0, str(job))
    problems: list[dict] = []
    report: dict = {"problems": problems}
    try:
        rows = _dataset(job, spec, problems)
        if rows is not None:
            _environment(job, spec, rows, problems, report)
    except BaseException as exc:  # report everything, whatever agent code raised
        problems.append(_problem(exc, "environment.py", job))
    (OUT / "report.json").write_text(json.dumps(report, default=str))


def _dataset(job: Path, spec: dict, problems: list[dict]) -> list[dict] | None:
    try:
        import dataset  # the job's dataset.py

        rows = dataset.build()
    except BaseException as exc:
        problems.append(_problem(exc, "dataset.py", job))
        return None
    if not isinstance(rows, list):
        problems.append({"file": "dataset.py", "message": f"build() must return a list of dicts, not {type(rows).__name__}"})
        return None
    if not rows:
        problems.append({"file": "dataset.py", "message": "build() returned no rows"})
        return None
    if len(rows) > spec["max_rows"]:
        problems.append({"file": "dataset.py", "message": f"build() returned {len(rows)} rows; the cap is {spec['max_rows']}"})
        rows = rows[: spec["max_rows"]]
    lines = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            problems.append({"file": "dataset.py", "message": (
                f"row {index} must be a dict with 'question' (str), 'answer' and 'world' (dict); got {str(row)[:120]}")})
            return None
        if not isinstance(row.get("world", {}), dict):
            problems.append({"file": "dataset.py", "message": f"row {index}: 'world' must be a dict"})
            return None
        try:
            lines.append(json.dumps({"question": row["question"], "answer": str(row["answer"]),
                                     "world": row.get("world", {})}, sort_keys=True))
        except (TypeError, ValueError) as exc:
            problems.append({"file": "dataset.py", "message": f"row {index} is not JSON-serialisable: {exc}"})
            return None
    (job / "dataset.jsonl").write_text("\n".join(lines) + "\n")
    return [json.loads(line) for line in lines]


def _environment(job: Path, spec: dict, rows: list[dict], problems: list[dict], report: dict) -> None:
    from aitrainsai.verifiers_env import JobEnvironment

    try:
        env = JobEnvironment(job)
    except BaseException as exc:
        problems.append(_problem(exc, "environment.py", job))
        return
    if env.system_prompt != spec["system_prompt"]:
        problems.append({"file": "environment.py", "message": (
            "SYSTEM_PROMPT differs from the eval interface's system prompt; the hidden eval shows the model exactly "
            f"{spec['system_prompt']!r}")})
    missing = sorted(set(spec["tool_names"]) - set(env.tool_names()))
    if missing:
        problems.append({"file": "environment.py", "message": (
            f"the environment lacks the eval's tools {', '.join(missing)}; the hidden eval offers them")})
    try:
        env_rows = env.rows()
    except BaseException as exc:
        problems.append(_problem(exc, "environment.py", job))
        return
    if len(env_rows) != len(rows):
        problems.append({"file": "environment.py", "message": (
            f"load_environment() has {len(env_rows)} rows but dataset.jsonl has {len(rows)}: train on dataset.jsonl")})
    report["rows"] = len(env_rows)
    report["tool_names"] = env.tool_names()
    scores: list[float] = []
    samples = []
    for example in spec["dev_examples"]:
        samples.append((_as_row(env, example), example["completion"], "a dev example's reference transcript"))
    for row in env_rows[:SAMPLE_ROWS]:
        answer = str(row.get("answer", ""))
        samples.append((row, [{"role": "assistant", "content": f"<answer>{answer}</answer>"}], "the right answer"))
        samples.append((row, [{"role": "assistant", "content": "<answer>no idea</answer>"}], "a wrong answer"))
        samples.append((row, [{"role": "assistant", "content": ""}], "an empty reply"))
    for row, completion, label in samples:
        try:
            reward, _ = env.score_sync(row, completion)
        except BaseException as exc:
            problem = _problem(exc, "rubric.py", job)
            problem["message"] = f"scoring {label}: {problem['message']}"
            problems.append(problem)
            return
        if not math.isfinite(reward):
            problems.append({"file": "rubric.py", "message": f"scoring {label} gave {reward}"})
            return
        scores.append(reward)
    report["rubric_scores"] = scores
    if env.reward_errors:
        problems.append({"file": "rubric.py", "message": "reward functions failed while scoring samples (verifiers "
                         "scores a failure 0): " + "; ".join(sorted(set(env.reward_errors))[:5])})
        return
    if len({round(s, 9) for s in scores}) == 1:
        problems.append({"file": "rubric.py", "message": (
            f"every sample scored {scores[0]:g} (right answers, wrong answers, empty replies alike): a GRPO group "
            "with no variance teaches nothing; reward what the eval checks")})


def _as_row(env, example: dict) -> dict:
    prompt = [{"role": "system", "content": env.system_prompt or ""}, {"role": "user", "content": example["question"]}]
    return {"prompt": prompt, "answer": example["answer"], "info": json.dumps({"world": example["world"]}),
            "example_id": -1}


def _problem(exc: BaseException, default_file: str, job: Path) -> dict:
    file, line = default_file, None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.parent == job:
            file, line = path.name, frame.lineno
    text = f"{type(exc).__name__}: {exc}"
    return {"file": file, "line": line, "message": text[:800]}


if __name__ == "__main__":
    main()
