"""Before and after a warm start: the base (cold) and the warm-started policy (warm) play the agent side of the same
fresh task draws (the real tools, the real validation probe; an accepted job is not trained), and what their turns
came to is tabled: turns parsed, turns with a tool call, failed turns (not parsed, or a call answered with an error)
and how many the next turn put right, episodes with a submit_job call, first submissions accepted, and the reward
with the job untrained (the validation part; the penalty without a parseable submission)."""

from __future__ import annotations

import math
import zlib
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from aitrainsai import AgentOutcome, SampleMode
from pydantic import BaseModel, ConfigDict, Field

HEADER = ("| agent | episodes | turns parsed | turns with a call | failed turns, recovered | submitted | "
          "first submission accepted | reward, job untrained | s per episode |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


class AgentCheck(BaseModel):
    """One agent's episodes over the draws (greedy at temperature 0)."""

    model_config = ConfigDict(extra="forbid")

    agent: Literal["cold", "warm"]
    temperature: float
    outcomes: list[AgentOutcome] = Field(default_factory=list)

    def row(self) -> str:
        o = self.outcomes
        cells = [_mean_ci([x.parsed_turns / max(x.turns, 1) for x in o]),
                 _mean_ci([x.call_turns / max(x.turns, 1) for x in o]), _recoveries(o),
                 _mean_ci([float(x.submitted) for x in o]), _mean_ci([float(x.first_accepted) for x in o]),
                 _mean_ci([x.reward for x in o]), f"{statistics.mean(x.seconds for x in o):.0f}"]
        return f"| {self.agent} | {len(o)} | " + " | ".join(cells) + " |"


def table(checks: Sequence[AgentCheck]) -> str:
    """The checks as a markdown table, means with 95% normal intervals over episodes."""
    return "\n".join([HEADER] + [c.row() for c in checks if c.outcomes])


async def check_agents(resolve: Callable[[Path | None], Any], plugins: Any, root: Path, *, init_state: Path | None,
                       families: Sequence[str], draws: int, temperature: float = 0.0,
                       agents: Sequence[str] = ("cold", "warm"), say: Callable[[str], None] = print
                       ) -> list[AgentCheck]:
    """``cold`` (no ``init_state``) then ``warm`` (with it, where given), each on ``draws`` draws of each family:
    episode ids ``check-<family>-<draw>``, the same for both, none a training episode's. ``resolve(init_state)``
    is the run config with that ``outer_trainer.tinker.init_state`` (and, above 0, its ``temperature`` this one);
    the episodes' ledgers go under ``root``."""
    from aitrainsai import Ledger, Session

    mode: SampleMode = "eval" if temperature == 0 else "train"
    checks = []
    for agent, init in (("cold", None), ("warm", init_state)):
        if agent not in agents or (agent == "warm" and init is None):
            continue
        resolved = resolve(init)
        run = Ledger(root / agent).create_run(resolved.snapshot(), [])
        session = Session(resolved, plugins, run)
        trainer = session.outer_trainer
        check = AgentCheck(agent=agent, temperature=temperature)
        await trainer.start()
        try:
            for family in families:
                for draw in range(draws if mode == "train" else 1):
                    episode = session.episode(family, None, f"check-{family}-{draw}", step=0, group_id="check")
                    seed = zlib.crc32(f"{family}-{draw}".encode())  # the same draw, the same seed, for both
                    outcome = await episode.play_agent(trainer, mode=mode, eval_seed=seed)
                    check.outcomes.append(outcome)
                    say(f"{agent} {family} draw {draw}: {outcome.turns} turns, {outcome.call_turns} with a call, "
                        f"{outcome.failed_turns} failed ({outcome.recovered} put right), "
                        f"submitted {outcome.submitted}, first accepted {outcome.first_accepted}, "
                        f"reward {outcome.reward:+.3f}, {outcome.seconds:.0f} s")
        finally:
            await trainer.close()
        checks.append(check)
    return checks


def _recoveries(outcomes: Sequence[AgentOutcome]) -> str:
    """Failed turns in all and how many of them the next turn put right ("-" where not counted)."""
    if any(x.failed_turns is None for x in outcomes):
        return "-"
    return f"{sum(x.failed_turns or 0 for x in outcomes)}, {sum(x.recovered or 0 for x in outcomes)}"


def _mean_ci(values: list[float]) -> str:
    mean = statistics.mean(values)
    if len(values) < 2:
        return f"{mean:.2f}"
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.2f} ({mean - half:.2f} .. {mean + half:.2f})"
