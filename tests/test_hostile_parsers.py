"""Hostile input to trusted parsers: what models, agents and workers send is read in linear time, on input capped
before it is read, off the event loop where it can be slow, and refused with one typed error (never a
``RecursionError``, a crash on a name, or an allocation sized by a file)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aitrainsai.backends import JobResult
from aitrainsai.families import extract_answer
from aitrainsai.parsing import UntrustedInputError, load_json
from aitrainsai.tools import call_tool
from aitrainsai.jobs.workspace import Workspace

pytestmark = pytest.mark.hostile

DEEP = ["[" * 100_000 + "]" * 100_000, '{"a":' * 70_000 + "1" + "}" * 70_000,  # 400 KB, 420 KB
        "[" * 200_000, '{"path": ' + "[" * 5_000 + "]" * 5_000 + "}"]  # never closed; deep inside a valid key


def completes(code: str, timeout_s: float = 20.0) -> str:
    """Run ``code`` in a fresh interpreter; it must finish within ``timeout_s`` (the old quadratic parsers took
    minutes on these inputs; the linear ones take milliseconds). Returns its stdout."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still parsing after {timeout_s:g} s: the parser is not linear in its input")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# -- 1. answers are read in linear time ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, fallback", [
    ('"<answer>" * 131_072', "last_line"),  # 1 MB of tags never closed
    ('"<answer>x" * 116_508', "last_number"),
    ('"<ANSWER>\\n" * 116_508 + "</answer"', "last_line"),
    ('"<answer>" * 131_072 + "</answer>"', "last_line"),  # closed once, at the very end
    ('"answer: " * 131_072', "last_number"),  # one 1 MB "answer:" line
    ('"answer: 1\\n" * 104_858', "last_number"),  # 1 MB of "answer:" lines
    ('"1" * 1_048_576', "last_number"),  # 1 MB of digits
    ('"1," * 524_288 + "x"', "last_number"),
])
def test_a_megabyte_of_hostile_reply_is_read_in_linear_time(text, fallback):
    completes(f"from aitrainsai.families import extract_answer\nextract_answer({text}, {fallback!r})")


def test_the_orchestrator_scores_huge_transcripts_in_linear_time(tmp_path):
    """prime-rl's eval_result scores every transcript a worker sends with the family's scorer."""
    pytest.importorskip("aitrainsai_trainer_prime_rl")
    code = f"""
import json
from pathlib import Path
from aitrainsai.backends import JobResult
from aitrainsai.plugins import Plugins
from aitrainsai_trainer_prime_rl.config import PrimeRlTrainerConfig
from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer

family = Plugins.load().task_families.create("calc_chain")
trainer = PrimeRlTrainer(PrimeRlTrainerConfig(eval_size=4))
reply = {{"role": "assistant", "content": "<answer>" * 40_000}}  # 320 KB each
path = Path({str(tmp_path / "transcripts.json")!r})
path.write_text(json.dumps([family.initial_messages(item) + [reply] for item in family.hidden_eval(4, 1)]))
outcome = JobResult(job_id="e", status="done", artifacts={{"transcripts": path}})
print(trainer.eval_result(outcome, family=family, level=1, base_model="Qwen/Qwen3-0.6B").item_scores)
"""
    assert completes(code).strip() == "[0.0, 0.0, 0.0, 0.0]"


def test_the_triage_scorer_reads_a_huge_reply_in_linear_time():
    pytest.importorskip("aitrainsai_family_triage")
    completes("from aitrainsai.plugins import Plugins\n"
              "family = Plugins.load().task_families.create('triage')\n"
              "item = family.hidden_eval(1)[0]\n"
              "family.score(item, [{'role': 'assistant', 'content': 'roll back ' + '<answer>' * 131_072}])")


def _old_extract_answer(text, fallback="last_line"):
    """The quadratic implementation, as the oracle of what normal replies must still give."""
    tags = re.findall(r"<answer>(.*?)</answer>", text, re.S | re.I) if text else []
    if not text:
        return ""
    if tags:
        return tags[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        match = re.search(r"answer\s*[:=]\s*(.+)", line, re.I)
        if match:
            found = match.group(1).strip()
            numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", found) if fallback == "last_number" else []
            return numbers[-1] if numbers else found
    if fallback == "last_number":
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        return numbers[-1] if numbers else ""
    return lines[-1] if lines else ""


def test_the_linear_reader_gives_exactly_what_the_regular_expression_gave():
    """On short replies built from tag fragments (nested, unclosed, stray, mixed case, the long s that
    re.IGNORECASE matches), both fallbacks: the same answer as the old findall, every time."""
    pieces = ["<answer>", "</answer>", "<ANSWER>", "</Answer>", "<an\u017fwer>", "x", " ", "\n", "<", ">", "/",
              "answer: 5", "Answer=7 of 9", "<answer", "answer>", "</", "\u0130", "12,5", "-3.5"]
    rng = random.Random(25)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for fallback in ("last_line", "last_number"):
            assert extract_answer(text, fallback) == _old_extract_answer(text, fallback), (text, fallback)


def test_a_scorer_reads_only_the_end_of_a_reply():
    from aitrainsai.families import MAX_REPLY_CHARS

    assert extract_answer("<answer>7</answer>" + " " * MAX_REPLY_CHARS + "answer: 8") == "8"
    assert extract_answer("<answer>7</answer>" + " " * (MAX_REPLY_CHARS - 30) + "answer: 8") == "7"


# -- 2. deep, non-finite and non-UTF-8 JSON is refused with one typed error -----------------------------------------
def _lookup(world: dict, path: str, scale: float = 1.0) -> str:
    """Look a path up.

    Args:
        path: the path
        scale: a factor
    """
    return f"{path} x{scale}"


@pytest.mark.parametrize("arguments", DEEP)
def test_deep_tool_arguments_are_an_error_the_agent_reads(arguments):
    reply = call_tool({"lookup": _lookup}, "lookup", arguments, max_argument_chars=1_000_000)
    assert reply.startswith("error: arguments are nested more than 32 deep"), reply[:200]


@pytest.mark.parametrize("arguments", ['{"path": "a", "scale": NaN}', '{"path": "a", "scale": Infinity}',
                                       '{"path": "a", "scale": 1e400}', {"path": "a", "scale": float("inf")}])
def test_non_finite_numbers_in_tool_arguments_are_refused(arguments):
    assert call_tool({"lookup": _lookup}, "lookup", arguments).startswith("error: arguments are a number that is not "
                                                                           "finite")


@pytest.mark.parametrize("arguments", DEEP[:2])
def test_deep_arguments_to_the_agents_own_tools_are_an_error(arguments):
    from aitrainsai.run.transcript import AGENT_ARGUMENT_CHARS, call_agent_tool

    async def submit_job() -> str:
        """Submit."""
        return "submitted"

    def plain() -> str:
        """Submit."""
        return "submitted"

    reply = asyncio.run(call_agent_tool({"submit_job": submit_job}, "submit_job", arguments))
    assert reply.startswith("error: arguments are nested"), reply
    # one dispatcher: the agent's coroutine tools answer as every plain tool does
    assert reply == call_tool({"submit_job": plain}, "submit_job", arguments, max_argument_chars=AGENT_ARGUMENT_CHARS)
    assert asyncio.run(call_agent_tool({"submit_job": submit_job}, "submit_job", "{}")) == "submitted"


@pytest.mark.parametrize("arguments", [
    '{"path": "\\udcff.py", "content": "x"}',  # escaped: a name of the byte 0xff
    '{"path": "\udcff.py", "content": "x"}',  # the character itself
    {"path": "ok/\udcff.py", "content": "x"},  # already parsed by a client
    '{"path": "\\ud800.py", "content": "x"}',
    '{"path": "a.py", "content": "\\udcff"}',
])
def test_a_path_or_text_with_a_lone_surrogate_is_refused_and_nothing_is_written(tmp_path, arguments):
    workspace = Workspace(tmp_path / "ws")
    tools = {"write_file": workspace.write_file}
    reply = call_tool(tools, "write_file", arguments)
    assert reply.startswith("error: arguments are text with a lone surrogate"), reply
    reply.encode("utf-8")  # what the agent reads can always be sent back
    assert list(workspace.root.rglob("*")) == []


@pytest.mark.parametrize("name", ["read_file", "edit_file", "list_files"])
def test_the_other_file_tools_refuse_a_lone_surrogate(tmp_path, name):
    workspace = Workspace(tmp_path / "ws")
    (tmp_path / "ws" / "sub").mkdir()
    arguments = {"path": "sub/\udcff"} | ({"old": "a", "new": "b"} if name == "edit_file" else {})
    reply = call_tool({name: getattr(workspace, name)}, name, json.dumps(arguments))
    assert reply.startswith("error: arguments are text with a lone surrogate"), reply


def test_a_file_name_already_on_disk_that_is_not_utf8_reaches_the_agent_sendable(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    Path(os.fsdecode(os.fsencode(workspace.root) + b"/\xff.py")).write_text("x")
    reply = call_tool({"list_files": workspace.list_files}, "list_files", "{}")
    assert reply.encode("utf-8") and "\\udcff.py" in reply


def test_a_frozen_job_with_a_name_that_is_not_utf8_is_refused_and_hashes(tmp_path):
    from aitrainsai.jobs.job import freeze, job_digest

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "rubric.py").write_text("x = 1\n")
    Path(os.fsdecode(os.fsencode(workspace) + b"/\xff.py")).write_text("x")
    problems = freeze(workspace, tmp_path / "frozen")
    assert [(p.file, "not UTF-8" in p.message) for p in problems] == [("\\udcff.py", True)]
    str(problems[0]).encode("utf-8")
    Path(os.fsdecode(os.fsencode(tmp_path / "frozen") + b"/\xfe.py")).write_text("y")  # planted after freezing
    assert re.fullmatch("[0-9a-f]{64}", job_digest(tmp_path / "frozen"))


@pytest.mark.parametrize("data, reason", [
    ("[" * 33 + "]" * 33, "nested more than 32 deep"),
    ('[{"a": ' * 20 + "1" + "}]" * 20, "nested more than 32 deep"),
    ("[" * 10 + "}" * 10, "not valid JSON"),
    ("[NaN]", "not finite"), ("[-Infinity]", "not finite"), ("[1e999]", "not finite"),
    ('["\\ud800"]', "lone surrogate"), ('{"\\udc80": 1}', "lone surrogate"),
    (b'["\xff"]', "not UTF-8"), ("[" + "1," * 600 + "1]", "longer than 1000 characters"),
])
def test_the_bounded_loader_refuses(data, reason):
    with pytest.raises(UntrustedInputError, match=reason):
        load_json(data, what="input", max_bytes=1000)


def test_the_bounded_loader_counts_only_real_brackets():
    assert load_json("[" * 32 + "]" * 32, what="x", max_bytes=100) == eval("[" * 32 + "]" * 32)
    brackets = "[" * 500 + '\\"' + "{" * 500
    assert load_json(json.dumps([brackets, "]]]"]), what="x", max_bytes=10_000) == [brackets, "]]]"]
    assert load_json('["\\ud83d\\ude00", 1.5]', what="x", max_bytes=100) == ["\U0001f600", 1.5]
    assert str(load_json("[NaN]", what="x", max_bytes=100, finite=False)[0]) == "nan"


def _transcripts_outcome(tmp_path, text: str) -> JobResult:
    (tmp_path / "transcripts.json").write_text(text)
    return JobResult(job_id="e", status="done", artifacts={"transcripts": tmp_path / "transcripts.json"})


@pytest.mark.parametrize("text, reason", [(DEEP[0], "nested"), (DEEP[1], "nested"), (DEEP[2], "nested"),
                                          ("[[" + '{"role": "user", "content": NaN}' + "]]", "not finite"),
                                          ('[[{"role": "user", "content": "\\udcff"}]]', "lone surrogate")])
def test_a_hostile_transcripts_file_is_a_typed_error(tmp_path, text, reason):
    pytest.importorskip("aitrainsai_trainer_prime_rl")
    from aitrainsai.plugins import Plugins
    from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer

    family = Plugins.load().task_families.create("calc_chain")
    with pytest.raises(UntrustedInputError, match=reason):
        PrimeRlTrainer().eval_result(_transcripts_outcome(tmp_path, text), family=family, level=1,
                                     base_model="Qwen/Qwen3-0.6B")


@pytest.mark.parametrize("trainer_module", ["aitrainsai_trainer_prime_rl.inner", "aitrainsai_trainer_local.inner"])
@pytest.mark.parametrize("text, reason", [(DEEP[0], "nested"), ('{"train_seconds": NaN}', "train_seconds"),
                                          ('{"train_seconds": "9"}', "train_seconds"), ("[]", "train_seconds")])
def test_a_hostile_train_file_is_a_typed_error(tmp_path, trainer_module, text, reason):
    module = pytest.importorskip(trainer_module)
    trainer = next(getattr(module, n) for n in ("PrimeRlTrainer", "LocalTrainer") if hasattr(module, n))()
    (tmp_path / "train.json").write_text(text)
    outcome = JobResult(job_id="t", status="done", artifacts={"train": tmp_path / "train.json",
                                                               "checkpoint": tmp_path / "checkpoint"})
    with pytest.raises(UntrustedInputError, match=reason):
        trainer.result(outcome)


# -- 3. the baseline cache: off the event loop, and a bad evaluation fails the baseline in one line ------------------
class _Backend:
    def __init__(self, artifacts: dict[str, Path]):
        self.artifacts = artifacts

    async def run(self, payload) -> JobResult:
        return JobResult(job_id=payload.job_id, status="done", artifacts=self.artifacts)


def _baselines(tmp_path, trainer, artifacts):
    from aitrainsai.run.baseline import Baselines
    from aitrainsai.run.ledger import Ledger

    return Baselines(Ledger(tmp_path / "runs"), trainer, _Backend(artifacts), tmp_path / "work")


def _family():
    from aitrainsai.plugins import Plugins

    return Plugins.load().task_families.create("calc_chain")


def _scores(tmp_path, item_scores: str) -> Path:
    from aitrainsai.evaluation import EngineSpec

    engine = EngineSpec(engine="e", base_model="tiny-a", dtype="float32", max_new_tokens=4, batch_size=1)
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"family": "calc_chain", "level": 1, "eval_seed": 1, "eval_size": 2,
                                "engine": engine.model_dump(mode="json")})[:-1] + f', "item_scores": {item_scores}}}')
    return path


@pytest.mark.parametrize("item_scores, reason", [
    ("[NaN, 1.0]", "the evaluation's scores: a number that is not finite"),
    ("[Infinity, 0.0]", "the evaluation's scores: a number that is not finite"),
    ("[1e400, 0.0]", "the evaluation's scores: a number that is not finite"),
    ("[1.5, 0.0]", "the evaluation's scores: item_scores.0: Input should be less than or equal to 1"),
    ("[-0.5, 0.0]", "the evaluation's scores: item_scores.0: Input should be greater than or equal to 0"),
])
def test_a_baseline_of_scores_that_are_not_finite_or_not_in_0_1_is_refused_in_one_line(tmp_path, item_scores, reason):
    from episode_helpers import GivenNumbersTrainer

    baselines = _baselines(tmp_path, GivenNumbersTrainer(), {"scores": _scores(tmp_path, item_scores)})
    with pytest.raises(RuntimeError, match=f"^baseline of tiny-a on calc_chain: unreadable evaluation: {reason}") as e:
        asyncio.run(baselines.get(_family(), 1, "tiny-a"))
    assert "\n" not in str(e.value)


def test_a_parser_that_overflows_fails_the_baseline_in_one_line(tmp_path):
    from episode_helpers import GivenNumbersTrainer

    class Recursing(GivenNumbersTrainer):
        def eval_result(self, outcome, **kwargs):
            return json.loads("[" * 100_000)  # what eval_result's parsers raised before they were bounded

    baselines = _baselines(tmp_path, Recursing(), {})
    with pytest.raises(RuntimeError, match="unreadable evaluation: RecursionError|unreadable evaluation: maximum"):
        asyncio.run(baselines.get(_family(), 1, "tiny-a"))


def test_scoring_a_baseline_leaves_the_event_loop_free(tmp_path):
    """eval_result blocks until a task on the event loop has run: on the loop it would wait in vain."""
    from episode_helpers import GivenNumbersTrainer

    loop_ran = threading.Event()

    class Waiting(GivenNumbersTrainer):
        def eval_result(self, outcome, **kwargs):
            free = loop_ran.wait(timeout=5)
            result = super().eval_result(outcome, **kwargs)
            return result if free else result.model_copy(update={"item_scores": [-1.0, -1.0]})

    async def main():
        async def mark():
            await asyncio.sleep(0.05)
            loop_ran.set()

        baseline, _ = await asyncio.gather(baselines.get(_family(), 1, "tiny-a"), mark())
        return baseline

    baselines = _baselines(tmp_path, Waiting(), {"scores": _scores(tmp_path, "[0.5, 1.0]")})
    assert asyncio.run(main()).item_scores == [0.5, 1.0]


# -- 4. adapters: every field that sizes an allocation, finite and bounded ---------------------------------------------
PLAIN = {"peft_type": "LORA", "r": 16, "lora_alpha": 32.0, "target_modules": ["q_proj", "v_proj"],
         "lora_dropout": 0.0, "bias": "none", "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
         "use_dora": False, "auto_mapping": {"base_model_class": "LlamaForCausalLM",
                                             "parent_library": "transformers.models.llama.modeling_llama"}}
HOSTILE_ADAPTERS = [
    ({"rank_pattern": {"q_proj": 4096}}, "rank_pattern"),  # 2.25 GB at evaluation
    ({"rank_pattern": {"(a+)+$": 16}}, "plain module name"),  # peft matches keys as regexes
    ({"alpha_pattern": {"q_proj": 1e308}}, "alpha_pattern"),
    ({"lora_alpha": 1e308}, "lora_alpha"),
    ({"lora_alpha": "Infinity"}, "not finite"),
    ({"r": 65536}, "rank 65536"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "use_dora"),
    ({"layer_replication": [[0, 30]]}, "layer_replication"),
    ({"target_modules": ["embed_tokens"]}, "target_modules"),
    ({"target_modules": ".*"}, "target_modules"),
    ({"trainable_token_indices": [1, 2, 3]}, "trainable_token_indices"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"a_later_option": {"size": 4096}}, "a_later_option"),
]


def _adapter(folder: Path, change: dict, *, raw: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(raw or json.dumps({**PLAIN, **change}).replace('"Infinity"',
                                                                                                  "Infinity"))
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    return folder


@pytest.mark.parametrize("change, reason", HOSTILE_ADAPTERS)
def test_the_local_trainer_refuses_a_hostile_adapter_before_it_travels(tmp_path, change, reason):
    module = pytest.importorskip("aitrainsai_trainer_local.inner")
    trainer = module.LocalTrainer()
    checkpoint = _adapter(tmp_path / "adapter", change)
    with pytest.raises(ValueError, match=re.escape(reason)):
        trainer.eval_payload(_family(), 1, "SmolLM2-135M-Instruct", checkpoint, tmp_path / "eval", "e")


@pytest.mark.parametrize("change, reason", HOSTILE_ADAPTERS[:4])
def test_the_local_evaluation_refuses_a_hostile_adapter_before_loading_it(tmp_path, change, reason):
    policy = pytest.importorskip("aitrainsai_trainer_local.lora")
    with pytest.raises(ValueError, match=re.escape(reason)):
        policy.check_adapter(_adapter(tmp_path / "adapter", change))


@pytest.mark.parametrize("change, reason", HOSTILE_ADAPTERS)
def test_the_prime_rl_trainer_refuses_a_hostile_adapter(tmp_path, change, reason):
    module = pytest.importorskip("aitrainsai_trainer_prime_rl.inner")
    with pytest.raises(ValueError, match=re.escape(reason)):
        module.check_adapter(_adapter(tmp_path / "adapter", change))


@pytest.mark.parametrize("module_name", ["aitrainsai_trainer_local.inner", "aitrainsai_trainer_prime_rl.inner"])
def test_a_plain_adapter_and_a_hostile_header_are_told_apart(tmp_path, module_name):
    module = pytest.importorskip(module_name)
    check = getattr(module, "check_adapter", None) or module.check_adapter_config
    check(_adapter(tmp_path / "plain", {}))
    deep = _adapter(tmp_path / "deep", {}, raw="[" * 30_000 + "]" * 30_000)
    with pytest.raises(UntrustedInputError, match="nested"):
        check(deep)


# -- 5. trainer.toml: finite, bounded numbers -------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_name, line, reason", [
    ("local", "lora_alpha = inf", "lora_alpha: Input should be a finite number"),
    ("local", "lora_alpha = 1e308", "lora_alpha: Input should be less than or equal to 1024"),
    ("local", "lora_alpha = nan", "lora_alpha"),
    ("local", "seed = 9223372036854775807", "seed: Input should be less than or equal to 4294967295"),
    ("local", "learning_rate = nan", "learning_rate"),
    ("prime_rl", "lora_alpha = inf", "lora_alpha"),
    ("prime_rl", "temperature = nan", "temperature"),
    ("prime_rl", "learning_rate = -inf", "learning_rate"),
    ("local", "x = " + "[" * 5_000 + "]" * 5_000, "nested too deeply"),  # tomllib recurses into arrays
    ("prime_rl", "x = " + "{a = " * 3_000 + "1" + "}" * 3_000, "nested too deeply"),
])
def test_a_trainer_toml_with_a_number_that_is_not_finite_and_bounded_is_refused(tmp_path, trainer_name, line, reason):
    from aitrainsai.families import Constraints
    from aitrainsai.plugins import Plugins

    registry = Plugins.load().inner_trainers
    if trainer_name not in registry.names():
        pytest.skip(f"the {trainer_name} trainer is not installed")
    trainer = registry.create(trainer_name)
    base = trainer.base_models[0]
    (tmp_path / "trainer.toml").write_text(f'base_model = "{base}"\nsteps = 1\n{line}\n')
    problems = trainer.check_config(tmp_path, trainer.constraints(Constraints()))
    assert any(reason in str(problem) for problem in problems), problems
