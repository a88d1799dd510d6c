"""Training data matches what was sampled, in both chat formats, on the local server: every trained token and
log-prob is one the sampler saw or produced (Hermes: one datum per episode; Qwen3.5: the history is rendered anew,
a turn whose prompt does not extend the last is a datum of its own); stable_reinforce tags every position with
its sequence; a resume makes no client it throws away."""

import asyncio

import pytest
from aitrainsai.grpo import episode_datums
from aitrainsai.trainers import ScoredEpisode
from aitrainsai_outer_tinker import trainer as trainer_module
from aitrainsai_outer_tinker.trainer import TinkerConfig, TinkerTrainer, segments

from aitrainsai.trainers import AgentTask

MODEL = "SmolLM2-135M-Instruct"
TASK = AgentTask(family="calc_chain", level=1, levels=[1], held_out=False, template={}, allowed_bases=["a"],
                 max_train_steps=10, max_dataset_size=10)
TOOLS = [{"type": "function", "function": {"name": "list_files", "description": "List the workspace files.",
                                           "parameters": {"type": "object", "properties": {}, "required": []}}}]
MESSAGES = [{"role": "system", "content": "You write training jobs."},
            {"role": "user", "content": "List the files, then say done."}]


def options(server, **changes) -> dict:
    values = {"base_url": server.base_url, "base_model": MODEL, "max_tokens": 12, "retries": 1, "backoff_s": 0.2,
              "call_timeout_s": 300.0}
    return values | changes

TOOL = {"role": "tool", "tool_call_id": "call_0", "name": "list_files", "content": "trainer.toml\nrubric.py"}


@pytest.fixture
def server(tinker_server, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", tinker_server.api_key)
    yield tinker_server
    tinker_server.clear_faults()


def _check_exact(turns, datums):
    """Each datum's tokens are its turns' prompts and completions, exactly; the trained positions (advantage not 0)
    are the completions with the sampler's log-probs, in order."""
    trained = [(t, lp) for d in datums for t, lp, a in zip(d.target_tokens, d.logprobs, d.advantages) if a != 0.0]
    assert trained == [(t, lp) for turn in turns for t, lp in zip(turn.completion_tokens, turn.logprobs)]
    k = 0
    for datum in datums:
        full = datum.model_input + datum.target_tokens[-1:]
        start = 0
        while k < len(turns) and full[:len(turns[k].prompt_tokens)] == turns[k].prompt_tokens:
            end = len(turns[k].prompt_tokens) + len(turns[k].completion_tokens)
            assert full[len(turns[k].prompt_tokens):end] == turns[k].completion_tokens
            start, k = end, k + 1
        assert start == len(full)
    assert k == len(turns)


@pytest.mark.parametrize("chat_format", ["hermes", "qwen3_5"])
def test_every_trained_token_and_logprob_is_the_one_sampled(server, tmp_path, chat_format):
    async def scenario():
        trainer = TinkerTrainer(TinkerConfig(**options(server, max_tokens=8, chat_format=chat_format)),
                                state_dir=tmp_path / "policy")
        await trainer.start()
        try:
            first = await trainer.sample(MESSAGES, TOOLS, TASK)
            second = await trainer.sample(MESSAGES + [first.message, TOOL], TOOLS, TASK)
            other = await trainer.sample(MESSAGES, TOOLS, TASK)
            episodes = [ScoredEpisode(id="ep", turns=[first, second], reward=1.0),
                        ScoredEpisode(id="other", turns=[other], reward=0.0)]
            sent = trainer.datums([episodes])
            metrics = await trainer.update([episodes])
            return trainer, first, second, other, sent, metrics
        finally:
            await trainer.close()

    trainer, first, second, other, sent, metrics = asyncio.run(scenario())
    datums = episode_datums([first, second], 1.0)
    _check_exact([first, second], datums)
    joined = first.prompt_tokens + first.completion_tokens
    if chat_format == "hermes":
        assert second.prompt_tokens[:len(joined)] == joined and len(datums) == 1
    else:  # rendered anew: the earlier reply as the template writes it, not as sampled
        text = trainer._chat.tokenizer.decode(second.prompt_tokens)
        assert "<think>\n\n</think>\n\n" in text and "<tool_response>\ntrainer.toml\nrubric.py\n</tool_response>" in text
        assert len(datums) == (1 if second.prompt_tokens[:len(joined)] == joined else 2)
    assert metrics["datums"] == float(len(sent)) == float(len(datums) + 1)
    # the service's log-probs of the trained tokens are the sampler's (same weights): the ratio is 1
    assert metrics["mean_ratio"] == pytest.approx(1.0, abs=0.02) and metrics["max_ratio"] < 1.1


def test_segments_tile_each_datum_and_name_the_sequences():
    from aitrainsai.trainers import AgentTurn

    def turn(prompt, completion, seq):
        return AgentTurn(message={"role": "assistant"}, prompt_tokens=prompt, completion_tokens=completion,
                         logprobs=[-1.0] * len(completion), meta={"sequence_id": seq})

    first, extended, fresh = turn([1, 2, 3], [4, 5], "s1"), turn([1, 2, 3, 4, 5, 6, 7], [8], "s2"), \
        turn([9, 9], [10], "s3")
    tiles = segments([first, extended, fresh])
    assert tiles == [[("prompt", "s1", 0, 3), ("sampled", "s1", 0, 2), ("prompt", "s2", 5, 2), ("sampled", "s2", 0, 1)],
                     [("prompt", "s3", 0, 2), ("sampled", "s3", 0, 1)]]
    datums = episode_datums([first, extended, fresh], 1.0)
    assert [sum(t[3] for t in tile) for tile in tiles] == [len(d.model_input) + 1 for d in datums]


def test_a_resume_creates_no_client_it_throws_away(server, tmp_path, monkeypatch):
    async def train_and_save():
        trainer = TinkerTrainer(TinkerConfig(**options(server, max_tokens=4)), state_dir=tmp_path / "a")
        await trainer.start()
        try:
            turns = [await trainer.sample(MESSAGES, [], TASK) for _ in range(2)]
            await trainer.update([[ScoredEpisode(id=f"e{i}", turns=[t], reward=float(i))
                                   for i, t in enumerate(turns)]])
            await trainer.save_state(tmp_path / "state")
        finally:
            await trainer.close()

    asyncio.run(train_and_save())
    made = {"fresh": 0, "samplers": 0}
    fresh, sampler = TinkerTrainer._new_training_client, TinkerTrainer._new_sampler

    def counting_fresh(self):
        made["fresh"] += 1
        return fresh(self)

    async def counting_sampler(self):
        made["samplers"] += 1
        return await sampler(self)

    monkeypatch.setattr(TinkerTrainer, "_new_training_client", counting_fresh)
    monkeypatch.setattr(TinkerTrainer, "_new_sampler", counting_sampler)

    async def resume():
        trainer = TinkerTrainer(TinkerConfig(**options(server, max_tokens=4)), state_dir=tmp_path / "b")
        await trainer.start()
        try:
            assert made == {"fresh": 0, "samplers": 0}  # start opens a session, nothing more
            await trainer.load_state(tmp_path / "state")
            await trainer.sample(MESSAGES, [], TASK)
            return trainer.policy_version
        finally:
            await trainer.close()

    assert asyncio.run(resume()) == 1
    assert made == {"fresh": 0, "samplers": 1}
    assert trainer_module.REFERENCE_MODEL == "Qwen/Qwen3.6-35B-A3B"


def test_the_default_base_starts_and_a_retired_one_is_refused_naming_its_replacement(server, tmp_path, monkeypatch):
    """The session's server offers only SmolLM2 and Qwen3.6-35B-A3B (``--serve-as``), as today's service offers
    only current models: the default base starts there in Qwen3.5's format (Qwen3.5's tokenizer from tml-renderers,
    offline); the retired Qwen3-30B-A3B-Instruct-2507 is refused in one line that names its replacement."""
    import sys
    from pathlib import Path

    from aitrainsai.trainers import StopRun
    from aitrainsai_outer_tinker.costs import Prices

    pinned = Path(__file__).resolve().parents[3] / ".venv" / "pinned" / "tinker-renderers"
    if not pinned.is_dir():
        pytest.skip(f"tml-renderers is not installed in {pinned} (make install does it)")
    pytest.importorskip("torch", reason="tml-renderers imports torch")
    monkeypatch.syspath_prepend(str(pinned))
    base = {"base_url": server.base_url, "retries": 0, "call_timeout_s": 60.0, "tokenizer": "tml-renderers",
            "train_unembed": False}  # the local model has no unembedding LoRA

    async def start(**changes):
        trainer = TinkerTrainer(TinkerConfig(**(base | changes)), state_dir=tmp_path / "policy")
        try:
            await trainer.start()
            await trainer._ready()
            return trainer._chat.format, trainer.config.model, trainer._sampler[0]
        finally:
            await trainer.close()

    assert asyncio.run(start()) == ("qwen3_5", "Qwen/Qwen3.6-35B-A3B", 0)
    with pytest.raises(StopRun) as refused:
        asyncio.run(start(base_model="Qwen/Qwen3-30B-A3B-Instruct-2507", prices=Prices()))
    line = str(refused.value)
    assert "\n" not in line and not refused.value.resumable
    assert "was retired by Tinker on 2026-06-12; its replacement is 'Qwen/Qwen3.6-35B-A3B'" in line
    assert "the service offers: SmolLM2-135M-Instruct, Qwen/Qwen3.6-35B-A3B" in line


def test_stable_reinforce_trains_multi_turn_episodes_of_this_session_and_skips_older_ones(server, tmp_path):
    """With ``loss = "stable_reinforce"`` the samplers record stability info, every datum names the sequence of
    each prompt and sampled run (a two-turn episode is one chained datum), and the service trains it; an episode
    sampled in an earlier session (before a resume) cannot be trained with this loss and is left out."""
    async def scenario():
        trainer = TinkerTrainer(TinkerConfig(**options(server, max_tokens=6, loss="stable_reinforce")),
                                state_dir=tmp_path / "policy")
        await trainer.start()
        try:
            first = await trainer.sample(MESSAGES, TOOLS, TASK)
            second = await trainer.sample(MESSAGES + [first.message, TOOL], TOOLS, TASK)
            other = await trainer.sample(MESSAGES, TOOLS, TASK)
            stale = other.model_copy(update={"meta": other.meta | {"session": "an-earlier-session"}})
            episodes = [ScoredEpisode(id="ep", turns=[first, second], reward=1.0),
                        ScoredEpisode(id="other", turns=[other], reward=0.0)]
            metrics = await trainer.update([episodes])
            old = await trainer.update([[ScoredEpisode(id="old", turns=[stale], reward=1.0),
                                         ScoredEpisode(id="new", turns=[other], reward=0.0)]])
            return first, second, metrics, old
        finally:
            await trainer.close()

    first, second, metrics, old = asyncio.run(scenario())
    assert first.meta["sequence_id"] and second.meta["sequence_id"] != first.meta["sequence_id"]
    tiles = segments([first, second])
    assert len(tiles) == 1 and [kind for kind, *_ in tiles[0]] == ["prompt", "sampled", "prompt", "sampled"]
    assert metrics["datums"] == 2.0 and metrics["optimizer_steps"] == 1.0
    assert old["datums"] == 1.0  # only this session's episode
