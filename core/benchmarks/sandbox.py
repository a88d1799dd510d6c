"""What the sandbox costs: a sandboxed command against the same command run bare, and one question to a job's
environment in the sandbox (a tool call, a score) against the same call made in-process.

Run: .venv/bin/python core/benchmarks/sandbox.py [--repeat 9] [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def job_dir(root: Path) -> Path:
    """The calc_chain template job with 64 rows, frozen as the probe would freeze it."""
    import json

    from aitrainsai.families import Constraints
    from aitrainsai.jobs.job import DATASET_FILE, job_template
    from aitrainsai.plugins import Plugins

    family = Plugins.load().task_families.get("calc_chain")()
    spec = family.task_spec(1, Constraints(allowed_bases=["base"]))
    job = root / "job"
    job.mkdir()
    for name, text in job_template(spec, 'base_model = "base"\nsteps = 1\n').items():
        (job / name).write_text(text)
    rows = [{"question": i.question, "answer": i.answer, "world": i.world} for i in family.generate(20240, 1, 64)]
    (job / DATASET_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    from aitrainsai.jobs.remote_env import RemoteEnvironment
    from aitrainsai.isolation import run_sandboxed

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        command = [sys.executable, "-I", "-c", "pass"]
        bare = timed(lambda: subprocess.run(command, check=True), args.repeat)
        boxed = timed(lambda: run_sandboxed(command, job_dir=root), args.repeat)
        print(f"python -c pass, bare (peer)      median {statistics.median(bare) * 1000:7.1f} ms")
        print(f"python -c pass, sandboxed        median {statistics.median(boxed) * 1000:7.1f} ms   "
              f"(+{(statistics.median(boxed) - statistics.median(bare)) * 1000:.0f} ms per sandbox)")

        job = job_dir(root)
        completion = [{"role": "assistant", "content": "<answer>7</answer>"}]
        from aitrainsai.jobs.env_server import Server

        local = Server(job)
        started = time.perf_counter()
        local.load()
        local_load_s = time.perf_counter() - started

        def one_rollout(env) -> None:
            state = env.start(row=0)
            env.tool(state, "add", '{"a": 2, "b": 5}')
            env.score(state, completion)

        local_s = statistics.median(timed(lambda: one_rollout(local), args.calls))
        with RemoteEnvironment(job) as remote:
            started = time.perf_counter()
            info = remote.load()
            load_s = time.perf_counter() - started
            remote_s = statistics.median(timed(lambda: one_rollout(remote), args.calls))
        print(f"environment load, in-process (peer, verifiers imported here first)  {local_load_s:.2f} s")
        print(f"environment load in the sandbox (a fresh interpreter)  {load_s:.2f} s ({info.rows} rows)")
        print(f"rollout start+tool+score, in-process (peer)  median {local_s * 1000:6.2f} ms")
        print(f"rollout start+tool+score, sandboxed over a pipe  median {remote_s * 1000:6.2f} ms  "
              f"(x{remote_s / local_s:.2f})")


if __name__ == "__main__":
    main()
