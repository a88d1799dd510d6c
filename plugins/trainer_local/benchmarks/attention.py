"""The fast forward's attention: torch's fused kernel (``scaled_dot_product_attention``, what float32 runs) against
the materialised scores (what it ran before, and what bfloat16 still runs), on SmolLM2-135M in one process, at the
lengths an LLM agent's turns have (a compact task view and three files read: ~3,500 tokens).

    .venv/bin/python plugins/trainer_local/benchmarks/attention.py [--lengths 500,1500,3500] [--repeats 2]

Per length: a prefill (one row, no cache), a forward and backward through the LoRA adapter (training's
``token_logprobs``), and greedy decoding of 32 tokens after the prefill; the best of ``--repeats`` per figure, and the
ratio. Float32, every CPU core.
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="500,1500,3500")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    from aitrainsai_trainer_local.local_model import LocalModel

    model = LocalModel.create(lora_rank=16, lora_alpha=32.0, dtype="float32")
    with torch.no_grad():  # a trained-looking adapter (B != 0), so that LoRA's path is exercised
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    fast = model._policy.fast
    print("| tokens | figure | materialised s | fused s | speed-up |\n|---:|---|---:|---:|---:|")
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = [1000 + (i * 7919) % 40000 for i in range(n)]
        times: dict[str, dict[bool, float]] = {"prefill": {}, "forward+backward": {}, "decode 32 tokens": {}}
        for fused in (False, True):
            type(fast).fused_attention = fused
            for _ in range(args.repeats):
                began = time.perf_counter()
                with torch.no_grad():
                    cache, hidden = fast.prefill([ids], 0, inplace=True)
                prefill = time.perf_counter() - began
                began = time.perf_counter()
                with torch.no_grad():
                    cache.reserve(32)
                    for _ in range(32):
                        token = fast.logits(hidden).argmax(-1)
                        hidden = fast.forward(token[:, None], torch.ones(1, 1, dtype=torch.bool), cache)[:, -1]
                decode = time.perf_counter() - began
                began = time.perf_counter()
                (values,) = model.token_logprobs([(ids[:-1], ids[1:])], grad=True)
                values.sum().backward()
                backward = time.perf_counter() - began
                for name, value in (("prefill", prefill), ("forward+backward", backward),
                                    ("decode 32 tokens", decode)):
                    times[name][fused] = min(times[name].get(fused, float("inf")), value)
        for name, pair in times.items():
            print(f"| {n} | {name} | {pair[False]:.2f} | {pair[True]:.2f} | {pair[False] / pair[True]:.1f}x |")
    type(fast).fused_attention = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
