"""What a user sees while a run goes: outer step, episodes and jobs, reward and its components."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.live import Live

    from aitrainsai.run.loop import LoopStatus


class LoopProgress:
    """The loop's display (a :class:`~aitrainsai.run.loop.LoopDisplay`): a rich live panel on a terminal; one plain
    line per change elsewhere (logs, CI)."""

    def __init__(self, console: Any, steps: int):
        from rich.console import Console

        self.console = console or Console()
        self.steps = steps
        self.started = time.monotonic()
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

    def update(self, status: LoopStatus) -> None:
        if self._live is not None:
            self._live.update(self._render_table(status))
            return
        line = self._line(status)
        if line != self._last_line:
            self._last_line = line
            self.console.print(line, highlight=False)

    def warn(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)

    def _fields(self, status: LoopStatus | None) -> dict[str, str]:
        c = status.counters if status is not None else None
        last = status.last_step if status is not None else None
        reward = "-" if last is None else f"{last.reward:+.3f}"
        parts = " ".join(f"{k} {v:.2f}" for k, v in last.components.items()) if last is not None else ""
        return {
            "outer step": (f"{status.trained_steps if status else 0}/{self.steps} "
                           f"(policy v{status.policy_version if status else 0})"),
            "groups": f"launched {c.launched}, buffered {status.buffered}, dropped {c.dropped}, skipped {c.skipped}"
            if c and status else "-",
            "episodes": f"in flight {c.in_flight}" if c else "-",
            "jobs": f"done {c.jobs['done']}, dead {c.jobs['dead']}" if c else "-",
            "last step reward": f"{reward}  {parts}",
            **({"agent cost": f"${last.cost_usd:.2f}"} if last is not None and last.cost_usd is not None else {}),
            **({"compute cost": _compute(last.compute_usd)} if last is not None and any(last.compute_usd.values())
               else {}),
            "elapsed": f"{time.monotonic() - self.started:.0f} s",
        }

    def _render_table(self, status: LoopStatus | None):
        from rich.table import Table

        table = Table(title="aitrainsai run", show_header=False)
        for key, value in self._fields(status).items():
            table.add_row(key, value)
        return table

    def _line(self, status: LoopStatus) -> str:
        fields = self._fields(status)
        fields.pop("elapsed")
        return " | ".join(f"{k}: {v}" for k, v in fields.items())


def _compute(costs: dict[str, float]) -> str:
    """``$jobs`` and the backend's other figures: "$1.20 in jobs (pool $1.90, idle $0.70)"."""
    rest = ", ".join(f"{k.removesuffix('_usd')} ${v:.2f}" for k, v in costs.items() if k != "jobs_usd")
    return f"${costs.get('jobs_usd', 0.0):.2f} in jobs" + (f" ({rest})" if rest else "")
