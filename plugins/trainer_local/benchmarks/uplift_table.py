"""The uplift table: each family's reference job (and the control) run end to end by the local trainer.

Run: .venv/bin/python plugins/trainer_local/benchmarks/uplift_table.py [--only calc_chain,control] [--eval-size 48]
    [--seeds 0,1,2] [--repeats 2] [--steps 8] [--job-format verifiers-v1]
Writes uplift_table.json and prints the markdown table. ``--seeds`` trains each job once per seed (the job's
``seed`` in trainer.toml, a copy of the job): the spread across seeds is the training run's own variance, which the
uplift interval (a bootstrap over eval items) does not include. ``--repeats`` runs each (job, seed) that many times,
the same job again (the noise of the run itself: sampling, the eval); ``--steps`` overrides the jobs' step count.
With more than one run of a job, a noise summary follows the table. ``--job-format verifiers-v1`` runs each job in
the verifiers v1 format instead: its ``v1/rubric.py`` (the same rewards as ``@vf.reward`` methods) with the job's
``dataset.py`` and ``trainer.toml``, ``taskset.py`` from the task's template; those rows are named ``<job> (v1)``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS = HERE.parent / "reference_jobs"
FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]
CONTROL_FAMILY = "multi_hop"
FORMATS = ["verifiers", "verifiers-v1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="comma-separated rows (family names, or control)")
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--runs-dir", default=str(HERE / "runs-uplift"))
    parser.add_argument("--out", default=str(HERE / "uplift_table.json"))
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds (default: 0, the jobs' own)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (job, seed)")
    parser.add_argument("--steps", type=int, help="GRPO steps of every job (default: each job's own)")
    parser.add_argument("--job-format", choices=FORMATS, default="verifiers",
                        help="the jobs' format (verifiers-v1: each job's v1/rubric.py; rows named '<job> (v1)')")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else FAMILIES + ["control"]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    from aitrainsai import Ledger

    results = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    runs = [(name, seed, repeat) for name in names for seed in seeds for repeat in range(args.repeats)]
    for name, seed, repeat in runs:
        v1 = args.job_format == "verifiers-v1"
        row = (name + (" (v1)" if v1 else "") + (f" seed {seed}" if seed else "") +
               (f" (steps {args.steps})" if args.steps else "") + (f" repeat {repeat + 1}" if repeat else ""))
        family = CONTROL_FAMILY if name == "control" else name
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            job = seeded(JOBS / name, Path(scratch) / name, seed, args.steps, args.job_format)
            command = [sys.executable, "-m", "aitrainsai.cli", "--runs-dir", args.runs_dir, "job", "run", "--family",
                       family, "--dir", str(job), "-s", f"inner_trainer.local.eval_size={args.eval_size}",
                       "-s", "inner_trainer.local.max_wall_seconds=2400",
                       "-s", "inner_trainer.local.max_train_steps=40"]
            command += ["-s", f"families.job_format={args.job_format}"] if v1 else []
            out = subprocess.run(command, capture_output=True, text=True, check=False)
        print(out.stdout[-600:], out.stderr[-1500:] if out.returncode else "", flush=True)
        run = Ledger(args.runs_dir).run("latest")
        (job,) = run.jobs() or [None]
        result = job.progress if job else None
        steps = ((result.metrics if result else None) or {}).get("steps", [])
        results[row] = {
            "family": family, "status": job.state.value if job else "no job",
            "pre": result and result.pre, "post": result and result.post, "uplift": result and result.uplift,
            "uplift_ci": result and result.uplift_ci, "eval_size": result and result.eval_size,
            "train_seconds": result and result.train_seconds, "wall_seconds": time.monotonic() - started,
            "train_reward_first_last": [steps[0]["reward_mean"], steps[-1]["reward_mean"]] if steps else None,
            "run": run.id, "job_format": args.job_format,
        }
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))
    print(noise(results))


def seeded(job: Path, into: Path, seed: int, steps: int | None = None, job_format: str = "verifiers") -> Path:
    """A copy of a reference job whose trainer.toml trains with ``seed`` (and ``steps``); in the verifiers v1 format,
    with the job's ``v1/rubric.py`` as its rubric (``taskset.py`` comes from the task's template)."""
    shutil.copytree(job, into, ignore=shutil.ignore_patterns("v1", "__pycache__"))
    if job_format == "verifiers-v1":
        shutil.copyfile(job / "v1" / "rubric.py", into / "rubric.py")
    config = into / "trainer.toml"
    text, count = re.subn(r"(?m)^seed = .*$", f"seed = {seed}", config.read_text())
    text = text if count else text + f"seed = {seed}\n"
    if steps:
        text = re.sub(r"(?m)^steps = .*$", f"steps = {steps}", text)
    config.write_text(text)
    return into


def noise(results: dict) -> str:
    """Per job (rows that differ only in seed or repeat): the uplift's spread over its runs, against the width of
    one run's interval (a bootstrap over eval items)."""
    from statistics import mean, pstdev

    groups: dict[str, list[dict]] = {}
    for row, r in results.items():
        if r.get("uplift") is not None:
            key = re.sub(r" seed \d+| repeat \d+", "", row)
            groups.setdefault(key, []).append({**r, "row": row})
    lines = []
    for key, rows in groups.items():
        if len(rows) < 2:
            continue
        uplifts = [r["uplift"] for r in rows]
        halves = [(r["uplift_ci"][1] - r["uplift_ci"][0]) / 2 for r in rows]
        lines.append(f"- {key}: {len(rows)} runs, uplift {', '.join(f'{u:+.3f}' for u in uplifts)}; mean "
                     f"{mean(uplifts):+.3f}, spread (sd) {pstdev(uplifts):.3f}, "
                     f"range {max(uplifts) - min(uplifts):.3f}; "
                     f"one run's interval half-width {mean(halves):.3f} on {rows[0]['eval_size']} items")
    return "\n".join(["", "Noise:", *lines]) if lines else ""


def table(results: dict) -> str:
    lines = ["| job | pre | post | uplift (95% CI) | train reward first → last step | training s | wall s |",
             "|---|---|---|---|---|---|---|"]
    for row, r in results.items():
        if r["post"] is None:
            lines.append(f"| {row} | - | - | {r['status']} | - | - | {r['wall_seconds']:.0f} |")
            continue
        low, high = r["uplift_ci"]
        curve = "{:.2f} → {:.2f}".format(*r["train_reward_first_last"]) if r["train_reward_first_last"] else "-"
        label = f"{row} ({r['family']}, length rubric)" if row.startswith("control") else row
        lines.append(f"| {label} | {r['pre']:.3f} | {r['post']:.3f} | {r['uplift']:+.3f} ({low:+.3f} .. {high:+.3f}) | "
                     f"{curve} | {r['train_seconds']:.0f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
