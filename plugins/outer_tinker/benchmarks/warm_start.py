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
import json
import os
import sys
import tempfile
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
    checks = asyncio.run(compare(args))
    from aitrainsai_outer_tinker.agent_check import table

    print(f"\n{args.draws} draw(s) per family at temperature {args.temperature:g}; preset {args.preset}; "
          f"init_state {args.init_state}")
    print(table(checks))
    print("\nper family (first submission accepted, " + " / ".join(c.agent for c in checks) + "): " + ", ".join(
        f"{f}: " + " / ".join(f"{sum(o.first_accepted for o in c.outcomes if o.family == f)}/"
                              f"{sum(o.family == f for o in c.outcomes)}" for c in checks)
        for f in sorted({o.family for c in checks for o in c.outcomes})))
    return 0


async def compare(args):
    from aitrainsai import Plugins, load_config, resolve

    from aitrainsai_outer_tinker.agent_check import check_agents

    plugins = Plugins.load()
    families = args.families.split(",") if args.families else sorted(plugins.task_families.names())
    overrides = [f"outer_trainer.tinker.temperature={args.temperature}"] if args.temperature > 0 else []
    if args.max_tokens:
        overrides.append(f"outer_trainer.tinker.max_tokens={args.max_tokens}")

    def with_init(init):
        extra = [] if init is None else [f"outer_trainer.tinker.init_state={json.dumps(str(init.resolve()))}"]
        return resolve(load_config(None, overrides + extra, args.preset, presets=plugins.presets), plugins)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        checks = await check_agents(with_init, plugins, root, init_state=args.init_state.resolve(),
                                    families=families, draws=args.draws, temperature=args.temperature,
                                    agents=args.agents.split(","),
                                    say=lambda line: print(line, file=sys.stderr, flush=True))
    return checks


if __name__ == "__main__":
    sys.exit(main())
