"""Train on each family's own scorer and measure hidden-eval uplift: the trainer alone, without an agent's job.

Run: .venv/bin/python plugins/trainer_local/benchmarks/family_uplift.py [--families calc_chain,multi_hop] [--steps 20]
For each family: pre score of the base on the hidden eval, GRPO + LoRA on fresh items (another seed than the hidden
set) rewarded by the family's scorer, post score of the saved adapter, paired-bootstrap interval of the uplift.
Stops starting families once ``--budget-seconds`` has passed. Writes JSON after each family and prints a table.
On a machine with a GPU the same code runs there (bf16).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_SEED = 20_261_129


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", help="comma-separated family names (default: all installed)")
    parser.add_argument("--level", type=int, help="default: each family's default level")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--budget-seconds", type=float, default=float("inf"))
    parser.add_argument("--out", default=str(HERE / "family_uplift.json"))
    args = parser.parse_args()

    import torch

    from aitrainsai import Plugins
    from aitrainsai_trainer_local.evaluate import evaluate, paired_bootstrap
    from aitrainsai_trainer_local.grpo import GRPOConfig, GRPOTrainer, family_examples
    from aitrainsai_trainer_local.lora import LoraModel

    started = time.monotonic()
    registry = Plugins.load().task_families
    names = args.families.split(",") if args.families else registry.names()
    base = LoraModel.load()
    results: dict = {"device": str(base.device), "dtype": str(base.dtype),
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                     "settings": {k: v for k, v in vars(args).items() if k not in ("families", "out")}, "rows": {}}
    for name in names:
        if time.monotonic() - started > args.budget_seconds:
            print(f"{name}: skipped (budget spent)", flush=True)
            continue
        family = registry.get(name)()
        level = args.level or family.default_level
        hidden = family.hidden_eval(args.eval_size, level)
        t0 = time.monotonic()
        pre = evaluate(base, family, hidden, max_new_tokens=args.max_new_tokens, batch_size=args.eval_size)
        eval_seconds = time.monotonic() - t0
        config = GRPOConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate)
        trainer = GRPOTrainer(config, family_examples(family, family.generate(TRAIN_SEED, level, 512)))
        t0 = time.monotonic()
        history = trainer.train(lambda m, name=name: print(f"  {name} step {m.step}: reward {m.reward_mean:.3f} "
                                                           f"({m.seconds_total:.1f} s)", flush=True))
        train_seconds = time.monotonic() - t0
        with tempfile.TemporaryDirectory() as tmp:
            adapter = trainer.save(Path(tmp) / "adapter")
            del trainer
            post_policy = LoraModel.load(adapter=adapter)
            post = evaluate(post_policy, family, hidden, max_new_tokens=args.max_new_tokens,
                            batch_size=args.eval_size)
        low, high = paired_bootstrap(pre, post)
        steps = [m.to_dict() for m in history]
        results["rows"][name] = {
            "level": level, "eval_size": len(hidden), "pre": sum(pre) / len(pre), "post": sum(post) / len(post),
            "uplift": (sum(post) - sum(pre)) / len(pre), "uplift_ci": [low, high],
            "train_reward_first_last": [steps[0]["reward_mean"], steps[-1]["reward_mean"]],
            "seconds_per_step": train_seconds / len(steps), "eval_seconds": eval_seconds,
            "step_seconds_split": {key: sum(s[f"seconds_{key}"] for s in steps) / len(steps)
                                   for key in ("generation", "scoring", "forward_backward")},
        }
        row = results["rows"][name]
        print(f"{name}: pre {row['pre']:.3f} post {row['post']:.3f} uplift {row['uplift']:+.3f} "
              f"[{low:+.3f}, {high:+.3f}] {row['seconds_per_step']:.1f} s/step", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def table(results: dict) -> str:
    lines = ["| family (level) | pre | post | uplift (95% CI) | train reward first → last | s/step | eval s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        first, last = r["train_reward_first_last"]
        low, high = r["uplift_ci"]
        lines.append(f"| {name} ({r['level']}) | {r['pre']:.3f} | {r['post']:.3f} | {r['uplift']:+.3f} "
                     f"({low:+.3f} .. {high:+.3f}) | {first:.2f} → {last:.2f} | {r['seconds_per_step']:.1f} | "
                     f"{r['eval_seconds']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
