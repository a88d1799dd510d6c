"""A verifiers v1 job (``taskset.py``, verifiers 0.4.0) behind the same interface as a classic job's environment
(:class:`aitrainsai.jobs.verifiers_env.JobEnvironment`), for the env server: its rows, tools, turn limit and rewards.

The job's taskset is built and iterated here; a rollout's tools are the task's toolsets, set up with the task's data
and called in this process (no MCP transport, harness or runtime: the trusted side runs the conversation); a finished
rollout is scored by the task's own ``@vf.reward`` methods on a ``vf.Trace`` of it.

This module imports verifiers 0.4.0 and runs agent code: import it only inside the sandbox, with the v1 runtime
(:func:`aitrainsai.jobs.job.verifiers_v1_path`) first on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.utils.decorators import discover_decorated
from verifiers.v1.utils.generic import concrete_type

from aitrainsai.chat import content_text

Message = dict[str, Any]
MAX_TASKS = 1_000_000  # a taskset that yields forever is cut here (the probe's row cap refuses it long before)


class JobTaskset:
    """The taskset a v1 job directory exports: its tasks as rows, each rollout's tools, and the task's rewards."""

    def __init__(self, job_dir: Path):
        self.job_dir = Path(job_dir).resolve()
        if str(self.job_dir) not in sys.path:
            sys.path.insert(0, str(self.job_dir))
        module = importlib.import_module("taskset")
        exported = [getattr(module, name, None) for name in getattr(module, "__all__", ())]
        found = [c for c in exported if isinstance(c, type) and issubclass(c, vf.Taskset)]
        if len(found) != 1:
            raise TypeError(f"taskset.py must list exactly one vf.Taskset subclass in __all__; it lists {len(found)}")
        cls = found[0]
        config_type = concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig
        self.taskset = cls(config_type(id="job"))
        self.tasks: list[Any] = []
        for task in self.taskset:
            if len(self.tasks) >= MAX_TASKS:
                break
            self.tasks.append(task)
        self.task_type = concrete_type(cls, vf.Task) or (type(self.tasks[0]) if self.tasks else None)
        self.reward_errors: list[str] = []

    @property
    def system_prompt(self) -> str | None:
        return self.tasks[0].data.system_prompt if self.tasks else None

    @property
    def max_turns(self) -> int:
        config = self.tasks[0].config if self.tasks else None
        return int(getattr(config, "max_turns", 1) or 1)

    def _toolsets(self, task: vf.Task) -> list[Any]:
        return [*type(task).toolsets(task.config), *type(self.taskset).toolsets(self.taskset.config)]

    def _tool_methods(self, servers: list[Any]) -> dict[str, Any]:
        """The toolsets' tools by the name the model calls, each toolset's in the order its class defines them (the
        template's: the family's, as the eval lists them; verifiers itself lists them by name, which would train on
        prompts the eval never shows)."""
        methods = {}
        for server in servers:
            prefix = server.server_name if getattr(server, "TOOL_PREFIX", "") is not None else None
            order: dict[str, int] = {}
            for klass in reversed(type(server).__mro__):
                for attribute in vars(klass):
                    order.setdefault(attribute, len(order))
            found = discover_decorated(server, "tool")
            for method in sorted(found, key=lambda m: order.get(getattr(m, "__name__", ""), len(order))):
                name = getattr(method, "tool_name", None) or method.__name__
                methods[f"{prefix}_{name}" if prefix else name] = method
        return methods

    def tool_names(self) -> list[str]:
        return list(self._tool_methods(self._toolsets(self.tasks[0]))) if self.tasks else []

    def tool_schemas(self) -> list[dict]:
        """OpenAI function schemas of the first task's tools, written as verifiers 0.2.1 writes a classic job's
        (openai-agents' strict function schema, titles dropped): one rendering for both formats, so that a job's
        format never changes the prompt its model trains on. Where openai-agents is not installed beside verifiers
        (``make install`` puts it there; a prime-rl worker's environment may lack it), the core's own description
        of a tool function, as the eval shows it."""
        from aitrainsai.tools import openai_tool, tool_schema

        try:
            from agents.function_schema import function_schema
        except ImportError:
            function_schema = None  # type: ignore[assignment]
        schemas = []
        for name, method in (self._tool_methods(self._toolsets(self.tasks[0])) if self.tasks else {}).items():
            if function_schema is None:
                schema = tool_schema(method)
                schema["function"]["name"] = name
                schemas.append(schema)
            else:
                written = function_schema(method)
                schemas.append(openai_tool(name, written.description or "", written.params_json_schema))
        return schemas

    def reward_funcs(self) -> list[dict[str, Any]]:
        """The task's reward methods, each ``{"name", "weight"}``: the first 64, names cut to 100 characters."""
        if not self.tasks:
            return []
        found = []
        for fn in self.tasks[0].hooks("reward")[:64]:
            weight = getattr(fn, "_vf_weight", 1.0)
            finite = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
            found.append({"name": str(fn.__name__)[:100], "weight": float(weight) if finite else None})
        return found

    def rows(self) -> list[dict[str, Any]]:
        """The tasks as training rows: ``prompt`` (messages), ``answer``, ``info`` (the item's world), ``example_id``
        (the task's position)."""
        return [_row(index, task) for index, task in enumerate(self.tasks)]

    def new_state(self, row: dict[str, Any]) -> dict[str, Any]:
        """A rollout: its task (the job's task of the row's position where it holds the row's prompt, answer and
        world; else one made from the row, which the trusted side gives) and that task's toolsets, set up."""
        index = row.get("example_id")
        own = _row(index, self.tasks[index]) if isinstance(index, int) and 0 <= index < len(self.tasks) else None
        if own is not None and own["prompt"] == row.get("prompt") and own["answer"] == row.get("answer") and (
                _world(own) == _world(row)):
            task = self.tasks[own["example_id"]]
        else:
            task = self._task_of(row)
        servers = self._toolsets(task)

        async def setup() -> None:
            for server in servers:
                await server.setup()
                await server.setup_task(task.data)

        asyncio.run(setup())
        return {"task": task, "tools": self._tool_methods(servers)}

    def _task_of(self, row: dict[str, Any]) -> vf.Task:
        """A task of the job's type for a row given by the trusted side (a dev example)."""
        info = row.get("info") or {}
        info = json.loads(info) if isinstance(info, str) else info
        messages = row.get("prompt") or []
        system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
        user = next((m.get("content") for m in messages if m.get("role") == "user"), "")
        task_type = self.task_type or vf.Task
        data = task_type.data_type().model_validate({"prompt": user, "system_prompt": system,
                                                     "answer": str(row.get("answer", "")),
                                                     "world": info.get("world", {})})
        config = self.tasks[0].config if self.tasks else None
        return task_type(data, config)

    def tools(self, state: dict[str, Any]) -> dict[str, Any]:
        """The rollout's tools: the toolsets' bound methods (a coroutine one's call is awaited by the server)."""
        return dict(state["tools"])

    async def score(self, row: dict[str, Any], completion: list[Message], state: dict[str, Any] | None = None
                    ) -> tuple[float, dict[str, float]]:
        """The task's reward for a finished rollout (the weighted sum of its rewards), and each reward and metric."""
        state = state or self.new_state(row)
        task = state["task"]
        trace = _trace(task, completion)
        try:
            await task.score(trace)
        except Exception as exc:
            self.reward_errors.append(f"scoring raised {type(exc).__name__}: {exc}"[:300])
            raise
        reward = trace.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            self.reward_errors.append(f"the rewards summed to {reward!r}, not a finite number")
            raise ValueError(f"the task's rewards gave {reward!r}; a reward must be a finite number")
        metrics = {name: r.score for name, r in trace.rewards.items()}
        metrics.update(trace.metrics)
        return float(reward), {k: float(v) for k, v in metrics.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _row(index: int, task: vf.Task) -> dict[str, Any]:
    return {"prompt": _prompt(task.data), "answer": str(getattr(task.data, "answer", "")),
            "info": {"world": getattr(task.data, "world", {})}, "example_id": index}


def _world(row: dict[str, Any]) -> Any:
    info = row.get("info") or {}
    info = json.loads(info) if isinstance(info, str) else info
    return info.get("world") if isinstance(info, dict) else None


def _prompt(data: vf.TaskData) -> list[Message]:
    messages: list[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                     for m in data.prompt or []]
    return messages


def _trace(task: vf.Task, completion: list[Message]) -> vf.Trace:
    """The rollout as a verifiers trace: the task's prompt, then the completion (assistant turns and tool results)."""
    messages: list[Any] = []
    for message in _prompt(task.data):
        kind = vf.SystemMessage if message["role"] == "system" else vf.UserMessage
        messages.append(kind(content=message.get("content") or ""))
    for message in completion:
        role = message.get("role")
        if role == "assistant":
            calls = [vf.ToolCall(id=str(c.get("id", "")), name=str((c.get("function") or {}).get("name", "")),
                                 arguments=str((c.get("function") or {}).get("arguments", "")))
                     for c in message.get("tool_calls") or []]
            messages.append(vf.AssistantMessage(content=content_text(message.get("content")), tool_calls=calls or None))
        elif role == "tool":
            messages.append(vf.ToolMessage(tool_call_id=str(message.get("tool_call_id", "")),
                                           content=content_text(message.get("content"))))
        else:
            messages.append(vf.UserMessage(content=content_text(message.get("content"))))
    nodes = [vf.MessageNode(parent=index - 1 if index else None, message=message,
                            sampled=isinstance(message, vf.AssistantMessage))
             for index, message in enumerate(messages)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)
