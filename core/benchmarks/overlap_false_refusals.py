"""How often the probe's overlap rule refuses an honest dataset: the old rule (more than 2% of the rows match a hidden
item) against the new one (:func:`aitrainsai.jobs.probe.check_overlap`: more distinct matches than the family's chance
rate allows), per installed family, at the levels the recipe policy trains on (the default level and the one above
it), at 16, 32, 128 and 512 rows.

Each draw is what an honest job builds: ``generate(seed, level, n)`` of the family's public generator with a random
seed. Rows match hidden items one by one, so a draw of 512 rows also gives the draws of its first 16, 32 and 128 rows
(the generators are prefix-stable; checked). "allows" is the most matching rows each rule accepts at that size (the
matched rows are dropped either way); "rate" is the share of all drawn rows that matched, beside the upper bound the
new rule derived from its reference draw.

Run: .venv/bin/python core/benchmarks/overlap_false_refusals.py [--draws 2000] [--only calc_chain] [--seed 0]
(``--draws`` is the number at 16 rows; half as many at 32, 250 per 2000 at 128, 100 per 2000 at 512, at least 50).
"""

from __future__ import annotations

import argparse
import random
import time

from aitrainsai.jobs.probe import check_overlap, chance_allowance, chance_overlap
from aitrainsai.plugins import Plugins

SIZES = (16, 32, 128, 512)
OLD_SHARE = 0.02  # the old rule: refused when more than this share of the rows matched


def draws_at(size: int, draws: int) -> int:
    return max(50, {16: draws, 32: draws // 2, 128: draws // 8, 512: draws // 20}[size])


def measure(family, level: int, draws: int, rng: random.Random) -> tuple[list[dict], float]:
    """Per size: draws, old and new refusals; and the matched share of all drawn rows."""
    counts = {n: {"draws": 0, "old": 0, "new": 0} for n in SIZES}
    matched = total = 0
    for i in range(draws_at(SIZES[0], draws)):
        sizes = [n for n in SIZES if i < draws_at(n, draws)]
        seed = rng.randrange(10**6, 10**9)
        items = family.generate(seed, level, sizes[-1])
        rows = [{"question": it.question, "answer": it.answer, "world": it.world} for it in items]
        leaked = family.overlap(rows)
        matched, total = matched + len(leaked), total + len(rows)
        for n in sizes:
            if i == 0:  # prefix-stable: the first n rows of a bigger draw are the draw of n rows
                assert family.generate(seed, level, n) == items[:n], f"{family.name}: generate is not prefix-stable"
            within = [j for j in leaked if j < n]
            counts[n]["draws"] += 1
            counts[n]["old"] += len(within) > OLD_SHARE * n
            counts[n]["new"] += check_overlap(family, rows[:n], leaked=within).beyond_chance
    return [{"rows": n, **counts[n]} for n in SIZES], matched / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=2000, help="honest draws at 16 rows (fewer at bigger sizes)")
    parser.add_argument("--only", action="append", help="measure this family only (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    registry = Plugins.load().task_families
    names = [n for n in registry.names() if not args.only or n in args.only]
    rng = random.Random(args.seed)
    print("| family | level | rows | honest draws | old rule refuses | new rule refuses | old allows | new allows |"
          " matched share (new rule's bound) |")
    print("|---|---|---|---|---|---|---|---|---|")
    started = time.monotonic()
    for name in names:
        family = registry.get(name)()
        bound = chance_overlap(family)
        levels = [lv for lv in (family.default_level, family.default_level + 1) if lv in family.levels]
        for level in levels:
            results, share = measure(family, level, args.draws, rng)
            for r in results:
                n = r["rows"]
                print(f"| {name} | {level} | {n} | {r['draws']} | {_pct(r['old'], r['draws'])} | "
                      f"{_pct(r['new'], r['draws'])} | {int(OLD_SHARE * n)} | {chance_allowance(bound, n)} | "
                      f"{share:.4f} ({bound:.4f}) |", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s; draws: --draws {args.draws}, --seed {args.seed}")


def _pct(refused: int, draws: int) -> str:
    return f"{100 * refused / draws:.1f}% ({refused})"


if __name__ == "__main__":
    main()
