"""The outer agent as an episode sees it: a :class:`Policy` samples one turn from the conversation so far. Outer
trainers provide the learning ones; :class:`SubmitFiles` is the scripted one ``aitrainsai job run`` plays."""

from __future__ import annotations

import json
from typing import Protocol

from aitrainsai.chat import Message, ToolCall
from aitrainsai.trainers import AgentTask, AgentTurn, SampleMode


class Policy(Protocol):
    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn: ...


class SubmitFiles:
    """A scripted agent: writes the given files (the task's template where none is given) and submits once."""

    def __init__(self, files: dict[str, str] | None = None):
        self.files = dict(files or {})

    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        if any(m.get("role") == "tool" for m in messages):
            return AgentTurn(message={"role": "assistant", "content": "Submitted."})
        files = {**task.template, **self.files}
        calls: list[ToolCall] = [
            {"id": f"w{i}", "type": "function",
             "function": {"name": "write_file", "arguments": json.dumps({"path": name, "content": text})}}
            for i, (name, text) in enumerate(files.items())]
        calls.append({"id": "submit", "type": "function", "function": {"name": "submit_job", "arguments": "{}"}})
        return AgentTurn(message={"role": "assistant", "content": "Writing the job.", "tool_calls": calls})
