"""What the backends' pool benchmarks share: a mix of sleeping jobs, run on a started backend at once or streamed in
waves (as the loop hands jobs over when groups finish), against the ideal makespan max(work / slots, longest job)
and longest-first packing with no overhead at all."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

from aitrainsai.backends import PYTHON, GpuBackend, JobPayload


def sleeping_payload(root: Path, name: str, seconds: float) -> JobPayload:
    """A payload that sleeps ``seconds`` and leaves one artifact, ``out``."""
    workdir = root / name
    workdir.mkdir(parents=True)
    (workdir / "job.py").write_text("import sys, time, pathlib\ntime.sleep(float(sys.argv[1]))\n"
                                    "pathlib.Path('out.txt').write_text('ok')\n")
    return JobPayload(job_id=name, workdir=workdir, command=[PYTHON, "job.py", str(seconds)], expected_s=seconds,
                      artifacts={"out": "out.txt"})


def mixed_durations(jobs: int, scale: float = 1.0, seed: int = 0) -> list[float]:
    """``jobs`` job durations drawn from 2, 4, 8 and 12 seconds (times ``scale``): a pool's mixed load."""
    rng = random.Random(seed)
    return [rng.choice([2.0, 4.0, 8.0, 12.0]) * scale for _ in range(jobs)]


def lpt(durations: list[float], slots: int) -> float:
    """The makespan of longest-first on ``slots`` with no overhead at all (what the backends' order aims at)."""
    loads = [0.0] * slots
    for seconds in sorted(durations, reverse=True):
        loads[loads.index(min(loads))] += seconds
    return max(loads)


async def utilisation(backend: GpuBackend, durations: list[float], slots: int, streamed: bool, root: Path,
                      make: Callable[[Path, str, float], JobPayload] = sleeping_payload) -> dict[str, float]:
    """Run the mix on a started backend (which it closes) and measure: makespan, ideal, longest-first, busy share."""
    started = time.monotonic()
    try:
        tasks = []
        waves = [durations[i:i + 8] for i in range(0, len(durations), 8)] if streamed else [durations]
        index = 0
        for wave in waves:
            for seconds in wave:
                tasks.append(asyncio.ensure_future(backend.run(make(root, f"j{index}", seconds))))
                index += 1
            if streamed:
                await asyncio.sleep(min(durations))  # the next groups arrive as earlier ones finish
        results = await asyncio.gather(*tasks)
    finally:
        makespan = time.monotonic() - started
        await backend.close()
    assert all(r.status == "done" for r in results), [r for r in results if r.status != "done"]
    return {"makespan": makespan, "ideal": max(sum(durations) / slots, max(durations)), "lpt": lpt(durations, slots),
            "busy": sum(durations) / (slots * makespan), "job_seconds": sum(durations)}


def describe(figures: dict[str, float], jobs: int, slots: str, kind: str) -> str:
    """One line of a pool benchmark's figures: the makespan against the ideal, and the slots' utilisation."""
    return (f"{jobs} jobs ({figures['job_seconds']:.0f} job-seconds) on {slots}, {kind}: makespan "
            f"{figures['makespan']:.1f} s, ideal {figures['ideal']:.1f} s "
            f"({figures['makespan'] / figures['ideal']:.2f}x; "
            f"longest-first with no overhead {figures['lpt']:.1f} s), busy {figures['busy']:.0%}")
