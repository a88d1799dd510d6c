"""Before and after a warm start, in one command: SmolLM2-135M as the agent on the local Tinker server, cold (the base
model) and warm (``init_state``), each playing the agent side of one episode per family and draw (the real tools
and the real validation probe in the sandbox; an accepted job is not trained): the share of turns that parse, of
turns with a tool call, of episodes with a submit_job call, of first submissions accepted, and the reward's
validation part (0.35 x validation; -0.1 without a parseable submission), with 95% intervals over episodes.

    .venv/bin/python plugins/outer_tinker/benchmarks/warm_start.py --init-state DIR [--families a,b,...]
        [--draws 1] [--temperature 0] [--preset llm-quickstart] [--max-tokens N] [--agents cold,warm]

``--temperature 0`` (default) is greedy: one draw per family says it all; above 0, ``--draws`` samples each.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-state", type=Path, required=True, help="the folder `aitrainsai sft` wrote")
    parser.add_argument("--families", default=None, help="comma-separated (default: every installed family)")
    parser.add_argument("--draws", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--preset", default="llm-quickstart")
    parser.add_argument("--agents", default="cold,warm", help="which to play: cold, warm or both (default)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the episodes' ledgers here (default: a temp dir)")
    parser.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn (default: the preset's)")
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    rows = asyncio.run(compare(args))
    print(f"\n{args.draws} draw(s) per family at temperature {args.temperature:g}; preset {args.preset}; "
          f"init_state {args.init_state}")
    print("| agent | episodes | turns parsed | turns with a call | submitted | first submission accepted | "
          "accepted | validation reward | s per episode |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, episodes in rows.items():
        print(f"| {name} | {len(episodes)} | " + " | ".join(_cell(episodes, key) for key in (
            "parsed", "called", "submitted", "first_ok", "accepted")) + f" | {_mean_ci([e['reward'] for e in episodes])}"
              f" | {statistics.mean(e['seconds'] for e in episodes):.0f} |")
    names = list(rows)
    print(f"\nper family (first submission accepted, {' / '.join(names)}): " + ", ".join(
        f"{f}: " + " / ".join(_share([e for e in rows[n] if e["family"] == f], "first_ok") for n in names)
        for f in sorted({e["family"] for episodes in rows.values() for e in episodes})))
    return 0


async def compare(args) -> dict[str, list[dict]]:
    from aitrainsai.config import load_config, resolve
    from aitrainsai.ledger import Ledger
    from aitrainsai.plugins import Plugins
    from aitrainsai.session import Session

    plugins = Plugins.load()
    families = args.families.split(",") if args.families else sorted(plugins.task_families.names())
    mode = "eval" if args.temperature == 0 else "train"
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for name, init in (("cold", None), ("warm", args.init_state)):
            if name not in args.agents.split(","):
                continue
            overrides = [f"outer_trainer.tinker.temperature={max(args.temperature, 0.01)}"]
            if args.max_tokens:
                overrides.append(f"outer_trainer.tinker.max_tokens={args.max_tokens}")
            if init is not None:
                overrides.append(f"outer_trainer.tinker.init_state={str(init.resolve())!r}".replace("'", '"'))
            resolved = resolve(load_config(None, overrides, args.preset, presets=plugins.presets), plugins)
            run = Ledger(root / name).create_run(resolved.record(), [], name=name)
            session = Session(resolved, plugins, run)
            trainer = session.outer_trainer
            await trainer.start()
            try:
                episodes = []
                for family in families:
                    for draw in range(args.draws if mode == "train" else 1):
                        episodes.append(await _play(session, trainer, family, f"b{draw}-{family}", mode))
                        print(f"{name} {family} draw {draw}: {episodes[-1]}", file=sys.stderr, flush=True)
                rows[name] = episodes
            finally:
                await trainer.close()
    return rows


async def _play(session, trainer, family: str, episode_id: str, mode: str) -> dict:
    """The agent side of one episode: turns until a submission is accepted, the attempts run out, or no call."""
    episode = session.episode(family, None, episode_id, step=0, group_id="g")
    episode._start_workspace()
    for message in episode.opening_messages():
        episode._say(message)
    began = time.monotonic()
    await episode._agent_phase(trainer, mode)
    turns = episode.turns
    first = episode.attempts[0].ok if episode.attempts else False
    validation = 0.0
    for attempt in episode.attempts:
        if attempt.ok:
            validation = 0.5 ** (attempt.attempt - 1)
            break
    return {"family": family, "turns": len(turns), "parsed": _rate([t.parse_error is None for t in turns]),
            "called": _rate([bool(t.message.get("tool_calls")) for t in turns]),
            "submitted": float(episode.parsed_submission), "first_ok": float(first),
            "accepted": float(episode.accepted_job is not None),
            "reward": 0.35 * validation if episode.parsed_submission else -0.1,
            "seconds": time.monotonic() - began}


def _rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def _share(episodes: list[dict], key: str) -> str:
    return f"{sum(e[key] for e in episodes):g}/{len(episodes)}"


def _cell(episodes: list[dict], key: str) -> str:
    return _mean_ci([e[key] for e in episodes])


def _mean_ci(values: list[float]) -> str:
    """Mean and a 95% normal interval over episodes (none for one)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return f"{mean:.2f}"
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.2f} ({mean - half:.2f} .. {mean + half:.2f})"


if __name__ == "__main__":
    sys.exit(main())
