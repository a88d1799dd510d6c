"""The shared chat format: rendering pinned to the text the local trainer produced before it moved here (captured
from ``trainer_local.rollout.ChatFormat`` with the SmolLM2 tokenizer), the tokens between turns, and reply parsing."""

import json

import pytest
from aitrainsai.chat import ChatMessage, ChatML, ChatTokens, parse_reply, parse_tool_calls

SMOLLM2 = ChatML(default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face")

TOOLS = [
    {"type": "function", "function": {
        "name": "read_register", "description": "Read a register's value.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers — exactly.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]
CASES = {
    "user_only": ([{"role": "user", "content": "What is 2+2?"}], [], True),
    "system_user": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], [], False),
    "system_tools": ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Read r1."}], TOOLS,
                     True),
    "tools_no_system": ([{"role": "user", "content": "Read r1."}], TOOLS, True),
    "tool_results_multi_turn": ([
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Add r1 and r2."},
        {"role": "assistant", "content": "Reading."},
        {"role": "tool", "tool_call_id": "call_0", "name": "read_register", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_register", "content": "4"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "7"},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "<answer>7</answer>"}], TOOLS, False),
    "none_content": ([{"role": "user", "content": None}, {"role": "assistant", "content": "ok"}], [], True),
}

# Captured from the code before the move, byte for byte.
EXPECTED = {
    "user_only": (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
        "What is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "system_user": (
        "<|im_start|>system\n"
        "You are terse.<|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
    ),
    "system_tools": (
        "<|im_start|>system\n"
        "Use tools.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"read_register\", \"description\": \"Read a register"
        "'s value.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}}, \""
        "required\": [\"name\"]}}}\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers — exactly"
        ".\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"number\"}, \"b\": {\"type\":"
        " \"number\"}}, \"required\": [\"a\", \"b\"]}}}\n"
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool"
        "_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Read r1.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "tools_no_system": (
        "<|im_start|>system\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"read_register\", \"description\": \"Read a register"
        "'s value.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}}, \""
        "required\": [\"name\"]}}}\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers — exactly"
        ".\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"number\"}, \"b\": {\"type\":"
        " \"number\"}}, \"required\": [\"a\", \"b\"]}}}\n"
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool"
        "_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Read r1.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "tool_results_multi_turn": (
        "<|im_start|>system\n"
        "Use tools.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"read_register\", \"description\": \"Read a register"
        "'s value.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}}, \""
        "required\": [\"name\"]}}}\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers — exactly"
        ".\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"number\"}, \"b\": {\"type\":"
        " \"number\"}}, \"required\": [\"a\", \"b\"]}}}\n"
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool"
        "_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Add r1 and r2.<|im_end|>\n"
        "<|im_start|>assistant\n"
        "Reading.<|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "3\n"
        "</tool_response>\n"
        "<tool_response>\n"
        "4\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "<|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "7\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>user\n"
        "And now?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<answer>7</answer><|im_end|>\n"
    ),
    "none_content": (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
        "<|im_end|>\n"
        "<|im_start|>assistant\n"
        "ok<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
}


class CharTokenizer:
    """Any tokenizer with encode will do: one id per character, the end-of-turn marker one id."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        ids, i = [], 0
        while i < len(text):
            if text.startswith("<|im_end|>", i):
                ids.append(-1)
                i += len("<|im_end|>")
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids


def decode(ids):
    return "".join("<|im_end|>" if i == -1 else chr(i) for i in ids)


def call(tool, **arguments):
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


# -- rendering -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_rendering_is_the_text_the_local_trainer_trained_on(name):
    messages, tools, generation = CASES[name]
    assert SMOLLM2.render(messages, tools, add_generation_prompt=generation) == EXPECTED[name]


def test_typed_messages_render_as_their_dicts():
    messages, tools, _ = CASES["tool_results_multi_turn"]
    typed = [ChatMessage.of(m) for m in messages]
    assert SMOLLM2.render(typed, tools) == SMOLLM2.render(messages, tools)
    assert typed[3].to_dict() == messages[3]


def test_assistant_tool_calls_render_as_hermes_blocks():
    message = {"role": "assistant", "content": "Reading.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "read_register", "arguments": '{"name": "r1"}'}},
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}
    text = ChatML().render([message])
    assert text == ("<|im_start|>assistant\nReading.\n<tool_call>\n"
                    '{"name": "read_register", "arguments": {"name": "r1"}}\n</tool_call>\n<tool_call>\n'
                    '{"name": "add", "arguments": "not json"}\n</tool_call><|im_end|>\n')
    # a reply written in the format parses back to the same calls
    reply = text.split("assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert [c.name for c in parse_reply(reply).calls] == ["read_register", "add"]


def test_no_default_system_without_one():
    assert ChatML().render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


# -- tokens ----------------------------------------------------------------------------------------------------------
def test_prompt_ids_encode_the_rendering_with_any_tokenizer():
    chat = ChatTokens(CharTokenizer(), SMOLLM2)
    messages, tools, _ = CASES["system_tools"]
    assert decode(chat.prompt_ids(messages, tools)) == EXPECTED["system_tools"]
    assert chat.end_of_turn_id == -1


@pytest.mark.parametrize("ended, expected", [
    (True, ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n</tool_response>"
           "<|im_end|>\n<|im_start|>assistant\n")),
    (False, ("<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n")),
])
def test_bridge_between_turns(ended, expected):
    """Captured from the code before the move: the end of turn unless the reply sampled it, the tool results, the
    next generation prompt."""
    chat = ChatTokens(CharTokenizer(), SMOLLM2)
    results = [{"role": "tool", "name": "add", "content": "7"}, {"role": "tool", "name": "add", "content": "8"}]
    assert decode(chat.bridge_ids(results, reply_ended=ended)) == expected
    assert chat.bridge_ids(results, reply_ended=ended) == chat.bridge_ids(results, reply_ended=ended)  # cached


def test_conversation_extends_as_a_token_prefix():
    """prompt + reply (with its end of turn) + bridge is the prompt of the longer conversation."""
    chat = ChatTokens(CharTokenizer(), SMOLLM2)
    opening = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Read r1."}]
    reply = "Reading."
    after = [{"role": "tool", "name": "read_register", "content": "3"}, {"role": "user", "content": "go on"}]
    extended = chat.prompt_ids(opening, TOOLS) + chat.encode(reply) + [-1] + chat.bridge_ids(after, reply_ended=True)
    assert extended == chat.prompt_ids(opening + [{"role": "assistant", "content": reply}] + after, TOOLS)


# -- parsing ---------------------------------------------------------------------------------------------------------
def test_parse_well_formed_call():
    parsed = parse_reply("Let me look.\n" + call("read_register", name="r12"))
    assert parsed.content == "Let me look.\n" and parsed.error is None
    assert [c.model_dump() for c in parsed.calls] == [{"name": "read_register", "arguments": '{"name": "r12"}'}]
    assert parsed.message(first_call=3)["tool_calls"] == [
        {"id": "call_3", "type": "function", "function": {"name": "read_register", "arguments": '{"name": "r12"}'}}]


def test_parse_several_calls_and_an_unclosed_last_one():
    _, calls = parse_tool_calls(call("read_register", name="r1") + "\n" + '<tool_call>{"name": "add", '
                                '"arguments": {"a": 1, "b": 2}}')
    assert [c["name"] for c in calls] == ["read_register", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}


@pytest.mark.parametrize("reply, says", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "add"}</tool_call>', "name and arguments"),
    ('<tool_call>["add"]</tool_call>', "name and arguments"),
    (call("add", a=1, b=2) + "<tool_call>{oops</tool_call>", "not valid JSON"),  # one bad block spoils the reply
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),  # too deep for the parser: still an error
])
def test_malformed_call_is_a_parse_error_not_an_exception(reply, says):
    parsed = parse_reply(reply)
    assert parsed.content == reply and parsed.calls == [] and says in parsed.error
    assert parse_tool_calls(reply) == (reply, [])
    assert "tool_calls" not in parsed.message()


def test_plain_text_is_not_an_error():
    parsed = parse_reply("The answer is <answer>5</answer>")
    assert parsed.content == "The answer is <answer>5</answer>" and not parsed.calls and parsed.error is None
