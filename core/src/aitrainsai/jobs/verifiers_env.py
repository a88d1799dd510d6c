"""A classic job's verifiers environment, as the probe and the local inner trainer drive it.

Classic jobs pin verifiers 0.2.x: ``environment.py`` defines ``load_environment(**kwargs) -> vf.Environment``; its
tools are plain Python functions that run in the job's own (sandboxed) process, so the local trainer can run rollouts
on CPU; prime-rl up to v0.6.0 loads it natively and v0.7/v0.8 through their legacy bridge. A v1 job (``taskset.py``,
verifiers 0.4.0) has its own adapter with the same interface: :mod:`aitrainsai.jobs.taskset_env`.

This module imports verifiers and runs agent code: import it only inside the sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import sys
from pathlib import Path
from typing import Any

import verifiers as vf
from verifiers.utils.message_utils import normalize_messages

from aitrainsai.chat import content_text

Message = dict[str, Any]


class JobEnvironment:
    """The environment a job directory defines: its rows, tools, turn limit, tool calls and rubric."""

    def __init__(self, job_dir: Path, **env_args: Any):
        self.job_dir = Path(job_dir).resolve()
        if str(self.job_dir) not in sys.path:
            sys.path.insert(0, str(self.job_dir))
        module = importlib.import_module("environment")
        if not hasattr(module, "load_environment"):
            raise AttributeError("environment.py defines no load_environment(**kwargs)")
        self.env = module.load_environment(**env_args)
        if not isinstance(self.env, vf.Environment):
            raise TypeError(f"load_environment() returned {type(self.env).__name__}, not a verifiers Environment")
        self.reward_errors: list[str] = []
        """What reward functions raised or returned instead of a finite number (verifiers scores those 0)."""
        _instrument(self.env.rubric, self.reward_errors)

    @property
    def system_prompt(self) -> str | None:
        return self.env.system_prompt

    @property
    def max_turns(self) -> int:
        return int(getattr(self.env, "max_turns", 1) or 1)

    def tool_names(self) -> list[str]:
        return [tool.name for tool in (getattr(self.env, "tool_defs", None) or [])]

    def reward_funcs(self) -> list[dict[str, Any]]:
        """The job's own reward functions (verifiers' monitor rubrics apart), each ``{"name", "weight"}``: the first
        64, names cut to 100 characters."""
        return _reward_funcs(self.env.rubric)[:64]

    def tool_schemas(self) -> list[dict]:
        """OpenAI function schemas of the environment's tools, as verifiers writes them (titles dropped)."""
        from aitrainsai.tools import openai_tool

        return [openai_tool(tool.name, tool.description, tool.parameters)
                for tool in getattr(self.env, "tool_defs", None) or []]

    def tools(self, state: vf.State) -> dict[str, Any]:
        """The environment's tools as callables (a coroutine tool's call is awaited by the server), with its hidden
        arguments (the item's world) injected from this rollout's ``state``; each keeps the tool's own signature and
        docstring for validation."""
        tools = {}
        for name, tool in self.env.tool_map.items():
            def call(_name: str = name, _tool: Any = tool, **arguments: Any) -> Any:
                if isinstance(self.env, vf.StatefulToolEnv):
                    arguments = self.env.update_tool_args(_name, dict(arguments), [], state)
                return _tool(**arguments)

            tools[name] = functools.update_wrapper(functools.partial(call), tool)
        return tools

    def rows(self) -> list[dict[str, Any]]:
        """The training rows: ``prompt`` (messages), ``answer``, ``info``, ``example_id``."""
        dataset = self.env.get_dataset()
        return [dict(row) for row in dataset]

    def new_state(self, row: dict[str, Any]) -> vf.State:
        return vf.State(prompt=row["prompt"], answer=row.get("answer", ""), info=row.get("info", {}),
                        task=row.get("task", "default"), example_id=row.get("example_id", 0), trajectory=[],
                        timing={})

    async def tool_messages(self, messages: list[Message], state: vf.State) -> list[Message]:
        """Run the tool calls of the last (assistant) message through the environment; OpenAI-style results."""
        typed = normalize_messages(messages)
        replies = await self.env.env_response(typed, state)
        return [{"role": "tool", "tool_call_id": m.tool_call_id, "content": content_text(m.content)} for m in replies]

    async def score(self, row: dict[str, Any], completion: list[Message], state: vf.State | None = None
                    ) -> tuple[float, dict[str, float]]:
        """The rubric's reward for a finished rollout, and its per-function metrics."""
        state = state or self.new_state(row)
        state["completion"] = normalize_messages(completion)
        await self.env.rubric.score_rollout(state)
        reward = state["reward"]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"the rubric returned {reward!r}; a reward must be a finite number")
        return float(reward), {k: float(v) for k, v in (state.get("metrics") or {}).items()
                               if isinstance(v, (int, float))}

    def score_sync(self, row: dict[str, Any], completion: list[Message]) -> tuple[float, dict[str, float]]:
        return asyncio.run(self.score(row, completion))


def _reward_funcs(rubric: Any) -> list[dict[str, Any]]:
    found = [f for child in getattr(rubric, "rubrics", []) or [] for f in _reward_funcs(child)]
    funcs = getattr(rubric, "funcs", None)
    if not isinstance(funcs, list) or type(rubric).__module__.startswith("verifiers.envs"):
        return found
    weights = list(getattr(rubric, "weights", None) or [])
    for index, func in enumerate(funcs):
        weight = weights[index] if index < len(weights) else 1.0
        finite = isinstance(weight, (int, float)) and math.isfinite(weight)
        found.append({"name": str(getattr(func, "__name__", type(func).__name__))[:100],
                      "weight": float(weight) if finite else None})
    return found


def _instrument(rubric: Any, errors: list[str]) -> None:
    """Wrap every reward function so that exceptions and non-numbers are recorded; behaviour is unchanged."""
    for child in getattr(rubric, "rubrics", []) or []:
        _instrument(child, errors)
    funcs = getattr(rubric, "funcs", None)
    if not isinstance(funcs, list) or type(rubric).__module__.startswith("verifiers.envs"):
        return  # verifiers' own monitor rubrics count turns and tool calls
    rubric.funcs = [_watched(func, errors) for func in funcs]


def _watched(func: Any, errors: list[str]) -> Any:
    name = getattr(func, "__name__", repr(func))

    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{name} returned {type(value).__name__} {str(value)[:40]!r}, not a number")
        elif not math.isfinite(value):
            errors.append(f"{name} returned {value}, not a finite number")
        return value

    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def watched_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return check(await func(*args, **kwargs))
            except Exception as exc:
                errors.append(f"{name} raised {type(exc).__name__}: {exc}")
                raise
        return watched_async

    @functools.wraps(func)
    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return check(func(*args, **kwargs))
        except Exception as exc:
            errors.append(f"{name} raised {type(exc).__name__}: {exc}")
            raise
    return watched
