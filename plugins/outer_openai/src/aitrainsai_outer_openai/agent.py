"""A frozen agent behind any OpenAI-compatible chat-completions endpoint. It samples; it never trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field

from aitrainsai import (AgentTask, AgentTurn, ComponentConfig, Message, OuterTrainer, SampleMode, ScoredEpisode,
                        TurnMeta)

MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id")


class OpenAIAgentConfig(ComponentConfig):
    base_url: str = Field("http://localhost:8000/v1", description="the endpoint, ending in /v1")
    model: str = Field("default", description="the model name the endpoint serves")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key")
    temperature: float = Field(0.7, ge=0, le=2)
    max_tokens: int = Field(4_096, ge=16)
    timeout_s: float = Field(300.0, gt=0)


class OpenAITurnMeta(TurnMeta, total=False):
    """Why the endpoint stopped the reply ("stop", "tool_calls", "length", ...)."""

    finish_reason: str


class OpenAIAgent(OuterTrainer):
    name = "openai"
    description = "a frozen agent behind an OpenAI-compatible endpoint (evaluation only: no training)"
    Config = OpenAIAgentConfig

    def __init__(self, config: OpenAIAgentConfig, *, state_dir: Path):
        super().__init__(config, state_dir=state_dir)
        self.config: OpenAIAgentConfig = config
        self._client = None

    @property
    def policy_version(self) -> int:
        return 0

    def client(self):
        if self._client is None:
            from openai import AsyncOpenAI

            key = os.environ.get(self.config.api_key_env) or "not-needed"
            self._client = AsyncOpenAI(base_url=self.config.base_url, api_key=key, timeout=self.config.timeout_s,
                                       max_retries=2)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        """The endpoint's reply; the same in both modes (a frozen agent records nothing to learn from)."""
        from openai import OpenAIError

        wire = [{k: v for k, v in m.items() if k in MESSAGE_KEYS and v is not None} for m in messages]
        try:
            response = await self.client().chat.completions.create(
                model=self.config.model, messages=wire, tools=tools, temperature=self.config.temperature,
                max_tokens=self.config.max_tokens)
        except OpenAIError as exc:
            return AgentTurn(message={"role": "assistant", "content": ""}, parse_error=f"the endpoint failed: {exc}")
        choice = response.choices[0].message
        message: Message = {"role": "assistant", "content": choice.content or ""}
        if choice.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in choice.tool_calls]
        meta: OpenAITurnMeta = {"finish_reason": response.choices[0].finish_reason}
        return AgentTurn(message=message, meta=meta)

    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        """Frozen: nothing is trained; the mean reward is reported."""
        rewards = [episode.reward for group in groups for episode in group]
        return {"mean_reward": sum(rewards) / len(rewards) if rewards else 0.0}

    async def save_state(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "openai.json").write_text(json.dumps({"model": self.config.model,
                                                             "base_url": self.config.base_url}))

    async def load_state(self, path: Path) -> None:
        """Nothing to restore: the agent is frozen."""
