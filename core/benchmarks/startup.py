"""Wall time of `aitrainsai --help` and `aitrainsai plugins` with every installed plugin, against bare Python.

Run: .venv/bin/python core/benchmarks/startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass (peer)": [sys.executable, "-c", "pass"],
    "aitrainsai --help": [sys.executable, "-m", "aitrainsai.cli", "--help"],
    "aitrainsai plugins": [sys.executable, "-m", "aitrainsai.cli", "plugins"],
    "aitrainsai families": [sys.executable, "-m", "aitrainsai.cli", "families"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "AITRAINSAI_PLUGINS"}
    plugins = json.loads(subprocess.run(COMMANDS["aitrainsai plugins"] + ["--json"], capture_output=True, text=True,
                                        env=env, check=True).stdout)
    print(f"plugins loaded: {', '.join(p['name'] for p in plugins)}")
    for label, command in COMMANDS.items():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, env=env, check=True)
            times.append(time.perf_counter() - start)
        print(f"{label:28s} median {statistics.median(times):.3f} s   max {max(times):.3f} s   (n={args.repeat})")


if __name__ == "__main__":
    main()
