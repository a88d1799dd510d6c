import json

import pytest

from aitrainsai_trainer_local.rollout import ChatFormat, family_conversation, parse_tool_calls, rollout


def call(tool, **arguments):
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


# -- parsing ---------------------------------------------------------------------------------------------------------
def test_parse_well_formed_call():
    content, calls = parse_tool_calls("Let me look.\n" + call("read_register", name="r12"))
    assert content == "Let me look.\n"
    assert calls == [{"name": "read_register", "arguments": '{"name": "r12"}'}]


def test_parse_several_calls_in_one_reply():
    _, calls = parse_tool_calls(call("read_register", name="r1") + "\n" + call("add", a=1, b=2))
    assert [c["name"] for c in calls] == ["read_register", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}


def test_parse_unclosed_final_call_as_vllm_hermes_does():
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]


@pytest.mark.parametrize("reply", [
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # malformed JSON
    '<tool_call>{"name": "add"}</tool_call>',  # no arguments
    '<tool_call>["add"]</tool_call>',  # not an object
    call("add", a=1, b=2) + '<tool_call>{oops</tool_call>',  # one bad block spoils the reply
])
def test_parse_malformed_reply_is_plain_text(reply):
    assert parse_tool_calls(reply) == (reply, [])


def test_parse_plain_text():
    assert parse_tool_calls("The answer is <answer>5</answer>") == ("The answer is <answer>5</answer>", [])


# -- rollouts with a scripted model ----------------------------------------------------------------------------------
def test_tool_calls_run_and_results_come_back(demo_family, chat_only, scripted):
    item = demo_family.generate(0, 1, 1)[0]
    register = item.question.split("registers ")[1].split(",")[0].strip()
    script = {0: call("read_register", name=register) + "\n" + call("no_such_tool"), 1: "<answer>7</answer>"}
    sampler = scripted(chat_only.tokenizer, lambda turn, row: script[turn])
    (r,) = rollout(chat_only, [family_conversation(demo_family, item)], max_new_tokens=200, temperature=0,
                   sampler=sampler)
    roles = [m["role"] for m in r.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]
    first = r.messages[2]
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["read_register", "no_such_tool"]
    assert [c["id"] for c in first["tool_calls"]] == ["call_0", "call_1"]
    assert r.messages[3] == {"role": "tool", "tool_call_id": "call_0", "name": "read_register",
                             "content": str(item.world["registers"][register])}
    assert r.messages[4]["content"].startswith("error: unknown tool 'no_such_tool'")
    assert r.messages[5] == {"role": "assistant", "content": "<answer>7</answer>"}
    assert r.turns == 2 and not r.truncated
    # the second turn was fed only what the cache lacked: the first reply's end of turn and the tool results
    pending = sampler.calls[1]["pending"][0]
    assert pending[0] == chat_only.tokenizer.eos_token_id
    assert "<tool_response>" in chat_only.tokenizer.decode(pending)


def test_token_stream_is_the_template_rendering(demo_family, chat_only, scripted):
    item = demo_family.generate(0, 1, 1)[0]
    script = {0: call("read_register", name="r1"), 1: call("add", a=2, b=3), 2: "Done. <answer>5</answer>"}
    sampler = scripted(chat_only.tokenizer, lambda turn, row: script[turn])
    (r,) = rollout(chat_only, [family_conversation(demo_family, item)], max_new_tokens=200, temperature=0,
                   sampler=sampler)
    chat = ChatFormat(chat_only.tokenizer)
    tools = demo_family.tool_schemas()
    # The template rendering of the transcript, with each assistant message as the text the model produced.
    as_sampled = [dict(m) for m in r.messages]
    for m, ids in zip([m for m in as_sampled if m["role"] == "assistant"], r.turn_ids):
        m["content"] = chat_only.tokenizer.decode(ids[:-1])
        m.pop("tool_calls", None)
    rendered = chat.render(as_sampled, tools)
    assert chat_only.tokenizer.decode(r.prompt_ids + r.completion_ids) + "\n" == rendered
    # the mask selects exactly the sampled tokens
    sampled = [t for t, keep in zip(r.completion_ids, r.completion_mask) if keep]
    assert sampled == [t for ids in r.turn_ids for t in ids]
    assert len(r.completion_ids) == len(r.completion_mask)


def test_turn_limit_is_respected(demo_family, chat_only, scripted):
    items = demo_family.generate(0, 1, 3)
    sampler = scripted(chat_only.tokenizer, lambda turn, row: call("read_register", name="r1"))
    rollouts = rollout(chat_only, [family_conversation(demo_family, item, turn_limit=3) for item in items],
                       max_new_tokens=200, temperature=0, sampler=sampler)
    for r in rollouts:
        assert r.turns == 3
        assert sum(m["role"] == "assistant" for m in r.messages) == 3
        assert r.messages[-1]["role"] == "assistant" and r.messages[-1]["tool_calls"]  # its calls are not run
        assert sum(m["role"] == "tool" for m in r.messages) == 2
    assert len(sampler.calls) == 3


def test_malformed_call_ends_the_conversation(demo_family, chat_only, scripted):
    item = demo_family.generate(0, 1, 1)[0]
    sampler = scripted(chat_only.tokenizer, lambda turn, row: '<tool_call>{"name": "add", "arguments": {</tool_call>')
    (r,) = rollout(chat_only, [family_conversation(demo_family, item)], max_new_tokens=200, temperature=0,
                   sampler=sampler)
    assert r.turns == 1 and "tool_calls" not in r.messages[-1]


def test_rows_end_independently(demo_family, chat_only, scripted):
    items = demo_family.generate(0, 1, 3)
    # row 1 answers at once; rows 0 and 2 call a tool first
    def script(turn, row):
        return "<answer>1</answer>" if turn > 0 or row == 1 else call("read_register", name="r1")
    sampler = scripted(chat_only.tokenizer, script)
    rollouts = rollout(chat_only, [family_conversation(demo_family, item) for item in items], max_new_tokens=200,
                       temperature=0, sampler=sampler)
    assert [r.turns for r in rollouts] == [2, 1, 2]
    assert sampler.calls[1]["rows"] == [0, 2]


def test_truncated_reply_gets_end_of_turn_from_the_bridge(demo_family, chat_only, scripted):
    item = demo_family.generate(0, 1, 1)[0]
    text = call("read_register", name="r1")
    n = len(chat_only.tokenizer.encode(text, add_special_tokens=False))
    script = {0: text, 1: "<answer>1</answer>"}
    sampler = scripted(chat_only.tokenizer, lambda turn, row: script[turn])
    (r,) = rollout(chat_only, [family_conversation(demo_family, item)], max_new_tokens=n, temperature=0,
                   sampler=sampler)
    assert r.turns == 2  # the call was complete although the reply hit the limit before its end of turn
    first_bridge = r.completion_ids[n:n + 2]
    assert first_bridge[0] == chat_only.tokenizer.eos_token_id and r.completion_mask[n] == 0
