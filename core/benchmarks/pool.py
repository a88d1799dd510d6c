"""The local backend as a pool: utilisation of 40 jobs of mixed durations on 16 workers, once as a single batch and
once as the outer loop runs them (outer steps of 40 jobs streaming with no barrier between steps), and the
orchestration overhead of a no-op job end to end (submit, run, wait, ledger records).

Utilisation = ideal makespan / makespan, the ideal being max(work / workers, longest job): 1.0 means no worker was
ever idle. A single batch of 40 jobs on 16 workers is bounded by packing (2.5 jobs per worker) and by its last job;
streaming keeps the pool full.

Run: .venv/bin/python core/benchmarks/pool.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from aitrainsai.backends import JobPayload
from aitrainsai.builtin.local_backend import LocalBackend
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import groups_in_flight
from aitrainsai.run.record import JobProgress


def durations(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    # mixed: mostly short jobs, some long ones (as inner jobs of different sizes are)
    return [round(rng.choice([rng.uniform(0.4, 1.2), rng.uniform(1.2, 2.5), rng.uniform(2.5, 4.0)]), 2)
            for _ in range(n)]


def ideal_makespan(jobs: list[float], workers: int) -> float:
    return max(sum(jobs) / workers, max(jobs))


async def makespan(jobs: list[float], workers: int, estimates: list[float | None], root: Path) -> float:
    backend = LocalBackend(LocalBackend.Config(workers=workers), workdir=root)
    payloads = [JobPayload(job_id=f"j{i}", workdir=root / f"j{i}", command=["sleep", str(d)], expected_s=e)
                for i, (d, e) in enumerate(zip(jobs, estimates))]
    start = time.monotonic()
    results = await asyncio.gather(*(backend.run(p) for p in payloads))
    assert all(r.status == "done" for r in results)
    return time.monotonic() - start


async def streaming(jobs: list[float], workers: int, queued: int, root: Path) -> float:
    """Keep ``workers + queued`` jobs in flight, as the loop launches groups while others still train."""
    backend = LocalBackend(LocalBackend.Config(workers=workers), workdir=root)
    noise = random.Random(2)
    pending = list(enumerate(jobs))
    in_flight: set[asyncio.Task] = set()
    start = time.monotonic()
    while pending or in_flight:
        while pending and len(in_flight) < workers + queued:
            i, d = pending.pop(0)
            payload = JobPayload(job_id=f"s{i}", workdir=root / f"s{i}", command=["sleep", str(d)],
                                 expected_s=d * noise.uniform(0.85, 1.15))
            in_flight.add(asyncio.ensure_future(backend.run(payload)))
        done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        assert all(t.result().status == "done" for t in done)
    return time.monotonic() - start


async def no_op_jobs(n: int, workers: int, root: Path) -> tuple[float, float]:
    backend = LocalBackend(LocalBackend.Config(workers=workers), workdir=root)
    run = Ledger(root / "runs").create_run({}, [])

    async def one(i: int) -> None:
        job_id = f"noop{i}"
        payload = JobPayload(job_id=job_id, workdir=root / job_id, command=["true"])
        run.upsert_job(job_id, status="queued", episode_id=f"e{i}", backend="local")
        handle = await backend.submit(payload)
        run.upsert_job(job_id, status="running", handle=handle.model_dump(mode="json"))
        result = await backend.wait(handle)
        run.upsert_job(job_id, status=result.status, wall_s=result.wall_s, cost_usd=0.0,
                       progress=JobProgress(reason=result.reason))

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return (time.monotonic() - wall) / n, (time.process_time() - cpu) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="outer steps of --jobs jobs each, streamed")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--no-ops", type=int, default=200)
    parser.add_argument("--mixes", type=int, default=10, help="further duration mixes for the single batch")
    args = parser.parse_args()
    jobs = durations(args.jobs, seed=7)
    ideal = ideal_makespan(jobs, args.workers)
    noise = random.Random(1)
    estimates = [d * noise.uniform(0.85, 1.15) for d in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        fifo = asyncio.run(makespan(jobs, args.workers, [None] * len(jobs), Path(tmp) / "fifo"))
        lpt = asyncio.run(makespan(jobs, args.workers, estimates, Path(tmp) / "lpt"))
        spread = []
        for seed in range(100, 100 + args.mixes):
            mix = durations(args.jobs, seed=seed)
            guess = [d * noise.uniform(0.85, 1.15) for d in mix]
            took = asyncio.run(makespan(mix, args.workers, guess, Path(tmp) / f"mix{seed}"))
            spread.append(ideal_makespan(mix, args.workers) / took)
        stream = durations(args.jobs * args.steps, seed=8)
        groups_per_step = args.jobs // args.group_size
        in_flight = groups_in_flight(args.workers, args.group_size, groups_per_step) * args.group_size
        streamed = asyncio.run(streaming(stream, args.workers, in_flight - args.workers, Path(tmp) / "stream"))
        wall, cpu = asyncio.run(no_op_jobs(args.no_ops, args.workers, Path(tmp) / "noop"))
    spawn = []
    for _ in range(50):
        start = time.monotonic()
        subprocess.run(["true"], check=True)
        spawn.append(time.monotonic() - start)
    print(f"{args.jobs} jobs ({sum(jobs):.1f} s of work, longest {max(jobs):.1f} s) on {args.workers} workers; "
          f"ideal makespan {ideal:.2f} s")
    print(f"  submission order          makespan {fifo:.2f} s   utilisation {ideal / fifo:.3f}")
    print(f"  longest expected first    makespan {lpt:.2f} s   utilisation {ideal / lpt:.3f}  (estimates +-15%)")
    if spread:
        print(f"  longest expected first, {len(spread)} more mixes: utilisation mean {statistics.mean(spread):.3f}, "
              f"min {min(spread):.3f}, max {max(spread):.3f}")
    stream_ideal = ideal_makespan(stream, args.workers)
    print(f"{args.steps} outer steps x {args.jobs} jobs (groups of {args.group_size}) streamed as the loop launches "
          f"them, {in_flight} in flight ({sum(stream):.1f} s of work): "
          f"makespan {streamed:.2f} s, ideal {stream_ideal:.2f} s, utilisation {stream_ideal / streamed:.3f}")
    print(f"no-op job end to end, {args.no_ops} jobs on {args.workers} workers: {wall * 1000:.1f} ms wall per job, "
          f"{cpu * 1000:.1f} ms orchestrator CPU per job")
    print(f"  peer: subprocess.run(['true']) alone: {statistics.median(spawn) * 1000:.1f} ms per spawn (median)")


if __name__ == "__main__":
    main()
