"""How fast the local Tinker server is on this machine, through the real SDK, next to the same work done directly on
``LocalModel`` in this process (the ratio is what HTTP, the futures and the SDK add), in fp32 and in bf16 (the
server's default), with the bf16 speed-up.

    .venv/bin/python plugins/tinker_local_server/benchmarks/local_server.py [--samples 8] [--tokens 64] [--prompt 300]
        [--datums 8] [--datum-tokens 400] [--repeats 2] [--dtypes float32,bfloat16] [--no-direct]

Sampling: ``--samples`` continuations of ``--tokens`` tokens (no stop token, so every one is full length) of a
``--prompt``-token prompt; reported as samples/s and sampled tokens/s. Update: ``forward_backward`` (importance
sampling) + ``optim_step`` on ``--datums`` datums of ``--datum-tokens`` tokens; reported as seconds per update.
Each figure is the median of ``--repeats`` runs after one warm-up run. The direct and served columns sample alike:
merged LoRA in fp32, the adapter applied unmerged in bf16 (as the server does, so that sampler and training log-probs
agree).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--datum-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--no-direct", action="store_true", help="only the server+SDK column")
    args = parser.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        parser.error(f"--dtypes takes float32 and/or bfloat16, not {args.dtypes!r}")
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, args.prompt).tolist()
    sequences = [rng.integers(100, 40000, args.datum_tokens).tolist() for _ in range(args.datums)]

    results: dict[str, dict[str, dict]] = {}
    for dtype in dtypes:
        results[dtype] = {"server+SDK": bench_server(args, prompt, sequences, dtype)}
        if not args.no_direct:
            results[dtype]["LocalModel"] = bench_direct(args, prompt, sequences, dtype)
    measures = [("samples/s", "samples_per_s"), ("sampled tokens/s", "tokens_per_s"), ("s per update", "s_per_update")]
    columns = [(dtype, where) for dtype in dtypes for where in ("LocalModel", "server+SDK") if where in results[dtype]]
    speedups = [where for where in ("LocalModel", "server+SDK") if len(dtypes) == 2 and all(
        where in results[d] for d in dtypes)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import torch

    print(f"\n{args.samples} samples x {args.tokens} tokens after a {args.prompt}-token prompt; updates of "
          f"{args.datums} datums x {args.datum_tokens} tokens; {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, load average {load:.1f} at the end")
    heads = [f"{where} {dtype}" for dtype, where in columns]
    heads += [f"{where} speed-up ({dtypes[-1]} vs {dtypes[0]})" for where in speedups]
    print("| measure | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for name, key in measures:
        cells = [f"{results[dtype][where][key]:.2f}" for dtype, where in columns]
        for where in speedups:
            first, second = (results[d][where][key] for d in dtypes)
            ratio = first / second if key == "s_per_update" else second / first
            cells.append(f"{ratio:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_direct(args, prompt: list[int], sequences: list[list[int]], dtype: str) -> dict:
    import torch
    from aitrainsai_trainer_local.local_model import LocalModel

    model = LocalModel.create(lora_rank=8, lora_alpha=32.0, dtype=dtype,
                              target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"))
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def sample():
        sampler = model.sampler(merge=dtype == "float32")  # a new version per call, as the server builds
        sampler.generate(prompt, num_samples=args.samples, max_new_tokens=args.tokens, temperature=1.0,
                         stop_ids=[], generator=torch.Generator().manual_seed(0))

    def update():
        rows = [(s[:-1], s[1:]) for s in sequences]
        for start in range(0, len(rows), max(1, 4096 // args.datum_tokens)):
            group = rows[start:start + max(1, 4096 // args.datum_tokens)]
            logprobs = model.token_logprobs(group, grad=True)
            loss = torch.stack([-(torch.exp(lp - lp.detach()) * 0.1).sum() for lp in logprobs]).sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    sample_s = _median(sample, args.repeats)
    update_s = _median(update, args.repeats)
    return {"samples_per_s": args.samples / sample_s, "tokens_per_s": args.samples * args.tokens / sample_s,
            "s_per_update": update_s}


def bench_server(args, prompt: list[int], sequences: list[list[int]], dtype: str) -> dict:
    import tinker
    from aitrainsai_tinker_local_server import MODEL_NAME, start_local_server

    with tempfile.TemporaryDirectory() as state_dir, start_local_server(state_dir, timeout=600, dtype=dtype) as server:
        async def run() -> dict:
            client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
            training = await client.create_lora_training_client(MODEL_NAME, rank=8, train_unembed=False)
            params = tinker.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, stop=[])
            data = [tinker.Datum(model_input=tinker.ModelInput.from_ints(s[:-1]),
                                 loss_fn_inputs={"target_tokens": s[1:], "logprobs": [-1.0] * (len(s) - 1),
                                                 "advantages": [0.1] * (len(s) - 1)}) for s in sequences]

            async def sample():
                sampler = await training.save_weights_and_get_sampling_client()
                result = await sampler.sample(tinker.ModelInput.from_ints(prompt), args.samples, params)
                assert all(len(s.tokens) == args.tokens for s in result.sequences)

            async def update():
                backward = training.forward_backward(data, "importance_sampling")
                step = training.optim_step(tinker.AdamParams(learning_rate=1e-5))
                await backward
                await step

            async def timed(fn) -> float:
                await fn()
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    await fn()
                    times.append(time.perf_counter() - start)
                return statistics.median(times)

            sample_s = await timed(sample)
            update_s = await timed(update)
            await client.close("success")
            return {"samples_per_s": args.samples / sample_s, "tokens_per_s": args.samples * args.tokens / sample_s,
                    "s_per_update": update_s}

        return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
