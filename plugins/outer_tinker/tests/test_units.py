"""The tinker trainer's parts that need no server: rendering against known tokens, the preflight, advantages and
their normalisation, the cost account, and the deadline and retries around SDK calls."""

import asyncio
import importlib.util
import time

import pytest
from aitrainsai import AgentTurn, ScoredEpisode, StopRun, episode_datums
from aitrainsai_outer_tinker import rendering
from aitrainsai_outer_tinker.costs import CostMeter, Prices, Tokens
from aitrainsai_outer_tinker.trainer import REFERENCE_MODEL, TinkerConfig, TinkerTrainer, transient

LOCAL_INSTALLED = importlib.util.find_spec("aitrainsai_tinker_local_server") is not None
LOCAL_MISSING = ("base_url = 'local' needs the local Tinker server: pip install aitrainsai-tinker-local-server "
                 "(or 'aitrainsai-outer-tinker[local]')")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You write jobs."},
    {"role": "user", "content": "Read a.py."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": "x = 1"}]

# Qwen3 instruct's chat template (Qwen/Qwen3-30B-A3B-Instruct-2507, tokenizer_config.json) renders CONVERSATION so:
# the system message, then the tools as one JSON line each, the call as Hermes JSON, the result in a user turn.
QWEN3_TEXT = (
    "<|im_start|>system\nYou write jobs.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": '
    '{"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nRead a.py.<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\n<tool_response>\nx = 1\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

# The same conversation as SmolLM2-135M-Instruct's tokenizer encodes it (the local server's model).
SMOLLM2_IDS = [
    1, 9690, 198, 2683, 2965, 5152, 30, 198, 198, 19, 15204, 198, 198, 2683, 654, 946, 582, 355, 540, 3691, 288,
    4237, 351, 260, 2914, 8520, 30, 198, 198, 2683, 359, 2711, 351, 1517, 21509, 1127, 2067, 19746, 29299, 19746, 46,
    18391, 12082, 42, 198, 44, 19746, 46, 198, 39428, 2058, 1799, 476, 6607, 1002, 476, 6607, 1799, 9583, 1245, 1799,
    476, 1040, 79, 2153, 1002, 476, 10079, 1799, 476, 6340, 253, 2301, 14069, 476, 11582, 1799, 9583, 2058, 1799, 476,
    4743, 1002, 476, 17024, 1799, 9583, 1537, 1799, 9583, 2058, 1799, 476, 5931, 23597, 6663, 476, 15103, 1799, 9523,
    1537, 3222, 17859, 109, 198, 9617, 19746, 46, 198, 198, 2193, 971, 1517, 946, 28, 1003, 253, 7221, 1569, 351,
    1517, 1462, 284, 6604, 1127, 2067, 19324, 79, 4350, 29299, 19324, 79, 4350, 46, 18391, 12082, 42, 198, 44, 19324,
    79, 4350, 46, 198, 39428, 1245, 1799, 2067, 6607, 29, 1245, 18128, 476, 24370, 1799, 2067, 2661, 29, 5518, 29,
    4743, 46, 109, 198, 9617, 19324, 79, 4350, 46, 2, 198, 1, 4093, 198, 6340, 253, 30, 1306, 30, 2, 198, 1, 520,
    9531, 198, 44, 19324, 79, 4350, 46, 198, 39428, 1245, 1799, 476, 1040, 79, 2153, 1002, 476, 24370, 1799, 9583,
    1537, 1799, 476, 81, 30, 1306, 18, 17859, 198, 9617, 19324, 79, 4350, 46, 2, 198, 1, 4093, 198, 44, 19324, 79,
    7639, 46, 198, 104, 446, 216, 33, 198, 9617, 19324, 79, 7639, 46, 2, 198, 1, 520, 9531, 198]


def test_qwen3_instruct_renders_as_its_own_template():
    assert rendering.chat_format("Qwen/Qwen3-30B-A3B-Instruct-2507") == "hermes"
    assert rendering.QWEN3_INSTRUCT.render(CONVERSATION, TOOLS, add_generation_prompt=True) == QWEN3_TEXT


def test_only_known_chat_formats_are_accepted():
    assert rendering.chat_format("Qwen/Qwen3-235B-A22B-Instruct-2507") == "hermes"
    assert rendering.chat_format(REFERENCE_MODEL) == "qwen3_5"
    for other in ("Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-8B-Instruct"):
        assert rendering.chat_format(other) is None, other
    problems = TinkerTrainer.preflight(TinkerConfig(base_model="meta-llama/Llama-3.1-8B-Instruct", base_url="local",
                                                    prices=Prices()))
    assert "no chat format" in problems[0]
    assert problems[1:] == ([] if LOCAL_INSTALLED else [LOCAL_MISSING])


def test_the_local_model_renders_to_known_tokens():
    pytest.importorskip("aitrainsai_tinker_local_server")
    chat = rendering.local_chat()
    assert chat.prompt_ids(CONVERSATION, TOOLS) == SMOLLM2_IDS
    assert chat.tokenizer.decode(SMOLLM2_IDS) == QWEN3_TEXT  # SmolLM2 adds its default system only when none
    assert rendering.stop_tokens(chat) == [2] and chat.end_of_turn_id == 2


# -- preflight: the key is checked before anything starts, and never shown ----------------------------------------
def test_preflight_names_a_missing_or_malformed_key_and_never_shows_it(monkeypatch):
    config = TinkerConfig(api_key_env="AITRAINSAI_TEST_TINKER_KEY")
    monkeypatch.delenv("AITRAINSAI_TEST_TINKER_KEY", raising=False)
    (missing,) = TinkerTrainer.preflight(config)
    assert "$AITRAINSAI_TEST_TINKER_KEY is not set" in missing and "\n" not in missing
    monkeypatch.setenv("AITRAINSAI_TEST_TINKER_KEY", "sk-secret-value-123")
    (malformed,) = TinkerTrainer.preflight(config)
    assert "does not hold a Tinker API key" in malformed and "secret-value" not in malformed
    for good in ("tml-abc", "eyJhbGciOi"):
        monkeypatch.setenv("AITRAINSAI_TEST_TINKER_KEY", good)
        assert TinkerTrainer.preflight(config) == []
    monkeypatch.delenv("AITRAINSAI_TEST_TINKER_KEY")
    local = config.model_copy(update={"base_url": "local"})  # its own server, own key: no key needed
    assert TinkerTrainer.preflight(local) == ([] if LOCAL_INSTALLED else [LOCAL_MISSING])


def test_start_refuses_a_bad_key_in_one_line_before_contacting_anything(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_API_KEY", "not-a-key")
    trainer = TinkerTrainer(TinkerConfig(base_url="http://127.0.0.1:9"), state_dir=tmp_path)
    with pytest.raises(StopRun, match=r"does not hold a Tinker API key") as caught:
        asyncio.run(trainer.start())
    assert "not-a-key" not in str(caught.value) and trainer._service is None


def test_defaults_follow_the_reference_system_and_the_base_url():
    config = TinkerConfig()
    assert (config.model, config.lora_rank, config.learning_rate) == (REFERENCE_MODEL, 8, 4e-5)
    assert TinkerConfig(base_url="local").model == rendering.LOCAL_BASE_MODEL
    assert "api_key" not in TinkerConfig.model_fields  # the key comes from the environment only


# -- advantages ---------------------------------------------------------------------------------------------------
def turn(prompt, completion):
    return AgentTurn(message={"role": "assistant", "content": ""}, prompt_tokens=prompt, completion_tokens=completion,
                     logprobs=[-1.0] * len(completion))


def test_advantages_are_group_centred_and_folded_into_a_per_token_mean(tmp_path):
    """Rewards 1, 0, 0, 0: advantages 0.75 and -0.25 (no std division); with "tokens" every advantage is divided by
    the batch's sampled tokens, so the summed loss is a mean; a group with equal rewards sends nothing."""
    episodes = [ScoredEpisode(id=f"e{i}", turns=[turn([1, 2, 3], [4 + i, 5])], reward=r)
                for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    flat = [ScoredEpisode(id=f"f{i}", turns=[turn([1, 2], [7])], reward=0.5) for i in range(2)]
    plain = TinkerTrainer(TinkerConfig(advantage_normalisation="none"), state_dir=tmp_path)
    datums = plain.datums([episodes, flat])
    assert len(datums) == 4
    assert [max(d.advantages, key=abs) for d in datums] == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert datums[0] == episode_datums(episodes[0].turns, 0.75)[0]
    mean = TinkerTrainer(TinkerConfig(), state_dir=tmp_path).datums([episodes, flat])
    acted = 8  # 4 episodes x 2 sampled tokens
    for raw, scaled in zip(datums, mean):
        assert scaled.advantages == pytest.approx([a / acted for a in raw.advantages])
        assert scaled.model_input == raw.model_input and scaled.logprobs == raw.logprobs


def test_an_update_without_signal_trains_nothing_and_closes_the_step(tmp_path):
    trainer = TinkerTrainer(TinkerConfig(), state_dir=tmp_path)
    trainer.costs.add(Tokens(prefill=1_000_000, sampled=0), trainer.prices)
    flat = [[ScoredEpisode(id="a", turns=[turn([1], [2])], reward=1.0),
             ScoredEpisode(id="b", turns=[turn([1], [3])], reward=1.0)]]
    metrics = asyncio.run(trainer.update(flat))
    assert metrics["datums"] == 0.0 and trainer.policy_version == 0
    rate = trainer.prices.prefill  # the rate table's, for the default base
    assert rate > 0 and metrics["cost_usd"] == pytest.approx(rate) and metrics["tokens_prefill"] == 1_000_000
    assert asyncio.run(trainer.update([]))["cost_usd"] == 0.0 and trainer.costs.usd_total == pytest.approx(rate)


# -- cost -----------------------------------------------------------------------------------------------------------
def test_the_cost_account_prices_each_kind_and_reports_exact_keys():
    prices = Prices(prefill=1.0, sampled=2.0, trained=4.0)
    meter = CostMeter()
    meter.add(Tokens(prefill=500_000, sampled=250_000), prices)
    meter.add(Tokens(trained=1_000_000), prices)
    step = meter.close_step()
    assert step == {"cost_usd": 5.0, "cost_usd_total": 5.0, "tokens_prefill": 500_000.0, "tokens_prefill_cached": 0.0,
                    "tokens_sampled": 250_000.0, "tokens_trained": 1_000_000.0}
    meter.add(Tokens(sampled=500_000), prices)
    assert meter.close_step()["cost_usd"] == 1.0 and meter.usd_total == 6.0
    assert CostMeter.model_validate_json(meter.model_dump_json()) == meter


def test_max_usd_stops_an_update_before_it_spends(tmp_path):
    trainer = TinkerTrainer(TinkerConfig(max_usd=0.5, prices=Prices(trained=1e6)), state_dir=tmp_path)
    episodes = [[ScoredEpisode(id="a", turns=[turn([1], [2])], reward=1.0),
                 ScoredEpisode(id="b", turns=[turn([1], [3])], reward=0.0)]]
    with pytest.raises(StopRun, match=r"cost cap.*max_usd"):
        asyncio.run(trainer.update(episodes))
    assert trainer.costs.usd_total == 0.0 and trainer.policy_version == 0


# -- faults: deadline, bounded retries, then StopRun -------------------------------------------------------------
def test_transient_failures_are_told_apart():
    assert transient(TimeoutError()) and transient(ConnectionError())
    assert transient(ValueError("Error retrieving result: boom with status 500 for request 3"))
    assert transient(RuntimeError("Sampling is paused: concurrent LoRA rate limit hit"))
    assert not transient(ValueError("Error retrieving result: bad datum (status 400)"))
    assert not transient(KeyError("x"))


def fast_trainer(tmp_path, **options):
    return TinkerTrainer(TinkerConfig(retries=2, backoff_s=0.01, call_timeout_s=0.5, **options), state_dir=tmp_path)


def test_a_transient_failure_is_retried_then_succeeds(tmp_path):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ValueError("Error retrieving result: busy with status 429")
        return "ok"

    assert asyncio.run(fast_trainer(tmp_path)._call("sample", flaky)) == "ok" and len(calls) == 3


def test_retries_are_bounded_then_the_run_stops(tmp_path):
    calls = []

    def down():
        calls.append(1)
        raise ConnectionError("connection refused")

    with pytest.raises(StopRun, match=r"failed on sample after 3 attempts.*--resume"):
        asyncio.run(fast_trainer(tmp_path)._call("sample", down))
    assert len(calls) == 3


def test_a_call_that_never_answers_stops_within_the_deadline(tmp_path):
    def hang():
        time.sleep(60)  # a daemon thread: it never holds the process

    started = time.monotonic()
    with pytest.raises(StopRun, match=r"no answer within 0.5 s"):
        asyncio.run(fast_trainer(tmp_path)._call("optim_step", hang, retry=False))
    assert time.monotonic() - started < 2


def test_a_permanent_error_is_not_retried(tmp_path):
    calls = []

    def bad():
        calls.append(1)
        raise ValueError("Error retrieving result: bad datum (status 400)")

    with pytest.raises(ValueError, match="bad datum"):
        asyncio.run(fast_trainer(tmp_path)._call("forward_backward", bad))
    assert len(calls) == 1


def test_the_plugin_imports_neither_the_local_trainer_nor_the_local_server():
    """The local server (and the local trainer under it) is another distribution, imported by name in ``local.py``
    only when a config asks for it."""
    import ast
    from pathlib import Path

    import aitrainsai_outer_tinker

    package = Path(aitrainsai_outer_tinker.__file__).parent
    sources = sorted(package.rglob("*.py"))
    assert {"trainer.py", "rendering.py", "local.py"} <= {s.name for s in sources}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("aitrainsai_trainer_local", "aitrainsai_tinker_local_server")), \
                    (source.name, name)


def test_without_the_local_server_a_local_run_is_one_line_naming_it(monkeypatch, tmp_path):
    import sys

    from aitrainsai_outer_tinker import local

    monkeypatch.setitem(sys.modules, local.PACKAGE, None)  # as if not installed: its import fails, find_spec is None
    assert TinkerTrainer.preflight(TinkerConfig(base_url="local")) == [LOCAL_MISSING]
    with pytest.raises(StopRun, match="needs the local Tinker server: pip install aitrainsai-tinker-local-server"):
        asyncio.run(TinkerTrainer(TinkerConfig(base_url="local"), state_dir=tmp_path / "policy").start())
    with pytest.raises(local.LocalServerMissing) as missing:
        rendering.local_chat()
    assert str(missing.value) == ("the local Tinker server is not installed: pip install "
                                  "aitrainsai-tinker-local-server (or 'aitrainsai-outer-tinker[local]')")


def test_max_usd_is_the_option_a_resume_may_raise():
    from aitrainsai import ConfigError, Plugins, resume_overrides

    plugins = Plugins.load()
    record = {"outer_trainer": {"use": "tinker", "tinker": {"max_usd": 1.0}}}
    raised = resume_overrides(record, ["outer_trainer.tinker.max_usd=5.0"], plugins)
    assert raised["outer_trainer"]["tinker"]["max_usd"] == 5.0 and record["outer_trainer"]["tinker"]["max_usd"] == 1.0
    with pytest.raises(ConfigError, match="what may: outer_trainer.tinker.max_usd"):
        resume_overrides(record, ["outer_trainer.tinker.learning_rate=1.0"], plugins)
