import json

from aitrainsai import ChatTokens
from aitrainsai_trainer_local.model import CHAT
from aitrainsai_trainer_local.rollout import family_conversation, rollout


def call(tool, **arguments):
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


# -- the chat format ------------------------------------------------------------------------------------------------
def test_core_chat_format_is_the_tokenizers_own_template(tokenizer):
    """aitrainsai.chat renders what SmolLM2's chat template renders (messages without tool calls)."""
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for generation in (False, True):
            assert CHAT.render(messages, add_generation_prompt=generation) == tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation)
    chat = ChatTokens(tokenizer, CHAT)
    assert chat.end_of_turn_id == tokenizer.eos_token_id


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
    chat = ChatTokens(chat_only.tokenizer, CHAT)
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
