"""A neighbour's step time beside a job that burns every core (issue 51): a fixed CPU-bound step, timed alone, beside a
sandbox of busy processes with no CPU share (what a sandbox was before), and beside the same sandbox capped at the
local backend's share (this machine's cores split among its slots) and at half a core. Two neighbours: a plain
process (the trusted side: the orchestrator, a trainer) and a second job's sandbox with its own share.

Run (as root, where a CPU cgroup can be made): .venv/bin/python core/benchmarks/cpu_share.py [--slots 2]
[--burners 32] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP = """
import json, time
times = []
for _ in range({steps}):
    began = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i * i
    times.append(time.perf_counter() - began)
print(json.dumps(times))
"""
BURN = """
import os
for _ in range({burners} - 1):
    if os.fork() == 0:
        break
try:
    os.setsid()  # a session each: out of the kernel's per-session autogroup, as a job's code may do
except OSError:
    pass  # the first one leads a session already
while True:
    pass
"""


def neighbour(job: Path, steps: int, share: float | None) -> list[float]:
    """The step times of a neighbour: a plain process (``share`` None) or a sandbox with that share."""
    from aitrainsai.isolation import Limits, run_sandboxed

    code = STEP.format(steps=steps)
    if share is None:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    else:
        result = run_sandboxed([sys.executable, "-c", code], job_dir=job, limits=Limits(wall_s=600, cpus=share))
        assert result.returncode == 0, result.stderr
        out = result.stdout
    return json.loads(out)


def beside(job: Path, burner: float | None | bool, burners: int, steps: int, share: float) -> dict:
    """Both neighbours' step times beside a burner sandbox (``burner``: its CPU share, None: none; False: alone),
    and the cores' worth of CPU the burner used."""
    from aitrainsai.isolation import Limits, make_sandbox

    box = None
    if burner is not False:
        limits = Limits(wall_s=600, cpus=burner, processes=burners + 16)
        box = make_sandbox([sys.executable, "-c", BURN.format(burners=burners)], job_dir=job, limits=limits)
        box.start()
        time.sleep(1.0)  # every burner running
    try:
        plain = neighbour(job, steps, None)
        boxed = neighbour(job, steps, share)
    finally:
        cores = None
        if box is not None:
            group = box._cgroup
            used = group.cpu_seconds() if group is not None else None
            cores = used / (time.monotonic() - box.started) if used is not None else None
            box.kill()
            box.wait()
    return {"plain": plain, "boxed": boxed, "burner_cores": cores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2, help="the local backend's payloads at once (workers)")
    parser.add_argument("--burners", type=int, default=32, help="busy processes in the burning sandbox")
    parser.add_argument("--steps", type=int, default=10, help="steps per neighbour per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring every row (load drifts)")
    args = parser.parse_args()
    from aitrainsai.isolation.cgroup import cpu_share_enforced
    from aitrainsai.isolation.contract import MIN_CPUS

    if not cpu_share_enforced():
        sys.exit("no CPU cgroup can be made here (run as root on a machine with a cpu controller)")
    cores = len(os.sched_getaffinity(0))
    share = max(MIN_CPUS, cores / args.slots)
    print(f"{cores} cores, {args.slots} slots: each job's sandboxes get {share:g} cores; the burner runs "
          f"{args.burners} busy processes, each in a session of its own; {args.rounds} rounds of {args.steps} steps "
          "per neighbour")
    rows = [("alone", False), ("beside a burner with no share (cpus=None, as before)", None),
            (f"beside a burner capped at the backend's share ({share:g} cores)", share),
            (f"beside a burner capped at {MIN_CPUS:g} core", MIN_CPUS)]
    steps: dict[str, dict[str, list[float]]] = {label: {"plain": [], "boxed": []} for label, _ in rows}
    ratios: dict[str, dict[str, list[float]]] = {label: {"plain": [], "boxed": []} for label, _ in rows}
    burner_cores: dict[str, list[float]] = {label: [] for label, _ in rows}
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder)
        for _ in range(args.rounds):
            alone: dict[str, float] = {}
            for label, burner in rows:
                seen = beside(job, burner, args.burners, args.steps, share)
                for kind in ("plain", "boxed"):
                    median = statistics.median(seen[kind])
                    alone.setdefault(kind, median)
                    steps[label][kind] += seen[kind]
                    ratios[label][kind].append(median / alone[kind])
                if seen["burner_cores"] is not None:
                    burner_cores[label].append(seen["burner_cores"])
    print(f"| neighbour | plain process: median step, x alone (rounds' range) | sandboxed at {share:g} cores: "
          "median step, x alone (range) | burner's CPU (cores) |")
    print("|---|---|---|---|")
    for label, _ in rows:
        cells = [f"{statistics.median(steps[label][k]) * 1000:.0f} ms, x{min(ratios[label][k]):.2f}-"
                 f"{max(ratios[label][k]):.2f}" for k in ("plain", "boxed")]
        used = burner_cores[label]
        cpu = f"{min(used):.2f}-{max(used):.2f}" if used else "-"
        print(f"| {label} | {cells[0]} | {cells[1]} | {cpu} |", flush=True)


if __name__ == "__main__":
    main()
