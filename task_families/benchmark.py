"""Per family: seconds to generate the hidden eval set and to score the reference solver's transcripts on it.

Run: .venv/bin/python task_families/benchmark.py
"""

from __future__ import annotations

import time

from aitrainsai import Plugins


def main() -> None:
    registry = Plugins.load().task_families
    print(f"{'family':18s} {'items':>5s} {'generate s':>11s} {'solve+score s':>14s} {'total s':>8s} "
          f"{'mean score':>11s}")
    for name in registry.names():
        family = registry.get(name)()
        start = time.perf_counter()
        items = family.hidden_eval()
        generated = time.perf_counter()
        scores = [family.score(item, family.reference_transcript(item)) for item in items]
        done = time.perf_counter()
        print(f"{name:18s} {len(items):5d} {generated - start:11.3f} {done - generated:14.3f} {done - start:8.3f} "
              f"{sum(scores) / len(scores):11.3f}")


if __name__ == "__main__":
    main()
