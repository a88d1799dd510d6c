"""The two renderers against the library's own output: tinker-cookbook's ``qwen3_5_disable_thinking`` and
``qwen3_instruct`` renderers (0.5.8), on Qwen3.5's and Qwen3's real tokenizers (embedded in ``tml-renderers`` 0.2.1).
Both are installed apart, for these tests only, in ``.venv/pinned/tinker-renderers`` (the Makefile does it), and
the token ids of a multi-turn episode with tool calls and tool results are compared turn by turn, then pinned.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from aitrainsai_outer_tinker import rendering

PINNED = Path(__file__).resolve().parents[3] / ".venv" / "pinned" / "tinker-renderers"

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "submit_job", "description": "Submit the job.",
                                      "parameters": {"type": "object",
                                                     "properties": {"note": {"type": "string"},
                                                                    "retries": {"type": "integer"}},
                                                     "required": []}}},
]


def _calls(*calls: tuple[str, dict]) -> list[dict]:
    return [{"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for k, (name, args) in enumerate(calls)]


EPISODE = [
    {"role": "system", "content": "You write training jobs for small language models."},
    {"role": "user", "content": "Teach calc_chain at level 1.\n"},
    {"role": "assistant", "content": "Let me read the spec first.",
     "tool_calls": _calls(("read_file", {"path": "spec.md"}))},
    {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": "# calc_chain\nchained arithmetic"},
    {"role": "assistant", "content": "",
     "tool_calls": _calls(("read_file", {"path": "rubric.py"}), ("submit_job", {"note": "first try", "retries": 2}))},
    {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": "def reward(x):\n    return 1.0"},
    {"role": "tool", "tool_call_id": "call_1", "name": "submit_job", "content": '{"accepted": false}'},
    {"role": "user", "content": "Two turns left."},
    {"role": "assistant", "content": "I will fix the rubric.",
     "tool_calls": _calls(("submit_job", {"note": "second", "retries": 0}))},
    {"role": "tool", "tool_call_id": "call_0", "name": "submit_job", "content": '{"accepted": true}'},
]

# sha256 of the prompt ids before each agent turn (as JSON), and their lengths: the pin
PINS = {
    "qwen3_5": "f9c398236972b1ad18655ab006e6cd3590b0e953d659c5f1ef5dbe4f77d36aa8",
    "hermes": "09cfdc24f31ef13a17095153a4b87b35f847bb92bc137d947d05f137d36bb821",
}


@pytest.fixture(scope="module")
def library():
    if not PINNED.is_dir():
        pytest.skip(f"the reference renderers are not installed in {PINNED} (make install does it)")
    pytest.importorskip("torch", reason="tml-renderers imports torch")
    sys.path.insert(0, str(PINNED))
    try:
        import tml_renderers
        from tinker_cookbook.renderers import get_renderer
        from tinker_cookbook.renderers.base import ToolCall
    finally:
        sys.path.remove(str(PINNED))
    return tml_renderers, get_renderer, ToolCall


def _cookbook_messages(messages, ToolCall):
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [ToolCall(function=ToolCall.FunctionBody(
                name=c["function"]["name"], arguments=c["function"]["arguments"]), id=c["id"])
                for c in message["tool_calls"]]
        out.append(message)
    return out


def _prompts(ours, cookbook, cookbook_tools, ToolCall):
    """(our ids, the cookbook's ids) of the prompt before each agent turn of the episode."""
    system, rest = EPISODE[0]["content"], EPISODE[1:]
    prefix = cookbook.create_conversation_prefix_with_tools(cookbook_tools, system)
    pairs = []
    for end in range(1, len(rest) + 1):
        if rest[end - 1]["role"] == "assistant" or (end < len(rest) and rest[end]["role"] == "tool"):
            continue
        theirs = cookbook.build_generation_prompt(prefix + _cookbook_messages(rest[:end], ToolCall)).to_ints()
        pairs.append((ours.prompt(EPISODE[:end + 1], TOOLS), theirs))
    return pairs


def _assert_same(pairs, tokenizer) -> None:
    """Our ids equal the library's on each of the episode's five prompts."""
    assert len(pairs) == 5
    for k, (mine, theirs) in enumerate(pairs):
        assert mine == theirs, (k, tokenizer.decode(mine)[-400:], tokenizer.decode(theirs)[-400:])


def _pin(pairs) -> str:
    return hashlib.sha256(json.dumps([p for p, _ in pairs]).encode()).hexdigest()


def test_the_qwen35_renderer_gives_the_cookbooks_tokens_turn_by_turn(library):
    tml, get_renderer, ToolCall = library
    tokenizer = rendering.EmbeddedTokenizer(tml.tokenizers.Qwen35Tokenizer())
    ours = rendering.Qwen35Renderer(tokenizer)
    cookbook = get_renderer("qwen3_5_disable_thinking", tokenizer)
    pairs = _prompts(ours, cookbook, TOOLS, ToolCall)
    _assert_same(pairs, tokenizer)
    assert cookbook.get_stop_sequences() == rendering.stop_tokens(ours)[:1]
    assert _pin(pairs) == PINS["qwen3_5"], _pin(pairs)


def test_the_hermes_renderer_gives_tml_renderers_qwen3_instruct_tokens_turn_by_turn(library):
    """Qwen3 instruct against ``tml_renderers.renderers.Qwen3.instruct()``: the cookbook's own ``qwen3_instruct``
    renderer writes each of several consecutive tool results as a user turn of its own and tokenizes piece by piece,
    where Qwen3's Hugging Face template (and vLLM, and the core's ChatML) group them in one turn."""
    tml, _, _ = library
    tokenizer = rendering.EmbeddedTokenizer(tml.tokenizers.Qwen3Tokenizer())
    ours = rendering.renderer("hermes", tokenizer)
    reference = tml.renderers.Qwen3.instruct()
    chat = tml.chat
    declared = chat.Message(author=chat.Author(chat.AuthorKind.System, "tool_declare"), content=chat.ToolDeclareJson(
        [chat.ToolSpecJson("function", t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
         for t in TOOLS]))
    pairs = []
    for end in range(2, len(EPISODE) + 1):
        if EPISODE[end - 1]["role"] == "assistant" or (end < len(EPISODE) and EPISODE[end]["role"] == "tool"):
            continue
        messages = list(chat.MessageList.from_oss_messages(EPISODE[:end]).messages)
        spans, _ = reference.render_for_completion(chat.MessageList([messages[0], declared] + messages[1:]))
        pairs.append((ours.prompt(EPISODE[:end], TOOLS), [i for span in spans for i in span.span.tokens]))
    _assert_same(pairs, tokenizer)
    assert reference.stop() == rendering.stop_tokens(ours)[:1]
    assert _pin(pairs) == PINS["hermes"], _pin(pairs)


def test_the_qwen35_renderer_reads_the_replies_the_cookbook_reads(library):
    tml, get_renderer, ToolCall = library
    tokenizer = rendering.EmbeddedTokenizer(tml.tokenizers.Qwen35Tokenizer())
    ours = rendering.Qwen35Renderer(tokenizer)
    cookbook = get_renderer("qwen3_5_disable_thinking", tokenizer)
    replies = [
        "Reading it.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\nspec.md\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>",
        "<tool_call>\n<function=submit_job>\n<parameter=note>\nmulti\nline\n</parameter>\n<parameter=retries>\n3\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        "Just text, no call.<|im_end|>",
    ]
    for reply in replies:
        ids = tokenizer.encode(reply)
        parsed = ours.parse(ids)
        theirs, _ = cookbook.parse_response(ids)
        content = theirs.get("content") or ""
        if isinstance(content, list):  # the cookbook's structured content: its text parts
            content = "".join(part["text"] for part in content if part.get("type") == "text")
        assert parsed.error is None and parsed.content == content.strip()
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in theirs.get("tool_calls", [])]


def test_malformed_xml_calls_are_a_parse_error_with_all_text_kept():
    for text in ["<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n</function>",  # not closed
                 "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {}}\n</tool_call>",  # Hermes JSON
                 "<tool_call>\n<function=read_file>\nstray\n<parameter=path>\nx\n</parameter>\n</function>\n"
                 "</tool_call>"]:
        parsed = rendering.parse_xml_calls(text)
        assert parsed.calls == [] and parsed.error and parsed.content == text


def test_the_base_model_chooses_the_format():
    assert rendering.chat_format("Qwen/Qwen3.6-35B-A3B") == "qwen3_5"
    assert rendering.chat_format("Qwen/Qwen3.5-35B-A3B") == "qwen3_5"
    assert rendering.chat_format("Qwen/Qwen3-30B-A3B-Instruct-2507") == "hermes"
    assert rendering.chat_format(rendering.LOCAL_BASE_MODEL) == "hermes"
    for other in ("Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-8B-Instruct", "deepseek-ai/DeepSeek-V3.1"):
        assert rendering.chat_format(other) is None, other
