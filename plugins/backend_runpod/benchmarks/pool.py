"""Benchmark: the Runpod backend's pool on the fake Runpod (real SDK over HTTP, pods that are real sshd servers).

1. Per-job overhead: no-op payloads one after another on one warm pod, against the local backend (a subprocess on
   this machine) in the same command: what the SSH round trips (upload, launch, polls, log, artifacts, clean-up) add.
2. Utilisation: 40 jobs of mixed durations on 16 pods, submitted at once and streamed in waves (as the loop hands
   them over when groups finish), against the ideal makespan max(sum / pods, longest job).

    .venv/bin/python plugins/backend_runpod/benchmarks/pool.py [--jobs 40] [--pods 16] [--poll 0.5]

Pods have no GPU and share this machine's CPUs: the jobs sleep, so the figures are the backend's scheduling and
protocol costs, not compute.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aitrainsai import LocalBackend, LocalBackendConfig
from aitrainsai.testing import describe, mixed_durations, sleeping_payload, utilisation
from aitrainsai_backend_runpod.backend import RunpodBackend
from aitrainsai_backend_runpod.config import RunpodConfig
from aitrainsai_backend_runpod.testing.fake_runpod import FakeRunpod

GPU = "NVIDIA GeForce RTX 4090"


async def until_ready(backend: RunpodBackend, count: int) -> None:
    while sum(p.state == "ready" for p in backend.pool.pods.values()) < count:
        await asyncio.sleep(0.1)


async def overhead(root: Path, fake: FakeRunpod, args) -> dict[str, float]:
    runpod = RunpodBackend(config(fake, args, max_pods=1), workdir=root / "rp-overhead" / "backend")
    local = LocalBackend(LocalBackendConfig(workers=1), workdir=root / "local-overhead")
    await runpod.start()
    await until_ready(runpod, 1)
    walls: dict[str, list[float]] = {"runpod": [], "local": []}
    try:
        for i in range(args.repeats):
            for name, backend in (("runpod", runpod), ("local", local)):
                started = time.monotonic()
                result = await backend.run(sleeping_payload(root / name, f"noop-{i}", 0.0))
                assert result.status == "done", result
                walls[name].append(time.monotonic() - started)
    finally:
        await runpod.close()
        await local.close()
    return {name: statistics.median(values) for name, values in walls.items()}


async def pool_utilisation(root: Path, fake: FakeRunpod, args, streamed: bool) -> dict[str, float]:
    tag = "streamed" if streamed else "burst"
    backend = RunpodBackend(config(fake, args, max_pods=args.pods), workdir=root / f"rp-{tag}" / "backend")
    await backend.start()
    await until_ready(backend, args.pods)
    return await utilisation(backend, mixed_durations(args.jobs, args.scale), args.pods, streamed, root / tag)


def config(fake: FakeRunpod, args, **overrides) -> RunpodConfig:
    return RunpodConfig(api_base_url=fake.url, rest_url=fake.rest_url, gpu_types=[GPU], poll_s=args.poll, wait_s=30,
                        ssh_user=getpass.getuser(), python=sys.executable, boot_timeout_s=120, **overrides)


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as scratch, FakeRunpod(Path(scratch) / "fake") as fake:
        os.environ["RUNPOD_API_KEY"] = fake.api_key
        root = Path(scratch)
        walls = await overhead(root, fake, args)
        print(f"per-job wall, no-op payload, median of {args.repeats} (poll {args.poll:g} s):")
        print(f"  runpod (SSH to a warm pod) {walls['runpod']:.2f} s | local backend {walls['local']:.2f} s | "
              f"overhead {walls['runpod'] - walls['local']:.2f} s | ratio {walls['runpod'] / walls['local']:.1f}x")
        for streamed in (False, True):
            figures = await pool_utilisation(root, fake, args, streamed)
            kind = "streamed in waves of 8" if streamed else "submitted at once"
            print(describe(figures, args.jobs, f"{args.pods} pods", kind))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between job polls and pool ticks")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the job durations (2, 4, 8, 12 s)")
    asyncio.run(main(parser.parse_args()))
