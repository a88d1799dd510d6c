"""Benchmark: the Ray backend on a real local Ray head, against the local backend in the same command.

1. Per-job overhead: no-op payloads one after another, on the Ray head (job submission API, a supervisor actor per
   job, the runner, status polls, log tail, artifacts through the shared folder) and on the local backend (a
   subprocess on this machine): the median wall per job and the ratio.
2. Utilisation: 40 jobs of mixed durations submitted at once and streamed in waves (as the loop hands them over
   when groups finish), on a head of ``--slots`` CPUs (one payload per CPU) and on the local backend with as many
   workers: makespan against the ideal max(work / slots, longest job).

    .venv/bin/python plugins/backend_ray/benchmarks/pool.py [--jobs 40] [--slots 8] [--repeats 10] [--poll 0.5]

The jobs sleep, so the figures are the backends' scheduling and protocol costs, not compute; Ray's own processes
(GCS, raylet, dashboard, a worker per job) share this machine's CPUs with the orchestrator.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from aitrainsai import LocalBackend, LocalBackendConfig
from aitrainsai.testing import describe, mixed_durations, sleeping_payload, utilisation
from aitrainsai_backend_ray.backend import RayBackend
from aitrainsai_backend_ray.cluster import LOCAL_ENV, LocalCluster
from aitrainsai_backend_ray.config import RayConfig


def backend(name: str, root: Path, head: LocalCluster, args, tag: str, workers: int):
    if name == "ray":
        return RayBackend(RayConfig(address=head.url, poll_s=args.poll), workdir=root / f"ray-{tag}")
    return LocalBackend(LocalBackendConfig(workers=workers), workdir=root / f"local-{tag}")


def head_cpu_s(head: LocalCluster) -> float:
    """CPU seconds the head's processes have used, those they reaped (a job's worker processes) included."""
    import psutil

    total = 0.0
    for pid in head.pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


async def overhead(root: Path, head: LocalCluster, args) -> tuple[dict[str, list[float]], float]:
    """Walls per no-op job on each backend, and the head's CPU seconds per Ray job."""
    pair = {name: backend(name, root, head, args, "overhead", workers=1) for name in ("ray", "local")}
    for made in pair.values():
        await made.start()
    walls: dict[str, list[float]] = {name: [] for name in pair}
    cpu = 0.0
    try:
        for i in range(args.repeats):
            for name, made in pair.items():
                before = head_cpu_s(head) if name == "ray" else 0.0
                started = time.monotonic()
                result = await made.run(sleeping_payload(root / f"noop-{name}", f"noop-{i}", 0.0))
                assert result.status == "done", result
                walls[name].append(time.monotonic() - started)
                if name == "ray":
                    await asyncio.sleep(1.0)  # the job's worker exits and is reaped
                    cpu += head_cpu_s(head) - before
    finally:
        for made in pair.values():
            await made.close()
    return walls, cpu / args.repeats


async def main(args) -> None:
    os.environ.update(LOCAL_ENV)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        begin = time.monotonic()
        head = LocalCluster(num_cpus=args.slots, num_gpus=0, object_store_mb=128).start(timeout_s=180)
        try:
            print(f"a local Ray head of {args.slots} CPUs answered after {time.monotonic() - begin:.1f} s")
            walls, cpu = await overhead(root, head, args)
            ray, local = statistics.median(walls["ray"]), statistics.median(walls["local"])
            print(f"per-job wall, no-op payload, one after another, median of {args.repeats} (poll {args.poll:g} s):")
            print(f"  ray {ray:.2f} s (min {min(walls['ray']):.2f}, max {max(walls['ray']):.2f}) | local backend "
                  f"{local:.2f} s | overhead {ray - local:.2f} s | ratio {ray / local:.1f}x")
            print(f"  CPU the Ray head spends per job (its supervisor actor's worker process, the runner, "
                  f"polls): {cpu:.2f} s")
            for streamed in (False, True):
                kind = "streamed in waves of 8" if streamed else "submitted at once"
                for name in args.backends.split(","):
                    tag = "stream" if streamed else "burst"
                    made = backend(name, root, head, args, tag, workers=args.slots)
                    await made.start()
                    figures = await utilisation(made, mixed_durations(args.jobs, args.scale), args.slots,
                                                streamed, root / name / tag)
                    print(describe(figures, args.jobs, f"{args.slots} slots", f"{kind}, {name}"))
        finally:
            head.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--slots", type=int, default=8, help="CPUs of the Ray head = workers of the local backend")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between a Ray job's status polls")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the job durations (2, 4, 8, 12 s)")
    parser.add_argument("--backends", default="ray,local", help="which backends run the utilisation mixes")
    asyncio.run(main(parser.parse_args()))
