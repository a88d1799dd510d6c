"""The tinker trainer through the real ``tinker`` SDK over loopback HTTP, against the local Tinker-compatible server
(SmolLM2-135M with LoRA): the conformance kit; sampling with the sampler's log-probs; an episode through the
episode's tools; updates and a sampler per version; save, SIGKILL, resume with identical next-step log-probs; a
measured learning signal; faults (429, 500, no answer, a refused key); the cost cap; export; in both chat formats,
every trained token and log-prob the one sampled; stable_reinforce provenance; a resume with no throwaway client;
the default base and a retired one."""

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aitrainsai import AgentTask, AgentTurn, ScoredEpisode, StopRun, episode_datums
from aitrainsai.testing import OuterTrainerConformance
from aitrainsai_outer_tinker.costs import Prices
from aitrainsai_outer_tinker.state import STATE_FILE
from aitrainsai_outer_tinker.trainer import REFERENCE_MODEL, TinkerConfig, TinkerTrainer, segments

MODEL = "SmolLM2-135M-Instruct"
TASK = AgentTask(family="calc_chain", level=1, levels=[1], held_out=False, template={}, allowed_bases=["a"],
                 max_train_steps=10, max_dataset_size=10)
TOOLS = [{"type": "function", "function": {"name": "list_files", "description": "List the workspace files.",
                                           "parameters": {"type": "object", "properties": {}, "required": []}}}]
MESSAGES = [{"role": "system", "content": "You write training jobs."},
            {"role": "user", "content": "List the files, then say done."}]


def options(server, **changes) -> dict:
    values = {"base_url": server.base_url, "base_model": MODEL, "max_tokens": 12, "retries": 1, "backoff_s": 0.2,
              "call_timeout_s": 300.0, "prices": {"prefill": 0.12, "sampled": 0.30, "trained": 0.36}}
    return values | changes


def make(server, state_dir, **changes) -> TinkerTrainer:
    return TinkerTrainer(TinkerConfig(**options(server, **changes)), state_dir=state_dir)


async def started(trainer: TinkerTrainer) -> TinkerTrainer:
    await trainer.start()
    return trainer


def group(turns: list[AgentTurn], rewards: list[float]) -> list[ScoredEpisode]:
    return [ScoredEpisode(id=f"e{i}", turns=[t], reward=r) for i, (t, r) in enumerate(zip(turns, rewards))]


class TestTinkerConformance(OuterTrainerConformance):
    trainer = TinkerTrainer
    distribution = "aitrainsai-outer-tinker"

    @pytest.fixture(autouse=True)
    def _server(self, server):
        self.local = server

    def make(self, tmp_path):
        return make(self.local, tmp_path)


def test_sampling_keeps_the_samplers_logprobs_and_eval_is_greedy(server, tmp_path):
    async def scenario():
        trainer = await started(make(server, tmp_path, max_tokens=6))
        try:
            turn = await trainer.sample(MESSAGES, TOOLS, TASK)
            rescored = await trainer.logprobs(turn.prompt_tokens + turn.completion_tokens)
            greedy = [await trainer.sample(MESSAGES, TOOLS, TASK, mode="eval") for _ in range(2)]
            return trainer, turn, rescored, greedy
        finally:
            await trainer.close()

    trainer, turn, rescored, greedy = asyncio.run(scenario())
    assert turn.prompt_tokens == trainer._chat.prompt(MESSAGES, TOOLS)
    assert 0 < len(turn.completion_tokens) <= 6 and len(turn.logprobs) == len(turn.completion_tokens)
    assert all(math.isfinite(x) and x <= 0 for x in turn.logprobs) and turn.policy_version == 0
    assert rescored[-len(turn.completion_tokens):] == pytest.approx(turn.logprobs, abs=2e-3)
    assert greedy[0].message == greedy[1].message and greedy[0].completion_tokens == greedy[0].logprobs == []
    assert trainer.costs.step.prefill == 3 * len(turn.prompt_tokens) and trainer.costs.step.sampled > 0


@pytest.mark.slow
def test_an_episode_through_the_tools(server, tmp_path, make_episode):
    """Scripted calls use every episode tool (the submission is rejected), then the trainer samples on the real
    transcript: its prompt holds the tool results, and its turn carries tokens and log-probs. Slow: the episode's
    opening is ~5,000 tokens, minutes of prefill for the local server on a loaded 2-core CPU."""
    episode = make_episode()
    script = [call("list_files"), call("read_file", path="trainer.toml"),
              call("edit_file", path="trainer.toml", old="steps", new="steps"),
              call("get_baseline_scores"),
              call("write_file", path="trainer.toml", content='base_model = "gpt-9"\nsteps = 1\n'),
              call("submit_job")]

    async def scenario():
        trainer = await started(make(server, tmp_path / "policy", max_tokens=8))
        try:
            policy = ScriptThenModel(trainer, script, model_turns=1)
            return trainer, policy, await episode.play(policy)
        finally:
            await trainer.close()

    trainer, policy, result = asyncio.run(scenario())
    names = [m.get("name") for m in episode.messages if m["role"] == "tool"]
    assert names[:6] == ["list_files", "read_file", "edit_file", "get_baseline_scores", "write_file", "submit_job"]
    assert [a.ok for a in episode.attempts][:1] == [False]
    (sampled,) = policy.sampled
    assert sampled in result.turns and sampled.completion_tokens
    assert len(sampled.logprobs) == len(sampled.completion_tokens) and sampled.policy_version == 0
    seen = trainer._chat.tokenizer.decode(sampled.prompt_tokens)
    assert '<tool_response>\n{"tiny-a": 0.3, "tiny-b": 0.4}\n</tool_response>' in seen
    assert "gpt-9" in seen and "is not allowed" in seen  # the rejected submission's problems
    assert len(episode_datums(result.turns, 1.0)) == 1  # scripted turns have no tokens: one datum, the model's


def test_updates_train_one_datum_per_episode_with_a_sampler_per_version(server, tmp_path):
    """A conversation the trainer replied to continues from the exact tokens it sampled (the tool result's tokens
    in between), so the episode is one datum. Two updates give two sampler versions; the state and the export are
    service paths, with no key in them."""
    tool = {"role": "tool", "tool_call_id": "call_0", "name": "list_files", "content": "trainer.toml"}

    async def scenario():
        trainer = await started(make(server, tmp_path / "policy", max_tokens=6))
        try:
            first = await trainer.sample(MESSAGES, [], TASK)
            second = await trainer.sample(MESSAGES + [first.message, tool], [], TASK)
            other = await trainer.sample(MESSAGES, [], TASK)
            one = await trainer.update([[ScoredEpisode(id="ep", turns=[first, second], reward=1.0),
                                         ScoredEpisode(id="other", turns=[other], reward=0.0)]])
            after = await trainer.sample(MESSAGES, [], TASK)
            two = await trainer.update([group([other, after], [0.0, 1.0])])
            await trainer.save_state(tmp_path / "state")
            return trainer, first, second, after, one, two, await trainer.export()
        finally:
            await trainer.close()

    trainer, first, second, after, one, two, exported = asyncio.run(scenario())
    joined = first.prompt_tokens + first.completion_tokens
    assert second.prompt_tokens[:len(joined)] == joined
    assert "<tool_response>\ntrainer.toml\n</tool_response>" in trainer._chat.tokenizer.decode(
        second.prompt_tokens[len(joined):])
    assert len(episode_datums([first, second], 1.0)) == 1
    assert one["datums"] == 2.0 and two["datums"] == 2.0 and trainer.policy_version == 2
    assert after.policy_version == 1 and one["mean_ratio"] == pytest.approx(1.0, abs=0.02)
    for metrics in (one, two):
        assert {"cost_usd", "cost_usd_total", "tokens_prefill", "tokens_sampled", "tokens_trained"} <= set(metrics)
        assert metrics["tokens_trained"] > 0 and metrics["cost_usd"] > 0
    assert one["tokens_prefill"] == len(first.prompt_tokens) + len(second.prompt_tokens) + len(first.prompt_tokens)
    assert two["cost_usd_total"] == pytest.approx(one["cost_usd"] + two["cost_usd"])
    text = (tmp_path / "state" / STATE_FILE).read_text()
    state = json.loads(text)
    assert state["tinker_path"].startswith("tinker://") and state["policy_version"] == 2
    assert server.api_key not in text and exported["adapter"].startswith("tinker://")
    # the run's key has no billing role on the test server: the report says so in one line, the export goes on
    assert exported["billing"].startswith("the service's billing was not read: ") and "\n" not in exported["billing"]
    assert float(exported["cost_estimate_usd"]) == pytest.approx(two["cost_usd_total"], abs=1e-4)


SAVER = textwrap.dedent("""
    import asyncio, json, sys, time
    from aitrainsai.trainers import AgentTurn, ScoredEpisode
    from aitrainsai_outer_tinker.trainer import TinkerConfig, TinkerTrainer

    options, state, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]

    async def main():
        trainer = TinkerTrainer(TinkerConfig(**options), state_dir=state + "-dir")
        await trainer.start()
        messages = [{"role": "user", "content": "Name a colour."}]
        turns = [await trainer.sample(messages, [], None) for _ in range(2)]
        groups = [[ScoredEpisode(id=f"e{i}", turns=[t], reward=float(i)) for i, t in enumerate(turns)]]
        await trainer.update(groups)
        await trainer.save_state(state)
        with open(out, "w") as handle:
            json.dump([t.model_dump(mode="json") for t in turns], handle)
        time.sleep(600)  # holding its session and clients until killed

    asyncio.run(main())
""")


def test_save_sigkill_resume_gives_the_same_next_step_as_an_uninterrupted_run(server, tmp_path):
    """A process samples, updates once, saves and is SIGKILLed while it holds the trainer. A new trainer loads the
    saved state; a control trainer replays the same first update uninterrupted; both take the same second update:
    the log-probs afterwards are identical (weights and Adam state both restored)."""
    settings = options(server, learning_rate=1e-3, seed=7, max_tokens=4)
    state, out = tmp_path / "state", tmp_path / "turns.json"
    saver = subprocess.Popen([sys.executable, "-c", SAVER, json.dumps(settings), str(state), str(out)],
                             env=dict(os.environ), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not out.is_file() and saver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.is_file(), f"the saving process ended ({saver.poll()}) or timed out before saving"
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait()
    turns = [AgentTurn.model_validate(t) for t in json.loads(out.read_text())]
    groups = [group(turns, [0.0, 1.0])]
    probe = turns[0].prompt_tokens + turns[0].completion_tokens

    async def scenario():
        resumed = await started(TinkerTrainer(TinkerConfig(**settings), state_dir=tmp_path / "resumed"))
        control = await started(TinkerTrainer(TinkerConfig(**settings), state_dir=tmp_path / "control"))
        try:
            await resumed.load_state(state)
            await control.update(groups)
            assert resumed.policy_version == control.policy_version == 1
            await resumed.update([group(turns, [1.0, 0.0])])
            await control.update([group(turns, [1.0, 0.0])])
            return await resumed.logprobs(probe), await control.logprobs(probe)
        finally:
            await resumed.close()
            await control.close()

    after_resumed, after_control = asyncio.run(scenario())
    assert after_resumed[1:] == pytest.approx(after_control[1:], abs=1e-5)
    sampled = after_resumed[-len(turns[0].logprobs):]
    assert sampled != pytest.approx(turns[0].logprobs, abs=1e-4), "two updates moved the policy"


@pytest.mark.slow  # trains SmolLM2-135M
def test_a_rewarded_behaviour_becomes_more_likely(smol_server, tmp_path):
    """A tiny synthetic task: reward 1 for a reply that does not start with the model's usual first token (its greedy
    one, about 0.3 likely here, so sampled groups have both kinds). That token's probability, measured by the sampler
    before and after a few updates on sampled groups, falls: the rewarded behaviour's rises."""
    messages = [{"role": "user", "content": "Name an animal."}]

    async def scenario():
        trainer = await started(make(smol_server, tmp_path, max_tokens=1, learning_rate=3e-3))
        try:
            greedy = await trainer.sample(messages, [], TASK, mode="eval")
            prompt = trainer._chat.prompt(messages, [])
            usual = trainer._chat.encode(greedy.message["content"])[0]
            before = (await trainer.logprobs(prompt + [usual]))[-1]
            updates = 0
            for _ in range(4):
                turns = [await trainer.sample(messages, [], TASK) for _ in range(6)]
                rewards = [0.0 if t.completion_tokens[0] == usual else 1.0 for t in turns]
                updates += (await trainer.update([group(turns, rewards)]))["datums"] > 0
            after = (await trainer.logprobs(prompt + [usual]))[-1]
            return math.exp(before), math.exp(after), updates
        finally:
            await trainer.close()

    before, after, updates = asyncio.run(scenario())
    print(f"P(rewarded) {1 - before:.3f} -> {1 - after:.3f} after {updates} updates")
    assert updates >= 1, "no sampled group had both rewarded and unrewarded replies"
    assert 1 - after > (1 - before) + 0.05, f"P(rewarded) {1 - before:.3f} -> {1 - after:.3f}"


@pytest.mark.slow
def test_base_url_local_starts_its_own_server_and_a_new_one_resumes_its_state(tmp_path, monkeypatch):
    """No account: the trainer starts the local server (its own random key, none in the environment), and stops it
    on close; a second trainer on the same run folder starts a new server that loads the saved state. Slow: two
    server starts load the model twice."""
    pytest.importorskip("aitrainsai_tinker_local_server")
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    config = TinkerConfig(base_url="local", max_tokens=2)
    policy = tmp_path / "run" / "policy"

    async def scenario():
        first = await started(TinkerTrainer(config, state_dir=policy))
        server = first._server
        try:
            turn = await first.sample(MESSAGES, [], TASK)
            await first.update([group([turn, turn.model_copy()], [1.0, 0.0])])
            await first.save_state(policy / "step-0001")
        finally:
            await first.close()
        second = await started(TinkerTrainer(config, state_dir=policy))
        try:
            await second.load_state(policy / "step-0001")
            return server, second.policy_version, await second.sample(MESSAGES, [], TASK)
        finally:
            await second.close()

    server, version, turn = asyncio.run(scenario())
    assert not server.alive() and version == 1 and turn.policy_version == 1
    assert sorted(p.name for p in policy.iterdir()) == ["step-0001"]  # the server's files live beside the policy
    assert (tmp_path / "run" / "policy-tinker-server" / "server.log").is_file()


# -- faults ---------------------------------------------------------------------------------------------------------
def test_429_and_500_are_recovered(server, tmp_path):
    async def scenario():
        trainer = await started(make(server, tmp_path, max_tokens=2))
        try:
            server.faults(op="asample", status=429, count=2)
            limited = await trainer.sample(MESSAGES, [], TASK)
            server.faults(op="asample", status=500, count=2)
            failed = await trainer.sample(MESSAGES, [], TASK)
            return limited, failed
        finally:
            server.clear_faults()
            await trainer.close()

    limited, failed = asyncio.run(scenario())
    assert limited.completion_tokens and failed.completion_tokens


@pytest.mark.parametrize("fault", [{"status": 500, "count": 1000}, {"hang": True}], ids=["500-forever", "hang"])
def test_a_service_that_keeps_failing_stops_the_run_after_bounded_retries(server, tmp_path, fault):
    async def scenario():
        trainer = await started(make(server, tmp_path))
        trainer.config = trainer.config.model_copy(update={"call_timeout_s": 3.0, "retries": 1, "backoff_s": 0.1})
        try:
            server.faults(op="asample", **fault)
            began = time.monotonic()
            with pytest.raises(StopRun) as stopped:
                await trainer.sample(MESSAGES, [], TASK)
            return stopped.value, time.monotonic() - began
        finally:
            server.clear_faults()
            await trainer.close()

    error, seconds = asyncio.run(scenario())
    assert "failed on sample after 2 attempts" in str(error) and "--resume" in str(error)
    assert seconds < 3.0 * 2 + 3, "two deadlines and a backoff, not the SDK's five minutes"
    assert server.api_key not in str(error)


def test_a_refused_key_and_no_key_are_one_clear_error_before_anything_starts(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-not-the-servers-key")
    trainer = make(server, tmp_path)
    with pytest.raises(StopRun, match=r"refused the key in \$TINKER_API_KEY") as refused:
        asyncio.run(trainer.start())
    assert "tml-not-the-servers-key" not in str(refused.value) and trainer._service is None
    monkeypatch.delenv("TINKER_API_KEY")
    with pytest.raises(StopRun, match=r"\$TINKER_API_KEY is not set"):
        asyncio.run(make(server, tmp_path).start())


def test_the_base_model_is_checked_against_the_service(server, tmp_path):
    trainer = make(server, tmp_path, base_model="Qwen/Qwen3-30B-A3B-Instruct-2507")
    with pytest.raises(StopRun, match=r"'Qwen/Qwen3-30B-A3B-Instruct-2507' was retired by Tinker on 2026-06-12; its "
                                      rf"replacement is 'Qwen/Qwen3.6-35B-A3B'; the service offers: .*{MODEL}"):
        asyncio.run(trainer.start())


def test_the_cost_cap_stops_sampling(server, tmp_path):
    async def scenario():
        trainer = await started(make(server, tmp_path, max_tokens=2, max_usd=0.001, prices=Prices(prefill=100.0)))
        try:
            await trainer.sample(MESSAGES, [], TASK)  # ~40 prompt tokens at $100 per million: over the cap
            with pytest.raises(StopRun, match="cost cap"):
                await trainer.sample(MESSAGES, [], TASK)
        finally:
            await trainer.close()

    asyncio.run(scenario())


# -- episodes -------------------------------------------------------------------------------------------------------
def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c-{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


class ScriptThenModel:
    """Scripted messages first, then up to ``model_turns`` turns of the trainer itself, then "done"."""

    def __init__(self, trainer: TinkerTrainer, script: list[dict], model_turns: int):
        self.trainer, self.script, self.model_turns = trainer, list(script), model_turns
        self.sampled: list[AgentTurn] = []

    async def sample(self, messages, tools, task, *, mode="train"):
        if self.script:
            return AgentTurn(message=self.script.pop(0))
        if len(self.sampled) < self.model_turns:
            self.sampled.append(await self.trainer.sample(messages, tools, task, mode=mode))
            return self.sampled[-1]
        return AgentTurn(message={"role": "assistant", "content": "done"})


ROOT = Path(__file__).resolve().parents[3]
if (ROOT / "tests" / "episode_helpers.py").is_file():
    sys.path.insert(0, str(ROOT / "tests"))
    from episode_helpers import make_episode  # a fixture: an episode with the given-numbers inner trainer
else:
    @pytest.fixture
    def make_episode():
        pytest.skip("episodes need the repository's tests/episode_helpers.py")


# -- training data matches what was sampled, in both chat formats; stable_reinforce; resume; the default base ------

TOOL = {"role": "tool", "tool_call_id": "call_0", "name": "list_files", "content": "trainer.toml\nrubric.py"}


async def _episode_and_other(trainer):
    """A two-turn episode (a reply, a tool result, a reply) and a one-turn episode, sampled with the tools."""
    first = await trainer.sample(MESSAGES, TOOLS, TASK)
    second = await trainer.sample(MESSAGES + [first.message, TOOL], TOOLS, TASK)
    return first, second, await trainer.sample(MESSAGES, TOOLS, TASK)


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
            first, second, other = await _episode_and_other(trainer)
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
        assert "<think>\n\n</think>\n\n" in text
        assert "<tool_response>\ntrainer.toml\nrubric.py\n</tool_response>" in text
        assert len(datums) == (1 if second.prompt_tokens[:len(joined)] == joined else 2)
    assert metrics["datums"] == float(len(sent)) == float(len(datums) + 1)
    # the service's log-probs of the trained tokens are the sampler's (same weights): the ratio is 1
    assert metrics["mean_ratio"] == pytest.approx(1.0, abs=0.02) and metrics["max_ratio"] < 1.1


def test_segments_tile_each_datum_and_name_the_sequences():
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


def counted_clients(monkeypatch) -> dict[str, int]:
    """Count the fresh training clients and the samplers every TinkerTrainer makes from now on."""
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
    return made


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
    made = counted_clients(monkeypatch)

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
    assert REFERENCE_MODEL == "Qwen/Qwen3.6-35B-A3B"


def test_episodes_side_by_side_share_one_training_client_and_one_sampler(server, tmp_path, monkeypatch):
    """The first turns of a group's episodes come together: one training client and one sampler are made for them
    (two warm-started runs' episodes once copied the same checkpoint into the same place at once, and one died)."""
    made = counted_clients(monkeypatch)

    async def side_by_side():
        trainer = await started(make(server, tmp_path, max_tokens=4))
        try:
            return await asyncio.gather(*(trainer.sample(MESSAGES, [], TASK) for _ in range(3)))
        finally:
            await trainer.close()

    turns = asyncio.run(side_by_side())
    assert len(turns) == 3 and all(t.completion_tokens for t in turns)
    assert made == {"fresh": 1, "samplers": 1}


def test_the_default_base_starts_and_a_retired_one_is_refused_naming_its_replacement(server, tmp_path, monkeypatch):
    """The session's server offers only SmolLM2 and Qwen3.6-35B-A3B (``--serve-as``), as today's service offers
    only current models: the default base starts there in Qwen3.5's format (Qwen3.5's tokenizer from tml-renderers,
    offline); the retired Qwen3-30B-A3B-Instruct-2507 is refused in one line that names its replacement."""
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
            await trainer.ready()
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
            first, second, other = await _episode_and_other(trainer)
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
