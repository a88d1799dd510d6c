"""The local-lm agent on the real base model: sampling records aligned tokens and log-probs; the IS update moves
the adapter and reports ratios of 1 on policy."""

import asyncio
import math

import pytest

pytest.importorskip("aitrainsai_trainer_local")


def test_the_agent_uses_only_the_public_runtime_of_the_local_trainer():
    """No internals of aitrainsai_trainer_local: its public runtime module and nothing else."""
    import ast
    from pathlib import Path

    import aitrainsai_outer_local_lm

    for source in Path(aitrainsai_outer_local_lm.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("aitrainsai_trainer_local"):
                    assert name == "aitrainsai_trainer_local.runtime", (source.name, name)

from aitrainsai.testing import OuterTrainerConformance  # noqa: E402
from aitrainsai.trainers import AgentTask  # noqa: E402
from aitrainsai_outer_local_lm.agent import LocalLMAgent  # noqa: E402

TASK = AgentTask(family="calc_chain", level=1, levels=[1], held_out=False, template={}, allowed_bases=["a"],
                 max_train_steps=10, max_dataset_size=10)
TOOLS = [{"type": "function", "function": {"name": "list_files", "description": "List the workspace files.",
                                           "parameters": {"type": "object", "properties": {}, "required": []}}}]
MESSAGES = [{"role": "system", "content": "You write training jobs."},
            {"role": "user", "content": "List the files, then say done."}]


class TestLocalLMConformance(OuterTrainerConformance):
    trainer = LocalLMAgent
    distribution = "aitrainsai-outer-local-lm"

    def make(self, tmp_path):
        return LocalLMAgent(LocalLMAgent.Config(max_new_tokens=8), state_dir=tmp_path)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    return LocalLMAgent(LocalLMAgent.Config(max_new_tokens=12, learning_rate=1e-3),
                        state_dir=tmp_path_factory.mktemp("agent"))


def test_a_sampled_turn_carries_aligned_tokens_and_logprobs(agent):
    turn = asyncio.run(agent.sample(MESSAGES, TOOLS, TASK))
    assert turn.prompt_tokens and 0 < len(turn.completion_tokens) <= 12
    assert len(turn.logprobs) == len(turn.completion_tokens)
    assert all(lp <= 0 and math.isfinite(lp) for lp in turn.logprobs)
    assert turn.message["role"] == "assistant" and turn.policy_version == agent.policy_version
    again = agent.model().logprobs(turn.prompt_tokens, turn.completion_tokens, temperature=1.0, grad=False).tolist()
    assert again == pytest.approx(turn.logprobs, abs=1e-4)


def test_the_update_is_importance_sampled_and_moves_the_policy(agent):
    turns = [asyncio.run(agent.sample(MESSAGES, TOOLS, TASK)) for _ in range(2)]
    version = agent.policy_version
    metrics = asyncio.run(agent.update([[([turns[0]], 1.0), ([turns[1]], 0.0)]]))
    assert agent.policy_version == version + 1
    assert metrics["mean_ratio"] == pytest.approx(1.0, abs=1e-3)  # on policy
    after = agent.model().logprobs(turns[0].prompt_tokens, turns[0].completion_tokens, temperature=1.0,
                                   grad=False)
    assert sum(after.tolist()) > sum(turns[0].logprobs), "the rewarded reply became more likely"
    stale = asyncio.run(agent.update([[([turns[0]], 1.0), ([turns[1]], 0.0)]]))
    assert stale["mean_ratio"] != pytest.approx(1.0, abs=1e-4), "stale samples carry ratios != 1"
    assert asyncio.run(agent.update([[([turns[0]], 0.5), ([turns[1]], 0.5)]])) == {"datums": 0.0}
