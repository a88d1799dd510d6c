import re

import pytest

from aitrainsai import ToolSession, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_string_pipeline import world
from aitrainsai_family_string_pipeline.family import StringPipelineFamily


class TestStringPipelineFamily(TaskFamilyConformance):
    family = StringPipelineFamily
    distribution = "aitrainsai-family-string-pipeline"


@pytest.fixture(scope="module")
def fam() -> StringPipelineFamily:
    return StringPipelineFamily()


TOOLS = {fn.__name__: fn for fn in world.TOOLS if fn not in (world.read_note, world.read_setting)}


def reply(fam, item, text):
    return fam.initial_messages(item) + [{"role": "assistant", "content": text}]


def test_hand_checked_level_1_items(fam):
    title, upper, keep = fam.generate(0, 1, 3)
    assert title.question == "Take the string 'gutazo' and convert it to title case. What is the result?"
    assert title.answer == "Gutazo"
    assert upper.question == "Take the string 'tupovu' and convert it to uppercase. What is the result?"
    assert upper.answer == "TUPOVU"
    assert keep.question == "Take the string 'biduvak' and keep the first 5 characters. What is the result?"
    assert keep.answer == "biduv"
    assert title.world == {"notes": {}, "settings": {}}
    easy = ("convert it to uppercase", "convert it to title case", "keep the first")
    assert all(any(op in i.question for op in easy) for i in fam.generate(3, 1, 60))  # level 1's easy transforms


def test_hand_checked_level_2_item(fam):
    item = fam.generate(0, 2, 2)[1]
    assert item.question == ("Take the string 'dokezit' and apply these steps in order: 1) reverse it; 2) rotate it "
                             "left by 3; 3) convert it to title case. What is the result?")
    # 'dokezit' -> 'tizekod' -> 'ekodtiz' -> 'Ekodtiz'
    assert item.answer == "Ekodtiz"
    calls = [m["tool_calls"][0]["function"]["name"] for m in fam.reference_transcript(item) if m.get("tool_calls")]
    assert calls == ["reverse", "rotate", "change_case"]


def test_hand_checked_level_3_item_reads_note_and_setting(fam):
    item = fam.generate(0, 3, 3)[2]
    assert item.question == ("Take the note labelled 'garden' and apply these steps in order: 1) drop the first 6 "
                             "characters; 2) convert it to title case; 3) replace every 't' with 'f'; 4) rotate it "
                             "left by k, where k is the setting 'offset'. What is the result?")
    assert item.world["notes"]["garden"] == "diku ketu lime"
    assert item.world["settings"]["offset"] == 2
    # 'diku ketu lime' -> 'etu lime' -> 'Etu Lime' -> 'Efu Lime' -> 'u LimeEf'
    assert item.answer == "u LimeEf"
    session = ToolSession(fam, item)
    assert fam.solve(item, session) == item.answer
    names = [m["name"] for m in session.messages if m["role"] == "tool"]
    assert names == ["read_note", "slice_text", "change_case", "replace", "read_setting", "rotate"]


def test_levels_grow_and_hide_inputs(fam):
    for level, spec in world.LEVELS.items():
        for item in fam.generate(21, level, 40):
            steps = item.question.count(") ") or 1
            assert spec.steps[0] <= steps <= spec.steps[1]
            assert item.question.count("where k is the setting") == spec.settings
            assert ("the note labelled" in item.question) == spec.from_note
            assert re.fullmatch(r"[A-Za-z]+( [A-Za-z]+)*", item.answer), item.answer
            assert len(item.answer) >= 2
    for item in fam.generate(21, 3, 20):
        label = re.search(r"note labelled '(\w+)'", item.question)[1]
        assert item.world["notes"][label] not in item.question


def test_transform_tools_through_call_tool():
    assert call_tool(TOOLS, "reverse", {"text": "tomaki"}) == "ikamot"
    assert call_tool(TOOLS, "change_case", {"text": "toma KELI", "case": "upper"}) == "TOMA KELI"
    assert call_tool(TOOLS, "change_case", {"text": "toma KELI", "case": "lower"}) == "toma keli"
    assert call_tool(TOOLS, "change_case", {"text": "toma KELI", "case": "title"}) == "Toma Keli"
    assert call_tool(TOOLS, "replace", {"text": "banana", "old": "a", "new": "o"}) == "bonono"
    assert call_tool(TOOLS, "replace", {"text": "banAna", "old": "A", "new": ""}) == "banna"
    assert call_tool(TOOLS, "slice_text", {"text": "abcdef", "start": 0, "end": 3}) == "abc"
    assert call_tool(TOOLS, "slice_text", {"text": "abcdef", "start": -3}) == "def"
    assert call_tool(TOOLS, "slice_text", {"text": "abcdef", "start": 2, "end": None}) == "cdef"
    assert call_tool(TOOLS, "remove_repeats", {"text": "banana"}) == "ban"
    assert call_tool(TOOLS, "remove_repeats", {"text": "ab ba cd"}) == "ab cd"
    assert call_tool(TOOLS, "rotate", {"text": "abcde", "direction": "left", "n": 2}) == "cdeab"
    assert call_tool(TOOLS, "rotate", {"text": "abcde", "direction": "right", "n": 2}) == "deabc"
    assert call_tool(TOOLS, "rotate", {"text": "abcde", "direction": "left", "n": 10**30}) == "abcde"


@pytest.mark.parametrize("name, arguments", [
    ("reverse", {"text": "x" * 501}),
    ("reverse", {"text": None}),
    ("reverse", {"text": ["a"]}),
    ("change_case", {"text": "abc", "case": "shout"}),
    ("replace", {"text": "abc", "old": "", "new": "x"}),
    ("replace", {"text": "a" * 400, "old": "a", "new": "bb"}),
    ("slice_text", {"text": "abc", "start": "two"}),
    ("rotate", {"text": "abc", "direction": "up", "n": 1}),
    ("rotate", {"text": "abc", "direction": "left", "n": 1.5}),
    ("remove_repeats", {"text": "abc", "extra": 1}),
    ("remove_repeats", "x" * 100_000),
])
def test_transform_tools_reject_bad_input(name, arguments):
    assert call_tool(TOOLS, name, arguments).startswith("error: ")


def test_lookup_tools(fam):
    item = fam.generate(0, 3, 3)[2]
    session = ToolSession(fam, item)
    assert session.call("read_note", label="garden") == "diku ketu lime"
    assert session.call("read_note", label=" 'Garden' ") == "diku ketu lime"
    assert session.call("read_setting", label="offset") == "2"
    assert session.call("read_note", label="nowhere").startswith("error: not found: no note 'nowhere'")
    assert session.call("read_setting", label="z" * 5000).startswith("error: ")
    assert call_tool(session.tools, "read_setting", {"label": 7}).startswith("error: not found")


def test_scoring_is_exact_and_case_sensitive(fam):
    item = fam.generate(0, 2, 2)[1]  # answer 'Ekodtiz'
    assert fam.score(item, reply(fam, item, "<answer>Ekodtiz</answer>")) == 1.0
    assert fam.score(item, reply(fam, item, "<answer> 'Ekodtiz' </answer>")) == 1.0
    assert fam.score(item, reply(fam, item, 'Answer: "Ekodtiz"')) == 1.0
    assert fam.score(item, reply(fam, item, "<answer>ekodtiz</answer>")) == 0.0
    assert fam.score(item, reply(fam, item, "<answer>'Ekodtiz</answer>")) == 0.0
    assert fam.score(item, reply(fam, item, "<answer>Ekodti</answer>")) == 0.0
    spaced = next(i for i in fam.generate(0, 3, 20) if " " in i.answer)
    assert fam.score(spaced, reply(fam, spaced, f"<answer>{spaced.answer.replace(' ', '  ')}</answer>")) == 1.0
    assert fam.normalise_answer("INF") != fam.normalise_answer("inf")  # letters are never read as numbers


def test_system_prompt_names_the_answer_format_and_tools(fam):
    assert "<answer>" in fam.system_prompt and "<answer>" in fam.answer_format
    for fn in world.TOOLS:
        assert fn.__name__ in fam.system_prompt
