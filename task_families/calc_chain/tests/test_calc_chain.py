import json
import re

import pytest

from aitrainsai import ToolSession, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_calc_chain import world
from aitrainsai_family_calc_chain.family import CalcChainFamily


class TestCalcChainFamily(TaskFamilyConformance):
    family = CalcChainFamily
    distribution = "aitrainsai-family-calc-chain"


@pytest.fixture(scope="module")
def fam() -> CalcChainFamily:
    return CalcChainFamily()


def reply(fam, item, text):
    return fam.initial_messages(item) + [{"role": "assistant", "content": text}]


def test_hand_checked_level_1_items(fam):
    first, _, third = fam.generate(0, 1, 3)
    assert first.question == "Luca starts at 22 and subtracts 2. What number does Luca reach?"
    assert first.answer == "20"
    assert third.question == "Xena starts at 27, subtracts 14, then multiplies by 4. What number does Xena reach?"
    assert third.answer == str((27 - 14) * 4)
    assert first.world == {"crates": {}}


def test_hand_checked_level_2_item_uses_a_lookup(fam):
    item = fam.generate(0, 2, 2)[1]
    assert item.question == ("Gemma starts at 36, adds the number of apricots in crate H, multiplies by 6, then "
                             "subtracts 20. What number does Gemma reach?")
    assert item.world["crates"]["H"]["apricots"] == 23
    assert item.answer == str((36 + 23) * 6 - 20)
    transcript = fam.reference_transcript(item)
    calls = [m["tool_calls"][0]["function"] for m in transcript if m.get("tool_calls")]
    assert calls[0] == {"name": "count_fruit", "arguments": json.dumps({"crate": "H", "fruit": "apricots"})}
    assert [c["name"] for c in calls[1:]] == ["add", "multiply", "subtract"]


def test_hand_checked_level_4_item(fam):
    item = fam.generate(0, 4, 1)[0]
    crates = item.world["crates"]
    assert item.question.startswith("Kofi starts at the number of pears in crate E, adds the number of apricots in "
                                    "crate D, takes the remainder after dividing by 5,")
    value = (crates["E"]["pears"] + crates["D"]["apricots"]) % 5
    value = (value + crates["F"]["cherries"] + 263) // 9 + crates["F"]["plums"] + 533
    assert item.answer == str(value)


def test_levels_grow_longer_and_need_lookups(fam):
    for level, spec in world.LEVELS.items():
        for item in fam.generate(21, level, 40):
            text = item.question.split(". What number")[0]
            steps = len(re.findall(r"(adds|subtracts|multiplies by|divides by|dividing by) ", text))
            assert spec.steps[0] <= steps <= spec.steps[1]
            lookups = text.count("the number of")
            assert lookups == spec.lookups + (1 if text.split(",")[0].count("the number of") else 0)
            assert 0 < int(item.answer) <= spec.cap
    assert not any("crate" in item.question for item in fam.generate(21, 1, 100))


def test_last_number_in_question_is_never_the_answer(fam):
    for item in fam.hidden_eval():
        assert re.findall(r"\d+", item.question)[-1] != item.answer


def test_arithmetic_tools_through_call_tool():
    tools = {fn.__name__: fn for fn in world.TOOLS if fn is not world.count_fruit}
    assert call_tool(tools, "add", {"a": 17, "b": 25}) == "42"
    assert call_tool(tools, "subtract", '{"a": 5, "b": 9}') == "-4"
    assert call_tool(tools, "multiply", {"a": "12", "b": 3}) == "36"
    assert call_tool(tools, "divide", {"a": 17, "b": 5}) == "3"
    assert call_tool(tools, "remainder", {"a": 17, "b": 5}) == "2"
    assert call_tool(tools, "divide", {"a": 1, "b": 0}).startswith("error: cannot divide by zero")
    assert call_tool(tools, "remainder", {"a": 1, "b": 0}).startswith("error: cannot divide by zero")


@pytest.mark.parametrize("arguments", [
    {"a": 10**30, "b": 1},
    {"a": 1, "b": -(10**13)},
    {"a": "seven", "b": 1},
    {"a": 1.5, "b": 1},
    {"a": [1], "b": 1},
    {"a": True, "b": 1},
    {"a": 1},
    {"a": 1, "b": 2, "c": 3},
    "x" * 100_000,
])
def test_arithmetic_tools_reject_bad_input(arguments):
    tools = {fn.__name__: fn for fn in world.TOOLS}
    for name in ("add", "subtract", "multiply", "divide", "remainder"):
        assert call_tool(tools, name, arguments).startswith("error: ")


def test_count_fruit_lookups(fam):
    item = fam.generate(0, 2, 2)[1]
    session = ToolSession(fam, item)
    assert session.call("count_fruit", crate="H", fruit="apricots") == "23"
    assert session.call("count_fruit", crate=" crate h ", fruit="Apricots") == "23"
    assert session.call("count_fruit", crate="Z", fruit="apricots").startswith("error: not found: no crate 'Z'")
    assert session.call("count_fruit", crate="H", fruit="bananas").startswith("error: not found: crate H holds no")
    assert session.call("count_fruit", crate="H" * 5000, fruit="x" * 5000).startswith("error: ")
    assert call_tool(session.tools, "count_fruit", {"crate": 3, "fruit": None}).startswith("error: ")


def test_scoring_takes_numbers_as_numbers(fam):
    item = next(i for i in fam.generate(5, 3, 50) if int(i.answer) >= 1000)
    number = int(item.answer)
    assert fam.score(item, reply(fam, item, f"<answer>{number:,}</answer>")) == 1.0
    assert fam.score(item, reply(fam, item, f"So the result is {number}.")) == 1.0
    assert fam.score(item, reply(fam, item, f"Answer: {number}")) == 1.0
    assert fam.score(item, reply(fam, item, f"<answer>{number + 1}</answer>")) == 0.0
    assert fam.score(item, reply(fam, item, f"<answer>{number}</answer> wait, {number + 1}")) == 1.0


def test_system_prompt_names_the_answer_format(fam):
    assert "<answer>" in fam.system_prompt and "<answer>" in fam.answer_format
    for fn in world.TOOLS:
        assert fn.__name__ in fam.system_prompt
