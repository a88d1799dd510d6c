"""Trains a job inside the sandbox: the job's verifiers environment supplies the prompts, the tools (with state of
their own per rollout) and the rubric; the LoRA adapter and per-step metrics go to ``/tmp/out``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import tomllib
from pathlib import Path

JOB = Path("/tmp/job")
OUT = Path("/tmp/out")


def main() -> None:
    from aitrainsai.verifiers_env import JobEnvironment
    from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer
    from aitrainsai_trainer_local.inner import LocalJobConfig
    from aitrainsai_trainer_local.rollout import Conversation

    config = LocalJobConfig.model_validate(tomllib.loads((JOB / "trainer.toml").read_text()))
    env = JobEnvironment(JOB)
    rows = env.rows()
    schemas = env.tool_schemas()
    turns = min(env.max_turns, config.max_turns)
    print(f"{len(rows)} rows, tools {', '.join(env.tool_names())}, {turns} of {env.max_turns} turns in training; "
          f"{config}", flush=True)

    def start_for(row: dict):
        def start():
            state = env.new_state(row)
            prompt = [dict(m) for m in row["prompt"]]
            conversation = Conversation(prompt, env_tools(env, state), schemas, turns)

            def reward(transcript: list[dict]) -> float:
                value, _ = asyncio.run(env.score(row, transcript[len(prompt):], state))
                return value

            return conversation, reward
        return start

    grpo = GRPOConfig(steps=config.steps, learning_rate=config.learning_rate,
                      prompts_per_step=config.prompts_per_step, group_size=config.group_size,
                      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                      lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, seed=config.seed,
                      dtype=os.environ.get("AITRAINSAI_DTYPE", "auto"))
    trainer = GRPOTrainer(grpo, [Example(start_for(row)) for row in rows])
    history = []

    def record(step) -> None:
        history.append(step.to_dict())
        print(f"step {step.step}: reward {step.reward_mean:.3f} +- {step.reward_std:.3f}, loss {step.loss:.4f}, "
              f"{step.seconds_total:.1f} s", flush=True)
        (OUT / "metrics.json").write_text(json.dumps({"steps": history}))

    trainer.train(on_step=record)
    trainer.save(OUT / "adapter")
    if env.reward_errors:
        print(f"rubric errors (scored 0): {sorted(set(env.reward_errors))[:5]}", flush=True)


def env_tools(env, state) -> dict:
    """The environment's tools as plain callables, with its hidden arguments (the item's world) injected from this
    rollout's state; each keeps the tool's own signature and docstring for validation."""
    import verifiers as vf

    tools = {}
    for name, tool in env.env.tool_map.items():
        def call(_name=name, _tool=tool, **arguments):
            if isinstance(env.env, vf.StatefulToolEnv):
                arguments = env.env.update_tool_args(_name, dict(arguments), [], state)
            value = _tool(**arguments)
            return asyncio.run(value) if inspect.iscoroutine(value) else value

        tools[name] = functools.update_wrapper(functools.partial(call), tool)
    return tools


if __name__ == "__main__":
    main()
