"""What a user sees while a run goes: outer step, episodes and jobs, reward and its components."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.live import Live


class LoopProgress:
    """A rich live panel on a terminal; one plain line per change elsewhere (logs, CI)."""

    def __init__(self, console: Any, steps: int):
        from rich.console import Console

        self.console = console or Console()
        self.steps = steps
        self.started = time.monotonic()
        self.last_reward: float | None = None
        self.components: dict[str, float] = {}
        self.cost_usd: float | None = None  # the outer trainer's spending so far, where it reports one
        self.compute_usd: dict[str, float] = {}  # the inner jobs' (jobs_usd) and the backend's own (pool_usd, ...)
        self._live: Live | None = None
        self._last_line = ""

    def __enter__(self) -> LoopProgress:
        if self.console.is_terminal:
            from rich.live import Live

            live = self._live = Live(self._render_table(None), console=self.console, refresh_per_second=2,
                                     transient=False)
            live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, loop: Any, last_reward: float | None = None, components: dict[str, float] | None = None,
               cost_usd: float | None = None, compute_usd: dict[str, float] | None = None) -> None:
        if compute_usd is not None:
            self.compute_usd = compute_usd
        if last_reward is not None:
            self.last_reward = last_reward
            self.components = components or {}
        if cost_usd is not None:
            self.cost_usd = cost_usd
        if self._live is not None:
            self._live.update(self._render_table(loop))
            return
        line = self._line(loop)
        if line != self._last_line:
            self._last_line = line
            self.console.print(line, highlight=False)

    def _fields(self, loop: Any) -> dict[str, str]:
        c = loop.counters if loop is not None else None
        reward = "-" if self.last_reward is None else f"{self.last_reward:+.3f}"
        parts = " ".join(f"{k} {v:.2f}" for k, v in self.components.items())
        return {
            "outer step": (f"{loop.trained_steps if loop else 0}/{self.steps} "
                           f"(policy v{loop.policy.policy_version if loop else 0})"),
            "groups": f"launched {c.launched}, buffered {len(loop.buffer)}, dropped {c.dropped}, skipped {c.skipped}"
            if c else "-",
            "episodes": f"in flight {c.in_flight}" if c else "-",
            "jobs": f"done {c.jobs['done']}, dead {c.jobs['dead']}" if c else "-",
            "last step reward": f"{reward}  {parts}",
            **({"agent cost": f"${self.cost_usd:.2f}"} if self.cost_usd is not None else {}),
            **({"compute cost": _compute(self.compute_usd)} if any(self.compute_usd.values()) else {}),
            "elapsed": f"{time.monotonic() - self.started:.0f} s",
        }

    def _render_table(self, loop: Any):
        from rich.table import Table

        table = Table(title="aitrainsai run", show_header=False)
        for key, value in self._fields(loop).items():
            table.add_row(key, value)
        return table

    def _line(self, loop: Any) -> str:
        fields = self._fields(loop)
        fields.pop("elapsed")
        return " | ".join(f"{k}: {v}" for k, v in fields.items())


def _compute(costs: dict[str, float]) -> str:
    """``$jobs`` and the backend's other figures: "$1.20 in jobs (pool $1.90, idle $0.70)"."""
    rest = ", ".join(f"{k.removesuffix('_usd')} ${v:.2f}" for k, v in costs.items() if k != "jobs_usd")
    return f"${costs.get('jobs_usd', 0.0):.2f} in jobs" + (f" ({rest})" if rest else "")
