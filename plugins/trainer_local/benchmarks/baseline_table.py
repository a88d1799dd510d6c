"""The baseline table: the untrained local base model on each family's hidden eval at every level.

Run: .venv/bin/python plugins/trainer_local/benchmarks/baseline_table.py [--eval-size 48] [--only ledger]
    [--levels 1]
Greedy, with the family's system prompt, tools and turn limit, as the local trainer's pre/post eval runs.
Writes baseline_table.json and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(HERE / "baseline_table.json"))
    parser.add_argument("--only", help="comma-separated families (default: every installed one)")
    parser.add_argument("--levels", help="comma-separated levels (default: each family's all)")
    args = parser.parse_args()
    from aitrainsai import Plugins
    from aitrainsai_trainer_local.evaluate import evaluate
    from aitrainsai_trainer_local.lora import LoraModel

    policy = LoraModel.load()
    registry = Plugins.load().task_families
    results: dict[str, dict[str, float]] = {}
    for name in args.only.split(",") if args.only else registry.names():
        family = registry.get(name)()
        results[name] = {}
        for level in [int(x) for x in args.levels.split(",")] if args.levels else family.levels:
            started = time.monotonic()
            items = family.hidden_eval(args.eval_size, level)
            scores = evaluate(policy, family, items, max_new_tokens=args.max_new_tokens, batch_size=args.eval_size)
            results[name][str(level)] = sum(scores) / len(scores)
            print(f"{name} level {level}: {results[name][str(level)]:.3f} ({time.monotonic() - started:.0f} s)",
                  flush=True)
        Path(args.out).write_text(json.dumps({"eval_size": args.eval_size, "scores": results}, indent=2))
    levels = sorted({level for row in results.values() for level in row}, key=int)
    print("| family | " + " | ".join(f"level {level}" for level in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[level]:.3f}" if level in row else "-" for level in levels) + " |")


if __name__ == "__main__":
    main()
