"""``aitrainsai sft``: the supervised datum (only the rendered reply carries weight, and it is exactly the reply the
format samples), a warm start on the session's local server that a run's trainer starts from, one clear line for a
run with nothing to learn from, and a killed warm start that continues from its last epoch."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aitrainsai import ChatMessage, Ledger, PolicyExport
from aitrainsai_outer_tinker import rendering
from aitrainsai_outer_tinker.trainer import STATE_FILE, TinkerConfig, TinkerTrainer, init_problems
from aitrainsai_outer_tinker.warm_start import (
    Demonstration,
    SftProgress,
    SftSettings,
    WarmStart,
    examples,
    summary,
)

MODEL = "SmolLM2-135M-Instruct"
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
    broken = messages[:2] + [{"role": "assistant", "content": "<tool_call>{oops"},
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
    line = summary(out)  # what the run's export (and so its report) says of its warm start
    assert f"4 datums of {run.id}, 2 epochs at lr 0.002" in line
    assert f"{progress.before_held_out_loss:.3f} -> {progress.epochs[0].held_out_loss:.3f} -> " in line

    held = [e for e in _examples(run, config) if e.id in progress.held_out]

    async def reply_logprobs(trainer: TinkerTrainer) -> float:
        await trainer.start()
        try:
            await trainer._ready()
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

    demos, _ = demonstrations(run, SftSettings())
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
    found, statuses = demonstrations(run, SftSettings())
    assert [d.episode for d in found] == ["s0-calc_chain-g0-e0", "s0-calc_chain-g0-e1"]
    assert statuses == {"done": 1, "validated": 3, "dead": 1, "invalid": 1}
    found, _ = demonstrations(run, SftSettings(include_dead=True, min_reward=0.34))
    assert [d.episode for d in found] == ["s0-calc_chain-g0-e0", "s0-calc_chain-g0-e1"]
    found, _ = demonstrations(run, SftSettings(include_dead=True))
    assert len(found) == 3


def test_the_held_out_split_keeps_each_family_and_rubric_in_proportion(tmp_path):
    """The stratum is the job's rubric as the trusted side recorded it; every stratum loses its share of episodes to
    the held-out side (the remainder to the largest fractions), whatever the ids hash to."""
    from aitrainsai_outer_tinker.warm_start import Example, demonstrations, split

    run = recorded_run(tmp_path / "runs", [("s0-calc_chain-g0-e0", "done", 0.6, conversation("1"))])
    run.upsert_episode("s0-calc_chain-g0-e0", status="done", data={"design": {"rubric": "correct_answer"}})
    (demo,), _ = demonstrations(run, SftSettings())
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
    return subprocess.Popen([sys.executable, "-m", "aitrainsai.cli", "sft", *args, *base], env=environment,
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


@pytest.mark.slow  # trains SmolLM2 on the local server, killed and continued
def test_a_killed_warm_start_continues_from_its_last_epoch(server, tmp_path):
    runs = tmp_path / "runs"
    demo_runs(runs, count=3)
    out = tmp_path / "warm"
    args = ("--from", "demos", "--out", str(out), "--epochs", "2", "--batch", "4", "--learning-rate", "1e-3")
    first = cli(runs, *args, server=server, start_new_session=True)
    deadline = time.monotonic() + 240
    progress = None
    while time.monotonic() < deadline and first.poll() is None:
        if (out / "sft.json").exists():
            progress = SftProgress.model_validate_json((out / "sft.json").read_text())
            if progress.epochs:
                break
        time.sleep(0.2)
    assert progress is not None and len(progress.epochs) == 1, first.communicate()
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    again = cli(runs, *args, server=server)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "continuing the warm start" in stdout and "after epoch 1" in stdout
    done = SftProgress.model_validate_json((out / "sft.json").read_text())
    assert [e.epoch for e in done.epochs] == [1, 2]
    assert done.epochs[0] == progress.epochs[0]  # what the killed one finished is kept as it was
    other = cli(runs, "--from", "demos", "--out", str(out), "--epochs", "2", "--batch", "3", server=server)
    _, stderr = other.communicate(timeout=120)
    assert other.returncode == 1 and "holds another warm start" in stderr


def test_the_before_and_after_check_is_tabled_in_the_summary_and_the_report(tmp_path):
    """sft.json's checks (cold and warm on fresh draws) become a table under the warm start's line in the report."""
    from aitrainsai import AgentOutcome, write_report
    from aitrainsai_outer_tinker.agent_check import AgentCheck
    from aitrainsai_outer_tinker.warm_start import EpochRecord

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
    text = summary(tmp_path)
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
