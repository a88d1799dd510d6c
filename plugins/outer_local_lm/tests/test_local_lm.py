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
from aitrainsai.grpo import episode_datums  # noqa: E402
from aitrainsai.trainers import AgentTask, ScoredEpisode  # noqa: E402
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


def group(turns, rewards):
    return [[ScoredEpisode(id=f"e{i}", turns=[turn], reward=reward) for i, (turn, reward) in
             enumerate(zip(turns, rewards))]]


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
    metrics = asyncio.run(agent.update(group(turns, [1.0, 0.0])))
    assert agent.policy_version == version + 1
    assert metrics["mean_ratio"] == pytest.approx(1.0, abs=1e-3)  # on policy
    after = agent.model().logprobs(turns[0].prompt_tokens, turns[0].completion_tokens, temperature=1.0,
                                   grad=False)
    assert sum(after.tolist()) > sum(turns[0].logprobs), "the rewarded reply became more likely"
    stale = asyncio.run(agent.update(group(turns, [1.0, 0.0])))
    assert stale["mean_ratio"] != pytest.approx(1.0, abs=1e-4), "stale samples carry ratios != 1"
    assert asyncio.run(agent.update(group(turns, [0.5, 0.5]))) == {"datums": 0.0}


def test_a_multi_turn_episode_is_one_sequence_with_the_environment_masked(agent):
    """The second prompt extends the first prompt and reply as tokens (the reply as sampled, not re-rendered), so
    the episode is one datum; the tool result's tokens carry no advantage."""
    first = asyncio.run(agent.sample(MESSAGES, TOOLS, TASK))
    tool = {"role": "tool", "tool_call_id": "call_0", "name": "list_files", "content": "trainer.toml"}
    conversation = MESSAGES + [first.message, tool]
    second = asyncio.run(agent.sample(conversation, TOOLS, TASK))
    joined = first.prompt_tokens + first.completion_tokens
    assert second.prompt_tokens[:len(joined)] == joined
    between = second.prompt_tokens[len(joined):]
    assert "<tool_response>\ntrainer.toml\n</tool_response>" in agent.model().decode(between)
    (datum,) = episode_datums([first, second], 1.0)
    masked = [a for a in datum.advantages if a == 0.0]
    assert len(datum.advantages) - len(masked) == len(first.completion_tokens) + len(second.completion_tokens)
    assert len(masked) == len(first.prompt_tokens) - 1 + len(between)
    # an edited conversation (its earlier reply changed) is rendered anew: a second sequence
    edited = MESSAGES + [{"role": "assistant", "content": "something else"}, tool]
    third = asyncio.run(agent.sample(edited, TOOLS, TASK))
    assert third.prompt_tokens == agent.model().chat.prompt_ids(edited, TOOLS)
    assert len(episode_datums([first, third], 1.0)) == 2
    version = agent.policy_version
    metrics = asyncio.run(agent.update([[ScoredEpisode(id="a", turns=[first, second], reward=1.0),
                                         ScoredEpisode(id="b", turns=[first, third], reward=0.0)]]))
    assert metrics["datums"] == 3.0 and agent.policy_version == version + 1


def test_eval_mode_is_greedy_and_records_nothing(agent):
    one = asyncio.run(agent.sample(MESSAGES, TOOLS, TASK, mode="eval"))
    two = asyncio.run(agent.sample(MESSAGES, TOOLS, TASK, mode="eval"))
    assert one.message == two.message
    assert one.prompt_tokens == one.completion_tokens == one.logprobs == []
