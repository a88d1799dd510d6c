"""An LLM agent on a local causal LM with LoRA, updated with importance-sampling GRPO.

``sample`` renders the conversation with the tools, samples one reply, parses its tool calls and records the prompt
tokens, the reply's tokens and the sampler's log-probability of each (a forward pass with the sampling weights).
``update`` turns each episode's turns into :class:`aitrainsai.grpo.Datum` objects with the group-relative advantage,
recomputes the log-probs under the current weights, and steps AdamW on
``-sum exp(logprob - sampler_logprob) * advantage``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from aitrainsai.chat import parse_reply
from aitrainsai.components import ComponentConfig
from aitrainsai.grpo import build_datum, group_advantages, has_signal
from aitrainsai.trainers import AgentTask, AgentTurn, OuterTrainer


class LocalLMConfig(ComponentConfig):
    learning_rate: float = Field(4e-5, gt=0, description="AdamW step size (the reference system's outer value)")
    lora_rank: int = Field(8, ge=1, le=128)
    lora_alpha: float = Field(16.0, gt=0)
    temperature: float = Field(1.0, gt=0, le=2)
    max_new_tokens: int = Field(512, ge=1, le=4_096, description="per agent turn")
    max_prompt_tokens: int = Field(7_000, ge=256, description="a longer conversation ends the episode")
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16)$")
    seed: int = 0


class LocalLMAgent(OuterTrainer):
    name = "local-lm"
    description = "an LLM agent on a local causal LM with LoRA, trained with importance-sampling GRPO"
    Config = LocalLMConfig

    def __init__(self, config: LocalLMConfig, *, state_dir: Path):
        super().__init__(config, state_dir=state_dir)
        self.version = 0
        self._model = None
        self._optimizer = None
        self._generator = None

    @property
    def policy_version(self) -> int:
        return self.version

    def model(self):
        """The model runtime (``aitrainsai_trainer_local.runtime``), loaded on first use."""
        if self._model is None:
            import torch

            from aitrainsai_trainer_local.runtime import LocalModel

            c = self.config
            self._model = LocalModel.create(lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, dtype=c.dtype, seed=c.seed)
            self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=c.learning_rate)
            self._generator = torch.Generator().manual_seed(c.seed)
        return self._model

    # -- acting ----------------------------------------------------------------------------------------------------
    async def sample(self, messages: list[dict[str, Any]], tools: list[dict], task: AgentTask) -> AgentTurn:
        model = self.model()
        prompt = model.chat.prompt_ids(messages, tools)
        if len(prompt) > self.config.max_prompt_tokens:
            return AgentTurn(message={"role": "assistant", "content": ""}, policy_version=self.version,
                             parse_error=f"the conversation is {len(prompt)} tokens, over the agent's limit")
        completion = model.generate(prompt, max_new_tokens=self.config.max_new_tokens,
                                    temperature=self.config.temperature, generator=self._generator)
        logprobs = model.logprobs(prompt, completion, temperature=self.config.temperature, grad=False).tolist()
        parsed = parse_reply(model.decode(completion))
        message = parsed.message()
        if parsed.calls:
            message["content"] = parsed.content.strip()
        return AgentTurn(message=message, prompt_tokens=prompt, completion_tokens=completion, logprobs=logprobs,
                         policy_version=self.version, parse_error=parsed.error)

    # -- learning --------------------------------------------------------------------------------------------------
    async def update(self, groups: list[list[tuple[list[AgentTurn], float]]]) -> dict[str, float]:
        import torch

        model = self.model()
        datums = []
        for group in groups:
            rewards = [reward for _, reward in group]
            if not has_signal(rewards):
                continue
            for (turns, _), advantage in zip(group, group_advantages(rewards)):
                for turn in turns:
                    if turn.completion_tokens and turn.prompt_tokens and advantage != 0.0:
                        datum = build_datum(turn.prompt_tokens, turn.completion_tokens, turn.logprobs, advantage)
                        datums.append((len(turn.prompt_tokens), datum))
        if not datums:
            return {"datums": 0.0}
        self._optimizer.zero_grad()
        total, ratios = 0.0, []
        for prompt_length, datum in datums:
            tokens = datum.model_input + [datum.target_tokens[-1]]
            prompt, completion = tokens[:prompt_length], tokens[prompt_length:]
            new = model.logprobs(prompt, completion, temperature=self.config.temperature, grad=True)
            old = torch.tensor(datum.logprobs[prompt_length - 1:], dtype=new.dtype, device=new.device)
            advantage = torch.tensor(datum.advantages[prompt_length - 1:], dtype=new.dtype, device=new.device)
            ratio = torch.exp(new - old)
            loss = -(ratio * advantage).sum()
            loss.backward()
            total += float(loss.detach())
            ratios += ratio.detach().tolist()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self._optimizer.step()
        self.version += 1
        return {"loss": total, "datums": float(len(datums)), "mean_ratio": sum(ratios) / len(ratios),
                "max_ratio": max(ratios)}

    # -- state -----------------------------------------------------------------------------------------------------
    def save_state(self, path: Path) -> None:
        import torch

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model().save(path / "adapter")
        torch.save(self._optimizer.state_dict(), path / "optimizer.pt")
        (path / "local_lm.json").write_text(json.dumps({"version": self.version}))

    def load_state(self, path: Path) -> None:
        import torch

        from aitrainsai_trainer_local.runtime import LocalModel

        path = Path(path)
        self._model = LocalModel.load(path / "adapter", dtype=self.config.dtype)
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=self.config.learning_rate)
        self._optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
        self._generator = torch.Generator().manual_seed(self.config.seed + 1)
        self.version = json.loads((path / "local_lm.json").read_text())["version"]

