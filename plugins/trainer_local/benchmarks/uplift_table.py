"""The uplift table: each family's reference job (and the control) run end to end by the local trainer.

Run: .venv/bin/python plugins/trainer_local/benchmarks/uplift_table.py [--only calc_chain,control] [--eval-size 48]
    [--seeds 0,1,2]
Writes uplift_table.json and prints the markdown table. ``--seeds`` trains each job once per seed (the job's
``seed`` in trainer.toml, a copy of the job): the spread across seeds is the training run's own variance, which the
uplift interval (a bootstrap over eval items) does not include.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="comma-separated rows (family names, or control)")
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--runs-dir", default=str(HERE / "runs-uplift"))
    parser.add_argument("--out", default=str(HERE / "uplift_table.json"))
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds (default: 0, the jobs' own)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else FAMILIES + ["control"]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    from aitrainsai.ledger import Ledger

    results = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    for name, seed in [(name, seed) for name in names for seed in seeds]:
        row = name if seed == 0 else f"{name} seed {seed}"
        family = CONTROL_FAMILY if name == "control" else name
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            job = seeded(JOBS / name, Path(scratch) / name, seed)
            command = [sys.executable, "-m", "aitrainsai.cli", "--runs-dir", args.runs_dir, "job", "run", "--family",
                       family, "--dir", str(job), "-s", f"inner_trainer.local.eval_size={args.eval_size}",
                       "-s", "inner_trainer.local.max_wall_seconds=2400",
                       "-s", "inner_trainer.local.max_train_steps=40"]
            out = subprocess.run(command, capture_output=True, text=True, check=False)
        print(out.stdout[-600:], out.stderr[-1500:] if out.returncode else "", flush=True)
        run = Ledger(args.runs_dir).run("latest")
        (job,) = run.jobs() or [None]
        result = (job or {}).get("result") or {}
        steps = (result.get("metrics") or {}).get("steps", [])
        results[row] = {
            "family": family, "status": job["status"] if job else "no job",
            "pre": result.get("pre"), "post": result.get("post"), "uplift": result.get("uplift"),
            "uplift_ci": result.get("uplift_ci"), "eval_size": result.get("eval_size"),
            "train_seconds": result.get("train_seconds"), "wall_seconds": time.monotonic() - started,
            "train_reward_first_last": [steps[0]["reward_mean"], steps[-1]["reward_mean"]] if steps else None,
            "run": run.id,
        }
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def seeded(job: Path, into: Path, seed: int) -> Path:
    """A copy of a reference job whose trainer.toml trains with ``seed``."""
    shutil.copytree(job, into)
    config = into / "trainer.toml"
    text, count = re.subn(r"(?m)^seed = .*$", f"seed = {seed}", config.read_text())
    config.write_text(text if count else text + f"seed = {seed}\n")
    return into


def table(results: dict) -> str:
    lines = ["| job | pre | post | uplift (95% CI) | train reward first → last step | training s | wall s |",
             "|---|---|---|---|---|---|---|"]
    for row, r in results.items():
        if r["post"] is None:
            lines.append(f"| {row} | - | - | {r['status']} | - | - | {r['wall_seconds']:.0f} |")
            continue
        low, high = r["uplift_ci"]
        curve = "{:.2f} → {:.2f}".format(*r["train_reward_first_last"]) if r["train_reward_first_last"] else "-"
        lines.append(f"| {row}{' (' + r['family'] + ', length rubric)' if row.startswith('control') else ''} | {r['pre']:.3f} | "
                     f"{r['post']:.3f} | {r['uplift']:+.3f} ({low:+.3f} .. {high:+.3f}) | {curve} | "
                     f"{r['train_seconds']:.0f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
