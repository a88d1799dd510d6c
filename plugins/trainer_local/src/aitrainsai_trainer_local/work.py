"""A job's training work, counted from what the trainer computed, never timed.

A job's wall budget is seconds of the reference machine (2 cores of an x86 server with AMX, the machine the docs'
numbers come from; one thread). The trainer counts what each step computed (:class:`~aitrainsai_trainer_local.grpo.
StepMetrics`: token positions through the blocks, rows through the vocabulary, attention's (query, slot) pairs and
forward calls, in generation and in training) and prices each count at what it costs on the reference machine
(:data:`RATES`, fitted there by ``python -m aitrainsai_trainer_local.work``). The trainer is deterministic for a seed
and a thread count, so the same job counts the same work on a fast machine, a slow one or one a neighbour loads: a
budget that decides a reward never depends on the machine's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from aitrainsai_trainer_local.grpo import StepMetrics


class Rates(NamedTuple):
    """Reference seconds per unit of one phase's counts (and per step, for what every step pays once)."""

    position: float  # a token position through the blocks
    logit_row: float  # a hidden state through the vocabulary (and, in generation, sampled from)
    attended: float  # a (query, cache slot) pair through one layer's attention, in a chunk of several queries
    decode_attended: float  # the same in a decode step (one query a row: the cache is read for each, not reused)
    forward: float  # a forward call's fixed cost (a decode step's ~1,200 small operations)
    step: float  # once per step: the adapter merged for sampling; clipping and the optimizer's step
    decode_far: float = 0.0  # a decode pair past a row's first llama.FAR_SLOTS slots, again (a long cache's reads)


class PhaseRates(NamedTuple):
    generation: Rates
    training: Rates


# (base, compute dtype) -> rates: fitted on the reference machine, quiet, at one thread, by
# `python -m aitrainsai_trainer_local.work --base <base> --dtype <dtype>`, each shape in a fresh process (2026-12-07;
# the tiny base's provisional: see the trainer's README, with the fit's quality)
RATES: dict[tuple[str, str], PhaseRates] = {
    ("SmolLM2-135M-Instruct", "bfloat16"): PhaseRates(
        Rates(0.0, 1.411e-03, 2.606e-06, 8.068e-06, 4.228e-02, 3.957e-01, 1.775e-05),
        Rates(1.788e-03, 3.799e-04, 4.346e-06, 0.0, 1.893e-01, 6.666e-02)),
    ("SmolLM2-135M-Instruct", "float32"): PhaseRates(
        Rates(2.047e-03, 7.049e-04, 1.531e-07, 6.930e-06, 1.127e-01, 0.0),
        Rates(5.700e-03, 1.058e-03, 1.154e-06, 0.0, 2.406e-03, 5.907e-01)),
    ("tiny-llama", "bfloat16"): PhaseRates(
        Rates(0.0, 1.441e-04, 8.726e-08, 1.887e-07, 1.546e-03, 9.458e-05),
        Rates(1.075e-06, 4.348e-04, 1.639e-07, 0.0, 0.0, 0.0)),
    ("tiny-llama", "float32"): PhaseRates(
        Rates(2.523e-05, 1.949e-04, 1.106e-10, 1.592e-07, 7.576e-04, 2.993e-03),
        Rates(4.833e-05, 5.318e-04, 7.978e-09, 0.0, 0.0, 0.0)),
}


class UnknownRates(LookupError):
    """No rates were fitted for this base and compute dtype."""


def rates_for(base: str, dtype: str) -> PhaseRates:
    """The rates of ``base`` in ``dtype`` (``"bfloat16"`` or ``"float32"``; a CUDA run counts at the CPU's: the budget
    is the reference machine's seconds wherever the job trains)."""
    key = (base, dtype.removeprefix("torch."))
    if key not in RATES:
        raise UnknownRates(f"no work rates for {base} in {key[1]}: fit them with "
                           f"`python -m aitrainsai_trainer_local.work --base {base} --dtype {key[1]}`")
    return RATES[key]


def _counts(step: StepMetrics, phase: str) -> tuple[float, ...]:
    decode, far = ((float(step.decode_attended_generation), float(step.decode_far_generation))
                   if phase == "generation" else (0.0, 0.0))  # training decodes nothing
    return (float(getattr(step, f"positions_{phase}")), float(getattr(step, f"logit_rows_{phase}")),
            float(getattr(step, f"attended_{phase}")) - decode, decode, float(getattr(step, f"forwards_{phase}")), 1.0,
            far)


# a key/value cache copied (a group's rows repeated from its prompt's, room made for a turn): index_select runs at
# 2.7 GB/s at one thread here, fresh pages included (review eleven: 256 rows of a long prompt copied 2.65 GB a step,
# which no other count saw)
COPY_S_PER_GB = 0.5


def step_work(step: StepMetrics, rates: PhaseRates) -> float:
    """The reference machine's seconds of one step's work."""
    copied = (step.copied_generation + step.copied_training) / 2**30 * COPY_S_PER_GB
    return copied + sum(count * rate for phase, phase_rates in (("generation", rates.generation),
                                                                 ("training", rates.training))
                        for count, rate in zip(_counts(step, phase), phase_rates))


# -- fitting the rates on the reference machine ----------------------------------------------------------------------
# (prompt words, prompts per step, group size, max new tokens): short and long contexts, narrow and wide batches,
# short and long decodes, so that no count is fitted from one shape alone; MEDIUM and LONG stand for the long prompts'
# words, by dtype (below)
MEDIUM, LONG = -1, 0
GRID = [(10, 1, 2, 8), (10, 2, 4, 48), (10, 4, 8, 32), (10, 1, 16, 64), (150, 1, 4, 32), (150, 2, 4, 8),
        (MEDIUM, 1, 2, 16), (MEDIUM, 1, 4, 48), (LONG, 1, 2, 8), (LONG, 1, 2, 40), (40, 4, 4, 16), (300, 2, 2, 64),
        (150, 4, 8, 4), (40, 8, 8, 4), (10, 16, 2, 4), (40, 16, 2, 16),  # many positions, few sampled tokens,
        # little attention (training runs each distinct prompt once, so distinct short prompts)
        (MEDIUM, 1, 16, 32), (300, 1, 16, 48), (150, 4, 8, 32)]  # wide decodes over long prompts (the default job's)
# about 4 tokens a word; every shape's training stays within the trainer's activation bound (llama.
# MAX_ACTIVATION_BYTES: bfloat16 keeps attention's scores for the backward pass, float32 more bytes a position)
LONG_WORDS = {"float32": (300, 600), "bfloat16": (300, 450)}
# generation alone (every reward the same, so no group trains) over a prompt longer than training's bound allows: a
# long prefill's attention, which the trained shapes reach only to LONG_WORDS (bfloat16's was priced 2.2-2.5 times
# low from them; review thirteen), and wide decodes over its 4,700-token cache (a many-turn rollout's; review fourteen)
GENERATION_ONLY = [(1200, 1, 2, 4), (1200, 1, 16, 64)]


LONG_STEP_S = 1.0  # the fit is judged on steps this long or longer (a shorter one's few tenths matter to no budget)


def _shape_steps(base: str, dtype: Literal["bfloat16", "float32"], index: int, repeats: int) -> list[StepMetrics]:
    """The steps of shape ``index`` (of ``GRID``, then ``GENERATION_ONLY``) after its first (which warms its
    kernels), in this process."""
    import zlib

    from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer
    from aitrainsai_trainer_local.llama import TooLarge
    from aitrainsai_trainer_local.lora import LoraModel, LoraSettings
    from aitrainsai_trainer_local.rollout import Conversation

    words, prompts, group, new_tokens = (GRID + GENERATION_ONLY)[index]
    words = LONG_WORDS[dtype][words + 1] if words <= 0 else words
    trains = index < len(GRID)

    def reward(transcript) -> float:  # a draw from the completion: every group with two different ones trains
        return zlib.crc32(str(transcript[-1].get("content", "")).encode()) % 1_000 / 1_000 if trains else 0.0

    examples = [Example.fixed(Conversation([{"role": "user", "content": " ".join(
        f"word{(k * 31 + p) % 997}" for k in range(words)) + " Answer with one number."}]), reward)
                for p in range(prompts)]
    config = GRPOConfig(steps=repeats + 1, prompts_per_step=prompts, group_size=group,
                        max_new_tokens=new_tokens, temperature=1.0, seed=index, dtype=dtype)
    policy = LoraModel.load(lora=LoraSettings(), dtype=dtype, seed=0)
    try:
        history = GRPOTrainer(config, examples, policy=policy).train()
    except TooLarge as refused:  # the trainer's memory bounds refuse this shape in this dtype: a job could not run it
        print(f"{words} words x {prompts} x {group}, {new_tokens} new: not fitted ({refused})", file=sys.stderr)
        return []
    shape = history[-1]
    print(f"{words} words x {prompts} x {group}, {new_tokens} new: generation {shape.seconds_generation:.2f} s, "
          f"training {shape.seconds_forward_backward:.2f} s", file=sys.stderr, flush=True)
    return history[1:]


def _observations(base: str, dtype: Literal["bfloat16", "float32"], repeats: int,
                  save: Path | None = None) -> list[StepMetrics]:
    """Every shape's steps, each shape in a fresh process, as a job's trainer meets it: a process warmed by other
    shapes ran long prefills twice as fast (bfloat16, 450 words: 5.4-5.7 s after the grid's earlier shapes, 11-12 s
    first in a process), which priced them low."""
    import subprocess

    from aitrainsai_trainer_local.grpo import StepMetrics

    steps: list[StepMetrics] = []
    for index in range(len(GRID) + len(GENERATION_ONLY)):
        out = subprocess.run([sys.executable, "-m", "aitrainsai_trainer_local.work", "--base", base, "--dtype", dtype,
                              "--repeats", str(repeats), "--shape", str(index)], stdout=subprocess.PIPE, text=True,
                             check=True)
        steps.extend(StepMetrics(**row) for row in json.loads(out.stdout.splitlines()[-1]))
        if save:
            save.write_text(json.dumps([s.to_dict() for s in steps]))  # a fit stopped midway keeps what it timed
    return steps


def _nonnegative_fit(rows: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """Least squares in ratio (each step weighted by 1 / its seconds, or by 1 / ``LONG_STEP_S`` if shorter: a budget
    is long steps, and a count priced too low on any shape is a job's way to more compute than its budget) with every
    rate at least 0: a count found to cost nothing is dropped and the rest refitted."""
    import numpy as np

    weights = 1 / np.maximum(np.array(seconds), LONG_STEP_S)
    a, b = np.array(rows) * weights[:, None], np.array(seconds) * weights
    active = list(range(a.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (solution >= 0).all():
            rates = [0.0] * a.shape[1]
            for column, value in zip(active, solution):
                rates[column] = float(value)
            return tuple(rates)
        active = [column for column, value in zip(active, solution) if value > 0]


def fit(steps: list[StepMetrics]) -> PhaseRates:
    generation = _nonnegative_fit([_counts(s, "generation") for s in steps], [s.seconds_generation for s in steps])
    training = _nonnegative_fit([_counts(s, "training") for s in steps],
                                [s.seconds_forward_backward for s in steps])
    return PhaseRates(Rates(*generation), Rates(*training))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fit the work rates of a base on this machine (quiet, one thread).")
    parser.add_argument("--base", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="steps per shape after the first")
    parser.add_argument("--save", type=Path, help="write every step's metrics here (JSON)")
    parser.add_argument("--shape", type=int, help=argparse.SUPPRESS)  # one shape's steps as JSON (a fresh process's)
    args = parser.parse_args(argv)
    import os

    os.environ["AITRAINSAI_LOCAL_BASE"] = args.base
    import torch

    torch.set_num_threads(1)
    if args.shape is not None:
        print(json.dumps([s.to_dict() for s in _shape_steps(args.base, args.dtype, args.shape, args.repeats)]))
        return 0
    began = time.perf_counter()
    steps = _observations(args.base, args.dtype, args.repeats, args.save)
    rates = fit(steps)
    counted, timed = [step_work(s, rates) for s in steps], [s.seconds_total for s in steps]
    ratios = [c / t for c, t in zip(counted, timed) if t >= LONG_STEP_S] or [0.0]
    print(f"# {args.base} {args.dtype}: {len(steps)} steps in {time.perf_counter() - began:.0f} s; counted over timed: "
          f"{sum(counted) / sum(timed):.3f} in all; steps of {LONG_STEP_S:g} s or more: median "
          f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(f"({args.base!r}, {args.dtype!r}): PhaseRates(\n    Rates(*{tuple(f'{r:.4g}' for r in rates.generation)}),"
          f"\n    Rates(*{tuple(f'{r:.4g}' for r in rates.training)})),".replace("'", ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
