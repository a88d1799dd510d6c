"""An LLM agent on a local causal LM with LoRA, updated with importance-sampling GRPO.

``sample`` renders the conversation with the tools (:mod:`aitrainsai.chat`; a conversation it replied to before
continues from the tokens it saw and sampled), samples one reply, parses its tool calls and records the prompt tokens,
the reply's tokens and the sampler's log-probability of each (a forward pass with the sampling weights). ``update``
turns each episode into one sequence (the environment's tokens masked) with the group-relative advantage
(:func:`aitrainsai.grpo.episode_datums`), recomputes the log-probs under the current weights, and steps AdamW on
``-sum exp(logprob - sampler_logprob) * advantage``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import Field

from aitrainsai.chat import parse_reply
from aitrainsai.components import ComponentConfig
from aitrainsai.grpo import episode_datums, group_advantages, has_signal
from aitrainsai.trainers import AgentTask, AgentTurn, OuterTrainer, SampleMode, ScoredEpisode


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
        self._continuations: dict[str, tuple[list[int], bool]] = {}  # the tokens up to each reply it sampled

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
    async def sample(self, messages: list[dict[str, Any]], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        """One reply. ``mode="train"`` samples at the configured temperature and records the tokens and their
        log-probs; ``mode="eval"`` is greedy (no random draw, so evaluations do not shift the training samples) and
        records nothing to learn from."""
        model = self.model()
        prompt = self._prompt(model, messages, tools)
        if len(prompt) > self.config.max_prompt_tokens:
            return AgentTurn(message={"role": "assistant", "content": ""}, policy_version=self.version,
                             parse_error=f"the conversation is {len(prompt)} tokens, over the agent's limit")
        temperature = self.config.temperature if mode == "train" else 0.0
        completion = model.generate(prompt, max_new_tokens=self.config.max_new_tokens, temperature=temperature,
                                    generator=self._generator)
        parsed = parse_reply(model.decode(completion))
        message = parsed.message()
        if parsed.calls:
            message["content"] = parsed.content.strip()
        self._remember(messages + [message], tools, prompt + completion, completion, model)
        if mode == "eval":
            return AgentTurn(message=message, policy_version=self.version, parse_error=parsed.error)
        logprobs = model.logprobs(prompt, completion, temperature=temperature, grad=False).tolist()
        return AgentTurn(message=message, prompt_tokens=prompt, completion_tokens=completion, logprobs=logprobs,
                         policy_version=self.version, parse_error=parsed.error)

    def _prompt(self, model, messages: list[dict[str, Any]], tools: list[dict]) -> list[int]:
        """The prompt's tokens. Where the conversation continues one this agent replied to (the same messages up to
        its reply), the earlier tokens are those it saw and sampled, then the template's tokens for what came after:
        the prompt extends the last one as a token prefix, so an episode trains as one sequence. Otherwise (a
        conversation it has not seen, or one edited since) the whole conversation is rendered anew."""
        for end in range(len(messages), 0, -1):
            if messages[end - 1].get("role") != "assistant":
                continue
            known = self._continuations.get(_fingerprint(messages[:end], tools))
            if known is not None:
                tokens, ended = known
                return tokens + model.chat.bridge_ids(messages[end:], reply_ended=ended, cache=False)
            break  # only the last reply can continue: earlier ones were continued already, or never will be
        return model.chat.prompt_ids(messages, tools)

    def _remember(self, messages: list[dict[str, Any]], tools: list[dict], tokens: list[int], completion: list[int],
                  model) -> None:
        ended = bool(completion) and completion[-1] == model.chat.end_of_turn_id
        self._continuations[_fingerprint(messages, tools)] = (tokens, ended)
        while len(self._continuations) > MAX_CONTINUATIONS:  # oldest first: finished episodes' replies
            del self._continuations[next(iter(self._continuations))]

    # -- learning --------------------------------------------------------------------------------------------------
    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        """One AdamW step on every episode of every group with signal. An episode is one sequence (its prompts and
        replies, the environment's tokens masked) where each prompt extends the last; else the fewest sequences
        that do (:func:`aitrainsai.grpo.episode_datums`)."""
        import torch

        datums = []
        for group in groups:
            rewards = [episode.reward for episode in group]
            if not has_signal(rewards):
                continue
            for episode, advantage in zip(group, group_advantages(rewards)):
                if advantage != 0.0:
                    datums += episode_datums(episode.turns, advantage)
        if not datums:
            return {"datums": 0.0}
        model = self.model()
        self._optimizer.zero_grad()
        total, ratios = 0.0, []
        for datum in datums:
            first = next(i for i, a in enumerate(datum.advantages) if a != 0.0)  # the first reply token's target
            tokens = datum.model_input + [datum.target_tokens[-1]]
            prompt, rest = tokens[:first + 1], tokens[first + 1:]
            new = model.logprobs(prompt, rest, temperature=self.config.temperature, grad=True)
            old = torch.tensor(datum.logprobs[first:], dtype=new.dtype, device=new.device)
            advantage = torch.tensor(datum.advantages[first:], dtype=new.dtype, device=new.device)
            trained = advantage != 0  # the environment's tokens carry no loss
            ratio = torch.exp(new - old)
            loss = -(ratio * advantage)[trained].sum()
            loss.backward()
            total += float(loss.detach())
            ratios += ratio.detach()[trained].tolist()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self._optimizer.step()
        self.version += 1
        return {"loss": total, "datums": float(len(datums)), "tokens": float(sum(len(d.model_input) for d in datums)),
                "mean_ratio": sum(ratios) / len(ratios), "max_ratio": max(ratios)}

    # -- state -----------------------------------------------------------------------------------------------------
    async def save_state(self, path: Path) -> None:
        """The adapter, the optimizer and the version, written in a thread (the event loop keeps running)."""
        await asyncio.to_thread(self._save, Path(path))

    def _save(self, path: Path) -> None:
        import torch

        path.mkdir(parents=True, exist_ok=True)
        self.model().save(path / "adapter")
        torch.save(self._optimizer.state_dict(), path / "optimizer.pt")
        (path / "local_lm.json").write_text(json.dumps({"version": self.version}))

    async def load_state(self, path: Path) -> None:
        await asyncio.to_thread(self._load, Path(path))

    def _load(self, path: Path) -> None:
        import torch

        from aitrainsai_trainer_local.runtime import LocalModel

        self._model = LocalModel.load(path / "adapter", dtype=self.config.dtype)
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=self.config.learning_rate)
        self._optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
        self._generator = torch.Generator().manual_seed(self.config.seed + 1)
        self._continuations.clear()
        self.version = json.loads((path / "local_lm.json").read_text())["version"]


MAX_CONTINUATIONS = 1024


def _fingerprint(messages: list[dict[str, Any]], tools: list[dict]) -> str:
    text = json.dumps([tools, messages], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
