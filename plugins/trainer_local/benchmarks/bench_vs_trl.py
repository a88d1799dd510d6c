"""This engine's GRPO step against TRL's ``GRPOTrainer``, on the same model, task and batch shape, in one process.

Task: single-digit addition, "Compute a + b. Reply with only the number.", reward 1 if the last number in the reply
is a + b. Shape: 4 prompts x 8 samples per step, 16 new tokens, temperature 1.0, LoRA r=16 alpha=32 on all linear
projections, lr 2e-4 (constant), AdamW, gradient norm clipped at 1.0, one on-policy step per batch.
The 100 possible problems are split: 64 for the greedy eval (held out), 36 to train on.

    .venv/bin/python plugins/trainer_local/benchmarks/bench_vs_trl.py                 # 25 steps each
    .venv/bin/python plugins/trainer_local/benchmarks/bench_vs_trl.py --steps 3       # a quick check

Prints seconds per step (median) for each trainer and their ratio, the reward at steps 1/15/25 (or the last step),
this engine's greedy eval before and after training with a paired bootstrap 95% interval, and where this engine's
step time goes: a phase table (generation, log-probs, backward, optimizer; medians over the steps) with each phase's
matmul work and its rate against this machine's limit, bf16 matmul throughput on these cores measured first by the
script itself; then the hidden eval's greedy generation batched against the same items one by one. Writes every
figure to a JSON file (``--out``, default beside this script). TRL runs in fp32 as in the
project's reference runs (``--trl-bf16`` gives it bf16 autocast) and with gradient checkpointing off (TRL turns it on
by default; here it would only cost time); both run with every CPU core as torch threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from aitrainsai import Item, TaskFamily, ToolSession, final_reply
from aitrainsai import evaluate_items
from aitrainsai_trainer_local.engine import LocalChatEngine
from aitrainsai_trainer_local.evaluate import evaluate, paired_bootstrap
from aitrainsai_trainer_local.llama import linear
from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer
from aitrainsai_trainer_local.model import BASE_MODEL, converted_checkpoint
from aitrainsai_trainer_local.lora import LoraModel
from aitrainsai_trainer_local.rollout import Conversation

PROMPT = "Compute {a} + {b}. Reply with only the number."
INTEGER = re.compile(r"-?\d+")


def last_number_reward(reply: str, answer: int) -> float:
    numbers = INTEGER.findall(reply or "")
    return float(bool(numbers) and int(numbers[-1]) == answer)


class Addition(TaskFamily):
    """Single-digit addition as a family, for the engine's evaluate(); scored like the training reward."""

    name = "bench_addition"
    goal = "Add two single-digit numbers."
    system_prompt = ""
    turn_limit = 1
    public_modules = ()

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(seed).shuffle(pairs)
        return [Item(family=self.name, level=level, seed=seed, index=i, question=PROMPT.format(a=a, b=b),
                     answer=str(a + b)) for i, (a, b) in enumerate(pairs[:n])]

    def initial_messages(self, item: Item) -> list[dict]:
        return [{"role": "user", "content": item.question}]

    def score(self, item: Item, transcript) -> float:
        return last_number_reward(final_reply(transcript), int(item.answer))

    def solve(self, item: Item, session: ToolSession) -> str:
        a, b = map(int, INTEGER.findall(item.question)[:2])
        return str(a + b)


def split(seed: int, eval_items: int) -> tuple[list[Item], list[Item]]:
    items = Addition().generate(seed, 1, 100)
    return items[:eval_items], items[eval_items:]


def matmul_limit(reps: int = 20) -> dict:
    """bf16 matmul throughput here (GFLOP/s), through the engine's own linear (oneDNN, packed weights) and plain
    ``F.linear``, at the step's shapes: the training pass (512 rows) and a decode step (32 rows) against the model's
    largest projection (576 -> 3072), and the vocabulary projection. The limit is the best rate seen."""
    shapes = {"training, 512 x 576 -> 3072": (512, 576, 3072), "decode, 32 x 576 -> 3072": (32, 576, 3072),
              "vocabulary, 256 x 576 -> 49152": (256, 576, 49152)}
    rates: dict[str, dict[str, float]] = {}
    for name, (m, k, n) in shapes.items():
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        rates[name] = {}
        for how, call in (("engine", lambda x=x, w=w: linear(x, w)),
                          ("F.linear", lambda x=x, w=w: torch.nn.functional.linear(x, w))):
            for _ in range(3):
                call()
            started = time.perf_counter()
            for _ in range(reps):
                call()
            rates[name][how] = 2 * m * k * n * reps / (time.perf_counter() - started) / 1e9
    return {"gflops": rates, "limit_gflops": max(r for shape in rates.values() for r in shape.values())}


def flop_model(policy: LoraModel) -> dict[str, float]:
    """FLOPs per token position through the blocks (2 x their projections' weights) and per row through the
    vocabulary (2 x vocab x hidden). Attention scores, norms and LoRA's small factors are left out (a few percent)."""
    fast = policy.fast
    block = sum(2 * f.weight.numel() for b in fast.blocks for f in (b.qkv, b.o, b.gate_up, b.down))
    return {"per_position": float(block), "per_logit_row": 2.0 * fast.lm_head.numel()}


def phase_table(steps: list[dict], flops: dict[str, float], limit: float) -> list[dict]:
    """Each phase's median seconds and matmul GFLOP over the steps, its rate and that rate over ``limit``. The
    backward's matmuls are the forward's (the input's gradient through every frozen projection and the vocabulary)."""
    def work(positions: str, rows: str) -> list[float]:
        return [(s[positions] * flops["per_position"] + s[rows] * flops["per_logit_row"]) / 1e9 for s in steps]

    trained = [s for s in steps if s["logit_rows_training"]] or steps  # steps with a training pass
    phases = [("generation", steps, "seconds_generation", work("positions_generation", "logit_rows_generation")),
              ("log-probs (forward)", trained, "seconds_logprobs",
               work("positions_training", "logit_rows_training")),
              ("backward", trained, "seconds_backward", work("positions_training", "logit_rows_training")),
              ("optimizer (clip + AdamW)", steps, "seconds_optimizer", None)]
    table = []
    for name, rows, key, gflop in phases:
        seconds = statistics.median(s[key] for s in rows)
        if gflop is not None:
            gflop = statistics.median(g for s, g in zip(steps, gflop) if s in rows)
        rate = gflop / seconds if gflop and seconds > 0 else None
        table.append({"phase": name, "steps": len(rows), "seconds": seconds, "gflop": gflop, "gflops": rate,
                      "of_limit": rate / limit if rate is not None else None})
    return table


def eval_speed(policy: LoraModel, family: TaskFamily, items: list[Item], flops: dict[str, float]) -> dict:
    """The hidden eval's greedy generation on ``items``: all in one batch (as the trainer's evaluation runs) against
    one item at a time; seconds, matmul rate, and whether the scores agree."""
    out = {}
    for name, batch in (("batched", len(items)), ("one by one", 1)):
        engine = LocalChatEngine(policy, max_new_tokens=16, batch_size=batch)
        started = time.perf_counter()
        scores, _ = evaluate_items(family, items, engine)
        seconds = time.perf_counter() - started
        model = engine.model
        gflop = (model.positions * flops["per_position"] + model.logit_rows * flops["per_logit_row"]) / 1e9
        out[name] = {"batch_size": batch, "seconds": seconds, "gflop": gflop, "gflops": gflop / seconds,
                     "scores": scores}
    out["same_scores"] = out["batched"]["scores"] == out["one by one"]["scores"]
    out["speedup"] = out["one by one"]["seconds"] / out["batched"]["seconds"]
    return out


def run_engine(args, train_items: list[Item], eval_items: list[Item]) -> dict:
    family = Addition()

    def reward_for(item: Item):
        return lambda transcript: family.score(item, transcript)

    examples = [Example.fixed(Conversation(family.initial_messages(item)), reward_for(item)) for item in train_items]
    config = GRPOConfig(steps=args.steps, learning_rate=2e-4, prompts_per_step=4, group_size=8, max_new_tokens=16,
                        temperature=1.0, lora_rank=16, lora_alpha=32, seed=args.seed, max_grad_norm=1.0)
    started = time.perf_counter()
    trainer = GRPOTrainer(config, examples)
    load_seconds = time.perf_counter() - started
    print(f"[engine] policy loaded in {load_seconds:.1f} s, compute dtype {trainer.policy.dtype}, "
          f"device {trainer.policy.device}", flush=True)
    steps = []
    for _ in range(config.steps):
        m = trainer.step()
        steps.append(m.to_dict())
        print(f"[engine] step {m.step:2d} reward {m.reward_mean:.3f} loss {m.loss:+.4f} tokens {m.tokens_generated} "
              f"flat groups {m.zero_spread_groups} | gen {m.seconds_generation:.2f} s, "
              f"score {m.seconds_scoring:.3f} s, fwd/bwd {m.seconds_forward_backward:.2f} s, "
              f"total {m.seconds_total:.2f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = trainer.save(Path(tmp) / "adapter")
        eval_started = time.perf_counter()
        base = LoraModel.load(dtype=config.dtype)
        pre = evaluate(base, family, eval_items, max_new_tokens=16, batch_size=len(eval_items))
        del base
        tuned = LoraModel.load(adapter=adapter, dtype=config.dtype)
        post = evaluate(tuned, family, eval_items, max_new_tokens=16, batch_size=len(eval_items))
        eval_seconds = time.perf_counter() - eval_started
        flops = flop_model(tuned)
        speed = eval_speed(tuned, family, eval_items, flops)
    low, high = paired_bootstrap(pre, post, n=10_000, seed=0)
    return {"steps": steps, "pre": pre, "post": post, "uplift_ci": [low, high], "eval_seconds": eval_seconds,
            "dtype": str(trainer.policy.dtype), "device": str(trainer.policy.device), "flops": flops,
            "eval_speed": speed}


def run_trl(args, train_items: list[Item]) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    path = converted_checkpoint()  # TRL refuses GGUF-marked models; this is the same weights, dequantised
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": item.question}], "answer": int(item.answer)}
                                 for item in train_items])

    def reward(completions, answer, **kwargs):
        return [last_number_reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.seconds, self.rewards, self._start = [], [], 0.0

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self._start)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    timer = Timer()
    out = tempfile.mkdtemp(prefix="bench-trl-")
    config = TRLConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=32, num_generations=8,
        max_completion_length=16, temperature=1.0, learning_rate=2e-4, lr_scheduler_type="constant",
        loss_type="grpo", beta=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        bf16=args.trl_bf16, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = TRLTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=lora, callbacks=[timer])
    trainer.train()
    for step, (seconds, r) in enumerate(zip(timer.seconds, timer.rewards), 1):
        print(f"[trl] step {step:2d} reward {r:.3f} | total {seconds:.2f} s", flush=True)
    return {"seconds": timer.seconds, "rewards": timer.rewards, "bf16": args.trl_bf16,
            "gradient_checkpointing": False}


def at_steps(values: list[float], steps: list[int]) -> dict[str, float]:
    return {str(s): values[s - 1] for s in steps if 0 < s <= len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--eval-items", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-bf16", action="store_true", help="TRL with bf16 autocast (default: fp32)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    eval_items, train_items = split(args.seed, args.eval_items)
    print(f"base model {BASE_MODEL}; {len(train_items)} train problems, {len(eval_items)} eval problems; "
          f"torch {torch.__version__}, {threads} threads", flush=True)
    limit = matmul_limit()
    for shape, rates in limit["gflops"].items():
        print(f"bf16 matmul, {shape}: " + ", ".join(f"{how} {rate:.0f} GFLOP/s" for how, rate in rates.items()))
    print(f"limit: {limit['limit_gflops']:.0f} GFLOP/s", flush=True)

    engine = run_engine(args, train_items, eval_items)
    trl = None if args.skip_trl else run_trl(args, train_items)

    marks = sorted({1, min(15, args.steps), args.steps})
    engine_seconds = [s["seconds_total"] for s in engine["steps"]]
    engine_rewards = [s["reward_mean"] for s in engine["steps"]]
    figures = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "threads": threads,
        "steps": args.steps,
        "matmul": limit,
        "phases": phase_table(engine["steps"], engine["flops"], limit["limit_gflops"]),
        "engine": {
            "seconds_per_step_median": statistics.median(engine_seconds),
            "reward_at": at_steps(engine_rewards, marks),
            "split_median": {k: statistics.median(s[k] for s in engine["steps"]) for k in
                             ("seconds_generation", "seconds_scoring", "seconds_forward_backward")},
            "eval_pre": sum(engine["pre"]) / len(engine["pre"]),
            "eval_post": sum(engine["post"]) / len(engine["post"]),
            **engine,
        },
    }
    print()
    e = figures["engine"]
    print(f"engine: {e['seconds_per_step_median']:.2f} s/step (median) | generation "
          f"{e['split_median']['seconds_generation']:.2f} s, scoring {e['split_median']['seconds_scoring']:.3f} s, "
          f"forward/backward+update {e['split_median']['seconds_forward_backward']:.2f} s")
    print(f"engine reward at steps {marks}: {[round(v, 3) for v in e['reward_at'].values()]}")
    print(f"engine greedy eval ({len(eval_items)} held-out items): {e['eval_pre']:.3f} -> {e['eval_post']:.3f}, "
          f"uplift 95% CI [{e['uplift_ci'][0]:+.3f}, {e['uplift_ci'][1]:+.3f}]")
    print(f"\n| phase (median over steps) | s | matmul GFLOP | GFLOP/s | "
          f"of the {limit['limit_gflops']:.0f} GFLOP/s limit |")
    print("|---|---|---|---|---|")
    for row in figures["phases"]:
        work = "-" if row["gflop"] is None else f"{row['gflop']:.0f}"
        rate = "-" if row["gflops"] is None else f"{row['gflops']:.0f}"
        share = "-" if row["of_limit"] is None else f"{row['of_limit']:.0%}"
        print(f"| {row['phase']} ({row['steps']} steps) | {row['seconds']:.2f} | {work} | {rate} | {share} |")
    speed = e["eval_speed"]
    for name in ("batched", "one by one"):
        run = speed[name]
        print(f"hidden eval, {name} ({len(eval_items)} items, greedy, 16 tokens): {run['seconds']:.2f} s, "
              f"{run['gflops']:.0f} GFLOP/s ({run['gflops'] / limit['limit_gflops']:.0%} of the limit)")
    print(f"batched is {speed['speedup']:.1f}x one by one; same scores: {speed['same_scores']}")
    if trl is not None:
        figures["trl"] = {"seconds_per_step_median": statistics.median(trl["seconds"]),
                          "reward_at": at_steps(trl["rewards"], marks), **trl}
        t = figures["trl"]
        figures["ratio_trl_over_engine"] = t["seconds_per_step_median"] / e["seconds_per_step_median"]
        print(f"TRL {'bf16' if args.trl_bf16 else 'fp32'}: {t['seconds_per_step_median']:.2f} s/step (median)")
        print(f"TRL reward at steps {marks}: {[round(v, 3) for v in t['reward_at'].values()]}")
        print(f"ratio TRL / engine: {figures['ratio_trl_over_engine']:.2f}x")
    args.out.write_text(json.dumps(figures, indent=1))
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()
