"""A job's environment for a trainer that runs verifiers environments in its own process (prime-rl's orchestrator does):
a verifiers ``ToolEnv`` whose training rows are the ones the probe froze (:func:`aitrainsai.jobs.job.frozen_rows`; the
job's environment must serve exactly those) and whose tool results and rewards come from the job's environment served
from the sandbox (:class:`aitrainsai.jobs.remote_env.RemoteEnvironment`). The job's code never runs in the trainer's
process; what comes back is data, checked by the remote protocol's types and caps.

Import it where verifiers is installed (the classic API, 0.1.15 to 0.2.x). One sandbox serves one environment
object; calls to it are serialised, since the protocol is one request at a time.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import threading
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset
from verifiers.types import Tool, ToolMessage

from aitrainsai.chat import openai_message
from aitrainsai.jobs.job import frozen_rows
from aitrainsai.jobs.remote_env import RemoteEnvironment
from aitrainsai.isolation import Limits

ROLLOUT = "aitrainsai_rollout"  # the sandbox's rollout id, in a rollout's state
ROW = "aitrainsai_row"  # the rollout's frozen row, in its state


class SandboxedEnv(vf.ToolEnv):
    """The environment of the job in ``job_dir``, answered from a sandbox with ``limits``."""

    def __init__(self, job_dir: Path, *, limits: Limits | None = None, **kwargs: Any):
        self.frozen = frozen_rows(Path(job_dir))
        self.remote = RemoteEnvironment(Path(job_dir), limits=limits)
        self.remote.__enter__()
        atexit.register(self.close)
        self._lock = threading.Lock()
        info = self.remote.load()
        self.remote.checked_rows(info, self.frozen)
        self.remote.checked_samples(self.frozen)  # the rubric scores the probe's samples as it did there
        dataset = Dataset.from_list([{"prompt": self.frozen.prompt(index), "answer": row.answer,
                                      "info": json.dumps({"row": index}), "task": "job"}
                                     for index, row in enumerate(self.frozen.rows)])
        super().__init__(tools=[], max_turns=info.max_turns, dataset=dataset,
                         rubric=vf.Rubric(funcs=[self.job_reward], weights=[1.0]), **kwargs)
        self.tool_defs = [Tool(name=s.function["name"], description=s.function.get("description", ""),
                               parameters=s.function.get("parameters", {})) for s in info.tool_schemas]
        self.tool_map = {tool.name: tool for tool in self.tool_defs}
        self.system_prompt = info.system_prompt  # for reading: the rows' prompts carry it already

    def close(self) -> None:
        with self._lock:
            self.remote.close()

    async def _call(self, method, *args: Any) -> Any:
        def locked():
            with self._lock:
                return method(*args)
        return await asyncio.to_thread(locked)

    async def setup_state(self, state: vf.State) -> vf.State:
        info = state.get("info") or {}
        info = json.loads(info) if isinstance(info, str) else info
        state[ROW] = int(info["row"])
        state[ROLLOUT] = await self._call(self.remote.start, None, self.frozen.row_data(state[ROW]))
        return await super().setup_state(state)

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        replies = []
        for call in getattr(messages[-1], "tool_calls", None) or []:
            content = await self._call(self.remote.tool, state[ROLLOUT], call.name, call.arguments)
            replies.append(ToolMessage(role="tool", content=content, tool_call_id=call.id))
        return replies

    async def job_reward(self, completion: vf.Messages, state: vf.State, **kwargs: Any) -> float:
        """The job's rubric, run in the sandbox on the rollout's completion; 0 for a row that is a hidden-eval item
        (scored like the others, so that the job's code cannot tell it apart: its group has no advantage)."""
        score = await self._call(self.remote.score, state[ROLLOUT], [openai_message(m) for m in completion])
        return score.reward if self.frozen.trained(state[ROW]) else 0.0
