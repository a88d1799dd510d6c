"""The trusted driver of a local training or baseline payload: ``python -m aitrainsai_trainer_local.job job.json``.

``train``: runs :mod:`aitrainsai_trainer_local.train_child` in the sandbox on the frozen job (agent code runs only
there), then scores the adapter it saved on the family's hidden eval and writes ``result.json`` with pre, post, the
uplift and its paired bootstrap interval. ``baseline``: scores the untrained base model and writes ``baseline.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from aitrainsai_trainer_local.inner import BASELINE_FILE, RESULT_FILE


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from aitrainsai.plugins import Plugins

    families = Plugins.load().task_families
    family = families.get(spec["family"])()
    items = family.hidden_eval(spec["eval_size"], spec["level"])
    spec["families"] = [families.get(name) for name in families.names()]
    if spec["mode"] == "baseline":
        scores = _evaluate(family, items, spec["trainer"], adapter=None)
        Path(BASELINE_FILE).write_text(json.dumps({
            "family": family.name, "level": spec["level"], "base_model": spec["base_model"],
            "eval_seed": family.eval_seed, "eval_size": len(items), "score": sum(scores) / len(scores),
            "item_scores": scores}))
        print(f"baseline {spec['base_model']} on {family.name} level {spec['level']}: {sum(scores) / len(scores):.3f}")
        return 0
    return _train(spec, family, items)


def _train(spec: dict, family, items) -> int:
    from aitrainsai.jobs import private_paths
    from aitrainsai.sandbox import Limits, run_sandboxed
    from aitrainsai_trainer_local.evaluate import paired_bootstrap
    from aitrainsai_trainer_local.model import cache_root, converted_checkpoint

    converted_checkpoint()  # before the sandbox, which can read the cache but not write it
    out = Path("train_out")
    trainer = spec["trainer"]
    limits = Limits(wall_s=spec["wall_s"], cpu_s=spec["wall_s"] * (os.cpu_count() or 1),
                    memory_mb=trainer["memory_gb"] * 1024, processes=1_024, open_files=1_024, tmp_mb=1_024,
                    out_mb=1_024)
    env = {"AITRAINSAI_CACHE_DIR": str(cache_root()), "AITRAINSAI_DTYPE": trainer["dtype"]}
    job_dir = Path(spec["job_dir"])
    runs_dir = next((p for p in job_dir.parents if (p / "ledger.sqlite").exists()), None)
    hide = private_paths(spec["families"]) + ([runs_dir] if runs_dir else [])
    started = time.monotonic()
    result = run_sandboxed([sys.executable, "-m", "aitrainsai_trainer_local.train_child"],
                           job_dir=job_dir, out_dir=out, limits=limits, hide=hide, expose=[cache_root()], env=env)
    train_seconds = time.monotonic() - started
    print(result.stdout[-20_000:])
    print(result.stderr[-20_000:], flush=True)
    if result.returncode != 0 or not (out / "adapter").is_dir():
        print(f"training failed: {result.reason or 'no adapter was saved'}", flush=True)
        return 1
    post_scores = _evaluate(family, items, trainer, adapter=out / "adapter")
    pre_scores = spec["pre_item_scores"]
    post = sum(post_scores) / len(post_scores)
    low, high = paired_bootstrap(pre_scores, post_scores)
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    Path(RESULT_FILE).write_text(json.dumps({
        "base_model": spec["base_model"], "pre": spec["pre"], "post": post,
        "uplift": post - spec["pre"], "uplift_ci": [low, high], "eval_size": len(items),
        "train_seconds": train_seconds, "metrics": {**metrics, "post_item_scores": post_scores}}))
    print(f"pre {spec['pre']:.3f} -> post {post:.3f}, uplift CI [{low:+.3f}, {high:+.3f}]")
    return 0


def _evaluate(family, items, trainer: dict, adapter: Path | None) -> list[float]:
    from aitrainsai_trainer_local.evaluate import evaluate
    from aitrainsai_trainer_local.policy import Policy

    policy = Policy.load(adapter=adapter, dtype=trainer["dtype"])
    return evaluate(policy, family, items, max_new_tokens=trainer["eval_max_new_tokens"],
                    batch_size=trainer["eval_batch_size"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
