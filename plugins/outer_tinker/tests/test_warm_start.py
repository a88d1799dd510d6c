"""``aitrainsai sft``: the supervised datum (only the rendered reply carries weight, and it is exactly the reply the
format samples), a warm start on the session's local server that a run's trainer starts from, one clear line for a
run with nothing to learn from, damaged transcripts read bounded and skipped or cut with a named count, a killed warm
start that continues from its last saved step, and a failed request that ends in one line naming the command that
continues it."""

import asyncio
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aitrainsai import ChatMessage, EpisodeData, Ledger, PolicyExport
from aitrainsai_outer_tinker import rendering
from aitrainsai_outer_tinker.state import STATE_FILE, SftProgress, SftSettings, warm_start_summary
from aitrainsai_outer_tinker.trainer import TinkerConfig, TinkerTrainer, init_problems
from aitrainsai_outer_tinker.warm_start import Demonstration, WarmStart, examples

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 32 * (32_000 + 1024)  # bytes of recorded JSON per transcript: BYTES_PER_TOKEN x the default agent limit
TOOLS = [{"type": "function", "function": {
    "name": "edit_file", "description": "Replace text in a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                    "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {"name": "submit_job", "description": "Submit the job.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}}]


def call(call_id: str, name: str, **arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversation(rate: str) -> list[dict]:
    """A short accepted episode: the job edited and submitted in one turn, then a closing reply."""
    return [
        {"role": "system", "content": "You write training jobs."},
        {"role": "user", "content": "Teach arithmetic. Edit trainer.toml, then submit."},
        {"role": "assistant", "content": "Plan: a higher rate.",
         "tool_calls": [call("a", "edit_file", path="trainer.toml", old="learning_rate = 0.0001",
                             new=f"learning_rate = {rate}"), call("b", "submit_job")]},
        {"role": "tool", "tool_call_id": "a", "name": "edit_file", "content": "edited trainer.toml"},
        {"role": "tool", "tool_call_id": "b", "name": "submit_job", "content": "accepted"},
        {"role": "assistant", "content": "Submitted."},
    ]


def recorded_run(runs_dir: Path, episodes: list[tuple[str, str, float, list[dict]]], *,
                 held_out: tuple[str, ...] = ("triage",)):
    """A run in a real ledger with these (id, status, reward, messages) episodes, recorded as the episode records
    them (rows, transcript, the family's agent prompt)."""
    ledger = Ledger(runs_dir)
    run = ledger.create_run({"families": {"train": ["calc_chain"], "held_out": list(held_out)}}, [], name="demos")
    for episode_id, status, reward, messages in episodes:
        family = episode_id.split("-")[1]
        run.upsert_episode(episode_id, status=status, step=0, family=family, level=1, reward=reward)
        for message in messages:
            run.add_message(episode_id, message)
        run.record_agent_prompt(family, {"family": family, "messages": messages[:2], "tools": TOOLS})
    return run


def demo_runs(runs_dir: Path, count: int = 6):
    rates = ["0.001", "0.0003", "0.003", "0.002", "0.0005", "0.001"]
    rows = [(f"s0-calc_chain-g0-e{i}", "done", 0.6 + 0.01 * i, conversation(rates[i % len(rates)]))
            for i in range(count)]
    rows += [("s0-calc_chain-g1-e0", "invalid", 0.1, conversation("9")),  # refused: not a demonstration
             ("s0-triage-g0-e0", "done", 0.9, conversation("7")),  # a held-out family: never trained on
             ("eval1-calc_chain-e0", "done", 0.9, conversation("8"))]  # an evaluation episode: never trained on
    return recorded_run(runs_dir, rows)


def options(server, **changes) -> dict:
    values = {"base_url": server.base_url, "base_model": MODEL, "max_tokens": 64, "retries": 1, "backoff_s": 0.2,
              "call_timeout_s": 300.0, "prices": {"prefill": 0.12, "sampled": 0.30, "trained": 0.36}}
    return values | changes


@pytest.mark.parametrize("chat_format", ["hermes", "qwen3_5"])
def test_only_the_rendered_reply_carries_weight_and_it_parses_back_to_the_calls(chat_format):
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local model's tokenizer")
    chat = rendering.local_chat()
    renderer = (rendering.renderer("hermes", None, local=True) if chat_format == "hermes"
                else rendering.renderer("qwen3_5", chat.tokenizer))
    messages = conversation("0.001")
    demo = Demonstration(run="r", episode="s0-calc_chain-g0-e0", family="calc_chain", reward=1.0,
                         messages=messages, tools=TOOLS)
    items, long, unparsed, _ = examples([demo], renderer, 100_000)
    assert (long, unparsed) == (0, 0)
    assert [r.message for e in items for r in e.replies] == [2, 5]
    if renderer.continues:  # each prompt extends the sequence before it: one datum, one forward for the episode
        assert len(items) == 1 and items[0].id.endswith("/2")
    for item in items:
        weights = item.weights()
        assert len(weights) == len(item.tokens) - 1
        # target position j predicts tokens[j + 1]: weight 1 exactly where that token is a reply's
        assert [j + 1 for j, w in enumerate(weights) if w] == [
            k for r in item.replies for k in range(r.start, r.end)]
        assert item.reply_tokens == sum(weights)
        for turn in item.replies:
            index = turn.message
            # the context: exactly the agent's prompt at that turn
            assert item.tokens[:turn.start] == renderer.prompt(messages[:index], TOOLS)
            reply = item.tokens[turn.start:turn.end]
            assert reply[-1] == renderer.end_of_turn_id
            parsed = renderer.parse(reply)
            expected = ChatMessage.of(messages[index])
            assert parsed.error is None
            assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
                (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls or []]
            assert parsed.content.strip() == expected.content
            # the reply is what the format writes for the next prompt too: rendered history == prompt + reply
            later = renderer.prompt(messages[:index + 1], TOOLS)
            if renderer.continues:
                assert later[:turn.end] == item.tokens[:turn.end]


def test_a_parse_error_turn_and_a_turn_over_the_limit_are_left_out():
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local model's tokenizer")
    renderer = rendering.renderer("hermes", None, local=True)
    messages = conversation("0.001")
    broken = messages[:2] + [
        {"role": "assistant", "content": "<tool_call>{oops"},
        {"role": "user", "content": "error: your reply could not be parsed: not JSON"}] + messages[2:]
    demo = Demonstration(run="r", episode="e", family="calc_chain", reward=1.0, messages=broken, tools=TOOLS)
    items, long, unparsed, _ = examples([demo], renderer, 100_000)
    assert unparsed == 1 and [r.message for e in items for r in e.replies] == [4, 7]
    (first,) = [e for e in items if e.replies[0].message == 4]
    weights = first.weights()  # the unparsed turn is context of the turns after it, never a target
    assert not any(weights[:first.replies[0].start - 1])
    items, long, _, _ = examples([demo], renderer, first.replies[0].end)
    assert long == 1 and [r.message for e in items for r in e.replies] == [4]


def test_a_turn_whose_call_failed_is_context_and_its_fix_a_target():
    """A slip (a call answered "error: ...") is left out as a target: the datum learns the fix that follows it."""
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local model's tokenizer")
    renderer = rendering.renderer("hermes", None, local=True)
    messages = conversation("0.001")
    slipped = messages[:2] + [
        {"role": "assistant", "content": "", "tool_calls": [call("s", "edit_fle", path="trainer.toml")]},
        {"role": "tool", "tool_call_id": "s", "name": "edit_fle", "content": "error: unknown tool 'edit_fle'"},
    ] + messages[2:]
    demo = Demonstration(run="r", episode="e", family="calc_chain", reward=1.0, messages=slipped, tools=TOOLS)
    (item,), long, unparsed, failed = examples([demo], renderer, 100_000)
    assert (long, unparsed, failed) == (0, 0, 1) and [r.message for r in item.replies] == [4, 7]
    weights = item.weights()
    start, end = item.replies[0].start, item.replies[0].end  # weights are per target: tokens[1:]
    assert not any(weights[:start - 1]) and all(weights[start - 1:end - 1])
    slip_tokens = renderer.reply(slipped[2])
    assert item.tokens[len(renderer.prompt(slipped[:2], TOOLS)):][:len(slip_tokens)] == slip_tokens  # in context


@pytest.mark.slow  # trains SmolLM2 on the local server, then runs from its weights
def test_a_warm_start_trains_the_replies_and_a_run_starts_from_its_weights(server, tmp_path):
    """Two epochs on the session's server: the held-out loss is reported per epoch and falls, the saved state is
    what a new run's trainer (init_state) starts from, with its own version 0 and fresh Adam state."""
    run = demo_runs(tmp_path / "runs")
    out = tmp_path / "warm"
    lines: list[str] = []
    config = TinkerConfig(**options(server))
    settings = SftSettings(epochs=2, learning_rate=2e-3, batch_size=4, held_out=0.34, seed=1)
    progress = asyncio.run(WarmStart(config, out, settings, say=lines.append).run([run]))

    assert len(progress.epochs) == 2 and all(e.held_out_loss is not None for e in progress.epochs)
    # 2 of 6 episodes held out; an episode's 2 turns are one datum (SmolLM's format continues each prompt)
    assert len(progress.held_out) == 2 and len(progress.train) == 4
    assert not any("triage" in i or "eval" in i or "g1" in i for i in progress.train + progress.held_out)
    assert progress.epochs[-1].held_out_loss < progress.before_held_out_loss
    assert progress.epochs[-1].train_loss < progress.epochs[0].train_loss
    assert progress.tokens.trained > 0 and progress.usd > 0
    assert any(line.startswith("epoch 2/2: train loss") for line in lines)
    assert SftProgress.model_validate_json((out / "sft.json").read_text()) == progress
    saved = json.loads((out / STATE_FILE).read_text())
    assert saved["tinker_path"] == progress.epochs[-1].tinker_path and saved["base_model"] == MODEL
    line = warm_start_summary(out)  # what the run's export (and so its report) says of its warm start
    assert f"4 datums of {run.id}, 2 epochs at lr 0.002" in line
    assert f"{progress.before_held_out_loss:.3f} -> {progress.epochs[0].held_out_loss:.3f} -> " in line

    held = [e for e in _examples(run, config) if e.id in progress.held_out]

    async def reply_logprobs(trainer: TinkerTrainer) -> float:
        await trainer.start()
        try:
            await trainer.ready()
            values = await trainer.logprobs(held[0].tokens)
            return sum(v for r in held[0].replies for v in values[r.start:r.end])
        finally:
            await trainer.close()

    warm = TinkerTrainer(TinkerConfig(**options(server, init_state=out)), state_dir=tmp_path / "run" / "policy")
    cold = TinkerTrainer(TinkerConfig(**options(server)), state_dir=tmp_path / "cold" / "policy")
    warm_lp, cold_lp = asyncio.run(reply_logprobs(warm)), asyncio.run(reply_logprobs(cold))
    assert warm.policy_version == 0
    assert warm_lp > cold_lp + 1.0  # the held-out reply is likelier after the warm start
    assert -warm_lp / held[0].reply_tokens == pytest.approx(
        progress.epochs[-1].held_out_loss, abs=0.35)  # one reply vs the held-out mean: same weights, same scale


def _examples(run, config: TinkerConfig):
    from aitrainsai_outer_tinker.warm_start import demonstrations

    demos = demonstrations(run, SftSettings(), max_bytes=LIMIT).demonstrations
    return examples(demos, rendering.renderer("hermes", None, local=True), 100_000)[0]


def test_the_demonstrations_are_accepted_episodes_of_training_families(tmp_path):
    """Trained jobs and those of a validation-only run (loop.train_jobs = false) are demonstrations; a refused, a
    dead (unless asked), a held-out family's and an evaluation episode are not."""
    from aitrainsai_outer_tinker.warm_start import demonstrations

    run = recorded_run(tmp_path / "runs", [
        ("s0-calc_chain-g0-e0", "done", 0.6, conversation("1")),
        ("s0-calc_chain-g0-e1", "validated", 0.35, conversation("2")),
        ("s0-calc_chain-g0-e2", "dead", 0.3, conversation("3")),
        ("s0-calc_chain-g1-e0", "invalid", 0.1, conversation("4")),
        ("s0-triage-g0-e0", "validated", 0.35, conversation("5")),
        ("eval1-calc_chain-e0", "validated", 0.35, conversation("6"))])
    found = demonstrations(run, SftSettings(), max_bytes=LIMIT)
    assert [d.episode for d in found.demonstrations] == ["s0-calc_chain-g0-e0", "s0-calc_chain-g0-e1"]
    assert found.statuses == {"done": 1, "validated": 3, "dead": 1, "invalid": 1}
    assert found.skipped == found.cut == {} and found.damage() == []
    found = demonstrations(run, SftSettings(include_dead=True, min_reward=0.34), max_bytes=LIMIT)
    assert [d.episode for d in found.demonstrations] == ["s0-calc_chain-g0-e0", "s0-calc_chain-g0-e1"]
    found = demonstrations(run, SftSettings(include_dead=True), max_bytes=LIMIT)
    assert len(found.demonstrations) == 3


def test_the_held_out_split_keeps_each_family_and_rubric_in_proportion(tmp_path):
    """The stratum is the job's rubric as the trusted side recorded it; every stratum loses its share of episodes to
    the held-out side (the remainder to the largest fractions), whatever the ids hash to."""
    from aitrainsai_outer_tinker.warm_start import Example, demonstrations, split

    run = recorded_run(tmp_path / "runs", [("s0-calc_chain-g0-e0", "done", 0.6, conversation("1"))])
    run.upsert_episode("s0-calc_chain-g0-e0", status="done", data=EpisodeData(design={"rubric": "correct_answer"}))
    (demo,) = demonstrations(run, SftSettings(), max_bytes=LIMIT).demonstrations
    assert demo.rubric == "correct_answer"
    for seed in range(20):
        items = [Example(id=f"r{seed}/{family}-{rubric}-{i}/0", family=family, tokens=[1], replies=[],
                         rubric=rubric)
                 for family in ("calc_chain", "multi_hop") for rubric in ("exact", "shaped") for i in range(5)]
        train, held = split(items, 0.2, seed)
        assert len(held) == 4 and sorted(e.stratum for e in held) == sorted({e.stratum for e in items})
        train, held = split(items, 0.3, seed)  # 6 of 20: each stratum gives 1, two of them a second
        counts = sorted(sum(e.stratum == s for e in held) for s in {e.stratum for e in items})
        assert counts == [1, 1, 2, 2] and len(train) == 14
    assert split(items[:2], 0.2, 0)[1] and split(items[:2], 0.0, 0)[1] == []  # at least one, none when asked


def test_a_dry_run_prices_the_data_and_creates_nothing(tmp_path):
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local model's tokenizer")
    run = demo_runs(tmp_path / "runs")
    lines: list[str] = []
    config = TinkerConfig(base_url="local", prices={"prefill": 1.0, "sampled": 2.0, "trained": 3.0})
    progress = asyncio.run(WarmStart(config, tmp_path / "warm", SftSettings(epochs=2), say=lines.append).run(
        [run], dry_run=True))
    assert not (tmp_path / "warm").exists() and not progress.epochs
    items = {e.id: e for e in _examples(run, config)}
    trained = sum(len(items[i].tokens) - 1 for i in progress.train)
    forward = sum(len(items[i].tokens) - 1 for i in progress.held_out)
    assert lines[1] == (f"per epoch: {trained} trained and {forward} forward tokens; 2 epochs at {MODEL}'s prices: "
                        f"${2 * (3.0 * trained + 1.0 * forward) / 1e6:.4f}")


DEEP = "[" * 100_000 + "]" * 100_000  # what json.loads recurses into until a RecursionError


def forged_run(runs_dir: Path, records: dict[str, list[str | bytes]]):
    """A ledger whose transcripts are these records, as JSON text written straight into the messages table (as a
    damaged or foreign ledger may hold them: a dict the ledger's own writer could not even serialise)."""
    run = recorded_run(runs_dir, [(episode, "done", 0.6, []) for episode in records])
    for episode, rows in records.items():
        for seq, row in enumerate(rows):
            value = sqlite3.Binary(row) if isinstance(row, bytes) else row  # bytes: stored as TEXT, undecoded
            run.db.write("INSERT INTO messages VALUES (?, ?, ?, CAST(? AS TEXT), 0)", (run.id, episode, seq, value))
    return run


def rows(messages: list[dict]) -> list[str]:
    return [json.dumps(m) for m in messages]


def late_turns() -> list[dict]:
    """A conversation with a third turn: its first turn survives a cut at the third."""
    return conversation("0.002") + [{"role": "user", "content": "Anything else?"},
                                    {"role": "assistant", "content": "No."}]


def with_arguments(arguments: str) -> list[str]:
    messages = conversation("0.001")
    messages[2]["tool_calls"][0]["function"]["arguments"] = arguments
    return rows(messages)


def replaced(index: int, record: str | bytes, messages: list[dict] | None = None) -> list[str | bytes]:
    out: list[str | bytes] = rows(messages or conversation("0.001"))
    out[index] = record
    return out


HOSTILE = {  # episode transcript, and the reason each is skipped or cut with
    "deep-arguments": (with_arguments('{"path": ' + DEEP + "}"), "a tool call's arguments nested more than 32 deep"),
    "deep-message": (replaced(3, '{"role": "tool", "content": ' + DEEP + "}"), "nested more than 32 deep"),
    "huge-arguments": (with_arguments(json.dumps({"path": "x" * 2_000_000})),
                       f"over the agent's limit of {LIMIT} bytes as JSON"),
    "huge-result": (replaced(3, json.dumps({"role": "tool", "content": "y" * 2_000_000})),
                    f"over the agent's limit of {LIMIT} bytes as JSON"),
    "malformed": (replaced(2, '{"role": "assistant", "content": "Plan'), "not valid JSON"),
    "lone-surrogate": (replaced(2, '{"role": "assistant", "content": "Plan \\udc80"}'),
                       "text with a lone surrogate"),
    "not-utf8": (replaced(2, b'{"role": "assistant", "content": "Plan \xff\xfe"}'), "not UTF-8 text"),
    "not-a-message": (replaced(2, '[{"role": "assistant"}]'), "not a chat message"),
    "wrong-type": (replaced(2, '{"role": "assistant", "content": {"text": 1}}'), "not a chat message"),
    "deep-late": (replaced(7, '{"role": "assistant", "content": ' + DEEP + "}", late_turns()),
                  "nested more than 32 deep"),
}


@pytest.mark.parametrize("variant", sorted(HOSTILE))
def test_a_damaged_transcript_is_skipped_or_cut_with_a_named_count_and_the_rest_trains(tmp_path, variant):
    """The data of a warm start (a dry run: the same reading, rendering and split, no service) from a run with two
    good episodes and one whose recorded transcript is hostile: that one is left out, or cut before its damage where
    a turn comes before it, and counted by what is wrong; the good ones are the data."""
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local model's tokenizer")
    records, reason = HOSTILE[variant]
    good = rows(conversation("0.001")), rows(conversation("0.003"))
    run = forged_run(tmp_path / "runs", {"s0-calc_chain-g0-e0": good[0], "s0-calc_chain-g0-e1": records,
                                         "s0-calc_chain-g0-e2": good[1]})
    lines: list[str] = []
    config = TinkerConfig(base_url="local", prices={"prefill": 1.0, "sampled": 2.0, "trained": 3.0})
    progress = asyncio.run(WarmStart(config, tmp_path / "warm", SftSettings(held_out=0), say=lines.append).run(
        [run], dry_run=True))
    episodes = {i.rsplit("/", 1)[0].rsplit("/", 1)[1] for i in progress.train}
    if variant == "deep-late":  # the first turn of that episode is kept: its prompt and results come before
        assert episodes == {"s0-calc_chain-g0-e0", "s0-calc_chain-g0-e1", "s0-calc_chain-g0-e2"}
        assert lines[0] == (f"run {run.id}: 1 episode cut at the first damaged message (the turns before it kept): "
                            f"1 {reason}")
    else:
        assert episodes == {"s0-calc_chain-g0-e0", "s0-calc_chain-g0-e2"}
        assert lines[0] == (f"run {run.id}: 1 episode skipped (a damaged transcript, no turn before the damage): "
                            f"1 {reason}")


def test_the_damage_counts_name_each_reason(tmp_path):
    """Several damaged episodes in one run: one line per kind (skipped, cut), the reasons counted, most first."""
    from aitrainsai_outer_tinker.warm_start import demonstrations

    chosen = ["deep-arguments", "deep-message", "malformed", "malformed", "not-utf8", "deep-late"]
    records = {f"s0-calc_chain-g0-e{k}": HOSTILE[name][0] for k, name in enumerate(chosen)}
    records["s0-calc_chain-g1-e0"] = rows(conversation("0.001"))
    found = demonstrations(forged_run(tmp_path / "runs", records), SftSettings(), max_bytes=LIMIT)
    assert [d.episode for d in found.demonstrations] == ["s0-calc_chain-g0-e5", "s0-calc_chain-g1-e0"]
    assert [m["role"] for m in found.demonstrations[0].messages] == ["system", "user", "assistant", "tool", "tool"]
    assert found.damage() == [
        "5 episodes skipped (a damaged transcript, no turn before the damage): 2 not valid JSON, 1 a tool call's "
        "arguments nested more than 32 deep, 1 nested more than 32 deep, 1 not UTF-8 text",
        "1 episode cut at the first damaged message (the turns before it kept): 1 nested more than 32 deep"]


def test_a_damaged_agent_prompt_file_leaves_its_family_out_without_a_crash(tmp_path):
    """The family's recorded prompt (its tool schemas) nested past any limit, or not JSON: read bounded, it is left
    out (no tools: nothing to render the family's turns with), and the run's other family still gives its data."""
    from aitrainsai_outer_tinker.warm_start import demonstrations

    run = recorded_run(tmp_path / "runs", [("s0-calc_chain-g0-e0", "done", 0.6, conversation("0.001")),
                                           ("s0-multi_hop-g0-e0", "done", 0.6, conversation("0.002")),
                                           ("s0-dispatch-g0-e0", "done", 0.6, conversation("0.003"))])
    (run.dir / "agent_prompt" / "calc_chain.json").write_text('{"tools": ' + DEEP + "}")
    (run.dir / "agent_prompt" / "dispatch.json").write_text('{"tools": [')
    found = demonstrations(run, SftSettings(), max_bytes=LIMIT)
    assert [d.family for d in found.demonstrations] == ["multi_hop"]


def test_init_state_problems_are_one_line_each(tmp_path):
    missing = TinkerConfig(base_url="local", init_state=tmp_path / "nowhere")
    assert init_problems(missing)[0].startswith("init_state: no saved policy state at ")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / STATE_FILE).write_text(json.dumps({
        "tinker_path": "tinker://m/weights/x", "policy_version": 3, "base_model": "Qwen/Qwen3.6-35B-A3B",
        "costs": {}, "server_dir": None}))
    problems = init_problems(TinkerConfig(base_url="local", init_state=tmp_path / "s"))
    assert problems == [f"init_state: {tmp_path / 's'} was trained on 'Qwen/Qwen3.6-35B-A3B', not {MODEL!r}",
                        f"init_state: {tmp_path / 's'} was saved on the hosted service, and this run trains on "
                        "the local server"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / STATE_FILE).write_text("{not json")
    assert init_problems(TinkerConfig(init_state=tmp_path / "bad")) == [
        f"init_state: {tmp_path / 'bad' / STATE_FILE} is not a saved tinker policy state"]


def cli(runs_dir: Path, *args: str, server=None, env: dict | None = None, **kwargs) -> subprocess.Popen:
    environment = os.environ | {"AITRAINSAI_RUNS_DIR": str(runs_dir), "TINKER_TELEMETRY": "0"} | (env or {})
    base = ["-s", "outer_trainer.use=tinker", "-s", f"outer_trainer.tinker.base_model={MODEL}",
            "-s", "outer_trainer.tinker.max_tokens=64"]
    if server is not None:
        base += ["-s", f"outer_trainer.tinker.base_url={server.base_url}"]
        environment["TINKER_API_KEY"] = server.api_key
    return subprocess.Popen([sys.executable, "-m", "aitrainsai.cli", "sft", *base, *args], env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_run_with_no_accepted_episode_is_one_clear_line_and_creates_nothing(tmp_path):
    pytest.importorskip("aitrainsai_trainer_local", reason="a run config resolves with an inner trainer installed")
    runs = tmp_path / "runs"
    recorded_run(runs, [("s0-calc_chain-g0-e0", "invalid", 0.1, conversation("1")),
                        ("s0-calc_chain-g0-e1", "no_submission", -0.1, conversation("1")),
                        ("s0-triage-g0-e0", "done", 0.9, conversation("1"))])
    out = tmp_path / "warm"
    # a service address that is never called (the data is refused first) and a key of the right shape
    done = cli(runs, "--from", "demos", "--out", str(out), "-s", "outer_trainer.tinker.base_url=http://127.0.0.1:9",
               env={"TINKER_API_KEY": "tml-never-sent"})
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "has no accepted episode of a training family" in lines[0], stderr
    assert "1 invalid, 1 no_submission" in lines[0] and not out.exists()
    bad = cli(runs, "--from", "demos", "--out", str(out), "--held-out", "1.5")
    _, stderr = bad.communicate(timeout=120)
    assert bad.returncode == 2 and stderr.strip().count("\n") == 0 and "--held-out" in stderr, stderr


def test_a_dry_run_of_a_base_with_no_known_chat_format_is_one_clear_line(tmp_path):
    """A dry run skips the key and the service, not the check that the base's chat can be rendered: before, an unknown
    base was rendered as Qwen's Hermes format without a word."""
    pytest.importorskip("aitrainsai_trainer_local", reason="a run config resolves with an inner trainer installed")
    runs = tmp_path / "runs"
    recorded_run(runs, [("s0-calc_chain-g0-e0", "done", 0.9, conversation("1"))])
    out = tmp_path / "warm"
    done = cli(runs, "--from", "demos", "--out", str(out), "--dry-run",
               "-s", "outer_trainer.tinker.base_model=acme/x-1", "-s", "outer_trainer.tinker.tokenizer=tml-renderers")
    _, stderr = done.communicate(timeout=120)
    assert done.returncode == 2 and stderr.strip().count("\n") == 0, stderr
    assert "no chat format known for base model 'acme/x-1'" in stderr and not out.exists()


def _progress(out: Path) -> SftProgress | None:
    try:
        return SftProgress.model_validate_json((out / "sft.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return None


def _command(line: str) -> list[str]:
    """The command a stopped warm start names (``... continue it with: aitrainsai sft ...``), as argv here."""
    words = shlex.split(line.split("continue it with: ", 1)[1])
    assert words[:2] == ["aitrainsai", "sft"], line
    return words[2:]


@pytest.mark.slow  # trains on the local server in processes: killed, continued, and once uninterrupted
def test_a_warm_start_killed_mid_epoch_continues_from_its_last_saved_step_to_the_same_end(server, tmp_path):
    """SIGKILL inside a hung forward_backward after a saved step of epoch 1 (saved after every step), then the same
    command: it loads that state and trains the rest of the epoch in the same order, to the same number of steps as
    an uninterrupted run, with the same losses, and the service's Adam step count equal to the steps (none lost, none
    twice)."""
    runs = tmp_path / "runs"
    demo_runs(runs, count=4)  # 3 episodes to train on, 1 held out: 3 steps an epoch at --batch 1
    args = ("--from", "demos", "--epochs", "2", "--batch", "1", "--learning-rate", "1e-3", "--held-out", "0.25",
            "--save-every", "0")
    out = tmp_path / "warm"
    first = cli(runs, *args, "--out", str(out), server=server, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None:
        seen = _progress(out)
        if seen is not None and seen.partial is not None and seen.partial.steps >= 1:
            break
        time.sleep(0.05)
    server.faults(op="forward_backward", hang=True)  # the next step (or the epoch's held-out forward) hangs there
    time.sleep(1.0)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    server.clear_faults()
    saved = _progress(out)  # what the killed process left
    assert saved is not None and saved.partial is not None and not saved.epochs, first.communicate()
    assert saved.state is not None and saved.state.policy_version == saved.partial.steps
    at = saved.partial.steps
    assert at in (1, 2)  # mid-epoch: an epoch is 3 steps

    again = cli(runs, *args, "--out", str(out), server=server)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert f"continuing the warm start in {out} from step {at} of 6 (epoch 1, after its step {at})" in stdout
    done = SftProgress.model_validate_json((out / "sft.json").read_text())
    assert [(e.epoch, e.steps) for e in done.epochs] == [(1, 3), (2, 3)] and done.partial is None
    assert done.state is not None and done.state.policy_version == 6
    assert done.epochs[-1].optimizer_steps == 6  # the service stepped Adam once per step, across the kill
    assert json.loads((out / STATE_FILE).read_text())["tinker_path"] == done.epochs[-1].tinker_path

    whole = cli(runs, *args, "--out", str(tmp_path / "whole"), server=server)
    _, stderr = whole.communicate(timeout=300)
    assert whole.returncode == 0, stderr
    uninterrupted = SftProgress.model_validate_json((tmp_path / "whole" / "sft.json").read_text())
    assert uninterrupted.train == done.train and uninterrupted.held_out == done.held_out
    for resumed, straight in zip(done.epochs, uninterrupted.epochs, strict=True):
        assert (resumed.steps, resumed.train_tokens, resumed.optimizer_steps) == (
            straight.steps, straight.train_tokens, straight.optimizer_steps)
        # the same batches in the same order from the same weights and Adam state: the same losses
        assert resumed.train_loss == pytest.approx(straight.train_loss, rel=1e-4)
        assert resumed.held_out_loss == pytest.approx(straight.held_out_loss, rel=1e-4)

    other = cli(runs, "--from", "demos", "--out", str(out), "--epochs", "2", "--batch", "3", server=server)
    _, stderr = other.communicate(timeout=120)
    assert other.returncode == 1 and "holds another warm start" in stderr


@pytest.mark.slow  # the local server in processes
def test_a_request_that_times_out_ends_with_one_line_naming_the_command_that_continues(server, tmp_path):
    """forward_backward hangs on the server past the given deadline: one line, no traceback, naming not a run's
    resume but this warm start's own command (--from pinned to the run's id), which then trains it to the end."""
    runs = tmp_path / "runs"
    run = demo_runs(runs, count=3)
    out = tmp_path / "warm"
    args = ("--from", "latest", "--out", str(out), "--epochs", "1", "--batch", "2", "--held-out", "0",
            "--save-every", "0", "-s", "outer_trainer.tinker.call_timeout_s=10")
    server.faults(op="forward_backward", hang=True)  # a forward is one too: none here (nothing held out)
    stopped = cli(runs, *args, server=server)
    _, stderr = stopped.communicate(timeout=300)
    server.clear_faults()
    assert stopped.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert ("forward_backward and optim_step (not retried: a training step may have landed): no answer within 10 s; "
            f"the warm start in {out} stopped after 0 of 2 steps, none of them saved; continue it with: "
            f"aitrainsai sft --from {run.id} --out ") in lines[0], lines[0]
    assert "run --resume" not in lines[0]
    words = _command(lines[0])
    assert words[words.index("--from") + 1] == run.id and "--save-every" in words
    again = cli(runs, *words, server=server)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert [e.steps for e in SftProgress.model_validate_json((out / "sft.json").read_text()).epochs] == [2]


@pytest.mark.parametrize("where", ["sft", "run"])
def test_a_server_on_this_machine_gets_no_600_s_deadline_and_a_hosted_one_keeps_it(tmp_path, monkeypatch, where):
    """The deadline of one request, in a warm start and in a run: a week on the local server (started here, or at
    a loopback address), whose requests are as slow as the machine; ``call_timeout_s`` on the hosted service, or
    where set."""
    from aitrainsai_outer_tinker.trainer import LOCAL_CALL_TIMEOUT_S, TinkerTrainer

    monkeypatch.delenv("TINKER_BASE_URL", raising=False)

    def deadline(**options) -> float:
        if where == "sft":
            return WarmStart(TinkerConfig(**options), tmp_path / "w", SftSettings()).trainer.config.call_timeout_s
        return TinkerTrainer(TinkerConfig(**options), state_dir=tmp_path / "s").config.call_timeout_s

    assert LOCAL_CALL_TIMEOUT_S >= 7 * 24 * 3600
    for local in ("local", "http://127.0.0.1:8123", "http://localhost:9", "http://[::1]:8000"):
        assert deadline(base_url=local) == LOCAL_CALL_TIMEOUT_S, local
    assert deadline() == 600.0  # the hosted service (the SDK's default address)
    assert deadline(base_url="https://tinker.example.com") == 600.0
    assert deadline(base_url="local", call_timeout_s=30) == 30.0  # asked for: kept
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:7000")
    assert deadline() == LOCAL_CALL_TIMEOUT_S


def test_the_before_and_after_check_is_tabled_in_the_summary_and_the_report(tmp_path):
    """sft.json's checks (cold and warm on fresh draws) become a table under the warm start's line in the report."""
    from aitrainsai import AgentOutcome, write_report
    from aitrainsai_outer_tinker.agent_check import AgentCheck
    from aitrainsai_outer_tinker.state import EpochRecord

    def outcome(i: int, calls: int, ok: bool, **counted) -> AgentOutcome:
        return AgentOutcome(family="multi_hop", episode=f"check-multi_hop-{i}", turns=2, parsed_turns=2,
                            call_turns=calls, submitted=ok, first_accepted=ok, accepted=ok,
                            reward=0.35 if ok else -0.1, seconds=10.0, **counted)

    checks = [AgentCheck(agent="cold", temperature=0.0, outcomes=[outcome(0, 0, False), outcome(1, 0, False)]),
              AgentCheck(agent="warm", temperature=0.0, outcomes=[outcome(0, 2, True, failed_turns=1, recovered=1),
                                                                  outcome(1, 1, False, failed_turns=1, recovered=0)])]
    epoch = EpochRecord(epoch=1, steps=2, train_loss=0.5, held_out_loss=0.6, train_tokens=10, seconds=1.0,
                        tinker_path="tinker://r/weights/e1")
    progress = SftProgress(sources=["r"], base_model=MODEL, chat_format="hermes", settings=SftSettings(),
                           train=["a"], held_out=["b"], before_held_out_loss=1.0, epochs=[epoch], checks=checks)
    (tmp_path / "sft.json").write_text(progress.model_dump_json())
    text = warm_start_summary(tmp_path)
    first, _, rest = text.partition("\n")
    assert "held-out loss 1.000 -> 0.600" in first
    rows = [line for line in rest.splitlines() if line.startswith("| cold") or line.startswith("| warm")]
    assert rows == ["| cold | 2 | 1.00 (1.00 .. 1.00) | 0.00 (0.00 .. 0.00) | - | 0.00 (0.00 .. 0.00) | "
                    "0.00 (0.00 .. 0.00) | -0.10 (-0.10 .. -0.10) | 10 |",
                    "| warm | 2 | 1.00 (1.00 .. 1.00) | 0.75 (0.26 .. 1.24) | 2, 1 | 0.50 (-0.48 .. 1.48) | "
                    "0.50 (-0.48 .. 1.48) | 0.12 (-0.32 .. 0.57) | 10 |"]
    pytest.importorskip("matplotlib")
    run = Ledger(tmp_path / "runs").create_run({}, [], name="warm")
    run.record(PolicyExport(step=2, refs={"adapter": "tinker://x", "warm_start": text}))
    report = write_report(run).read_text()
    assert f"- warm_start: `{first}`" in report and "- adapter: `tinker://x`" in report
    assert any(line.startswith("| agent |") for line in report.splitlines())
