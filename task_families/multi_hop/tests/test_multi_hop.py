import json
import re

import pytest

from aitrainsai import ToolSession, bind, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_multi_hop import world
from aitrainsai_family_multi_hop.family import MultiHopFamily


class TestMultiHopFamily(TaskFamilyConformance):
    family = MultiHopFamily
    distribution = "aitrainsai-family-multi-hop"


def _person(city, team="Falcon", language="Rust", pet="cat", hobby="chess", **relations):
    return {"attributes": {"city": city, "team": team, "language": language, "pet": pet, "hobby": hobby},
            "relations": relations}


# A hand-made directory: Ana's manager is Bram, Bram's mentor is Cira, Cira's sibling is Dov (and back).
WORLD = {
    "organisation": "Testvale Labs",
    "people": {
        "Ana Kovac": _person("Lima", manager="Bram Tello", mentor="Cira Voss", best_friend="Dov Osei"),
        "Bram Tello": _person("Oslo", team="Comet", mentor="Cira Voss", best_friend="Ana Kovac"),
        "Cira Voss": _person("Porto", hobby="rowing", manager="Bram Tello", mentor="Ana Kovac",
                             best_friend="Bram Tello", sibling="Dov Osei"),
        "Dov Osei": _person("Oslo", pet="ferret", manager="Bram Tello", mentor="Bram Tello",
                            best_friend="Cira Voss", sibling="Cira Voss"),
    },
}
TOOLS = {fn.__name__: bind(fn, WORLD) for fn in world.TOOLS}


def test_tools_on_a_hand_made_directory():
    assert call_tool(TOOLS, "get_relation", {"person": "Ana Kovac", "relation": "manager"}) == "Bram Tello"
    assert call_tool(TOOLS, "get_relation", {"person": "  ana   KOVAC ", "relation": "manager"}) == "Bram Tello"
    assert call_tool(TOOLS, "get_relation", {"person": "Bram Tello", "relation": "mentor"}) == "Cira Voss"
    assert call_tool(TOOLS, "get_relation", {"person": "Cira Voss", "relation": "sibling"}) == "Dov Osei"
    assert call_tool(TOOLS, "get_attribute", {"person": "Dov Osei", "attribute": "pet"}) == "ferret"
    assert json.loads(call_tool(TOOLS, "find_people", {"attribute": "city", "value": "oslo"})) == [
        "Bram Tello", "Dov Osei"]
    assert call_tool(TOOLS, "find_people", {"attribute": "city", "value": "Atlantis"}) == "[]"


def test_tools_report_bad_input_as_errors():
    cases = [
        ("get_relation", {"person": "Nobody Here", "relation": "manager"}, "not found"),
        ("get_relation", {"person": "Bram Tello", "relation": "sibling"}, "no sibling"),
        ("get_relation", {"person": "Ana Kovac", "relation": "best friend"}, "must be one of"),
        ("get_relation", {"person": 12, "relation": "manager"}, "not found"),
        ("get_relation", {"person": ["Ana Kovac"], "relation": "manager"}, "must be a string"),
        ("get_relation", {"person": "x" * 1_500, "relation": "manager"}, "at most"),
        ("get_attribute", {"person": "Ana Kovac", "attribute": "salary"}, "must be one of"),
        ("get_attribute", {"person": "Ana Kovac"}, "missing"),
        ("find_people", {"attribute": "city", "value": "y" * 1_000}, "at most"),
        ("find_people", {"attribute": "city", "value": "Oslo", "extra": 1}, "unknown argument"),
    ]
    for name, arguments, expected in cases:
        result = call_tool(TOOLS, name, arguments)
        assert result.startswith("error:") and expected in result, (name, arguments, result)


def _parse(ask):
    """(attribute, relation words outermost first, start phrase) of a question's last line."""
    for attribute, template in world.QUESTION_TEMPLATES.items():
        before, after = template.split("{who}")
        if ask.startswith(before) and ask.endswith(after):
            who = ask[len(before):len(ask) - len(after)]
            words = re.findall(r"the (manager|mentor|sibling|best friend) of ", who)
            start = re.sub(r"^(?:the (?:manager|mentor|sibling|best friend) of )+", "", who)
            return attribute, words, start
    raise AssertionError(ask)


def test_chain_questions_resolve_inside_out():
    fam = MultiHopFamily()
    for level in fam.levels:
        for item in fam.generate(11, level, 30):
            people = item.world["people"]
            attribute, words, start = _parse(item.question.rsplit("\n", 1)[-1].split(": ", 1)[-1])
            assert len(words) in world.LEVELS[level].hops
            if level == 4:  # the start is described by two attributes that only they have together
                assert start.startswith("the person ")
                continue
            person = start
            for word in reversed(words):
                person = people[person]["relations"][word.replace(" ", "_")]
            assert people[person]["attributes"][attribute] == item.answer


def test_level_one_states_every_fact_needed():
    fam = MultiHopFamily()
    for item in fam.generate(5, 1, 40):
        facts, ask = item.question.split("\nQuestion: ")
        assert facts.startswith("Facts: ")
        attribute, words, person = _parse(ask)
        stated = dict(re.findall(r"([A-Z][a-z]+ [A-Z][a-z]+'s (?:manager|mentor|sibling|best friend)) is "
                                 r"([A-Z][a-z]+ [A-Z][a-z]+)\.", facts))
        for word in reversed(words):
            person = stated[f"{person}'s {word}"]
        assert world.ATTRIBUTE_FACTS[attribute].format(person=person, value=item.answer) in facts


def test_higher_levels_need_the_tools():
    fam = MultiHopFamily()
    for level in (2, 3, 4):
        for item in fam.generate(5, level, 20):
            assert "Facts:" not in item.question
            assert item.question.startswith("In the staff directory of ")
            assert len(item.world["people"]) == world.LEVELS[level].people
    for item in fam.generate(5, 4, 20):
        assert "the person who" in item.question or "the person whose" in item.question
        assert any(m["tool_calls"][0]["function"]["name"] == "find_people"
                   for m in fam.reference_transcript(item) if m.get("tool_calls"))


def test_answers_compare_in_canonical_form():
    fam = MultiHopFamily()
    item = fam.generate(3, 2, 1)[0]
    reply = lambda text: fam.initial_messages(item) + [{"role": "assistant", "content": text}]  # noqa: E731
    assert fam.score(item, reply(f"<answer>{item.answer.upper()}.</answer>")) == 1.0
    assert fam.score(item, reply(f"The answer is\n\"{item.answer}\"")) == 1.0
    assert fam.score(item, reply(f"<answer>not {item.answer}</answer>")) == 0.0


def test_session_tools_see_the_items_world():
    fam = MultiHopFamily()
    item = fam.generate(8, 3, 1)[0]
    session = ToolSession(fam, item)
    someone = sorted(item.world["people"])[0]
    city = item.world["people"][someone]["attributes"]["city"]
    assert session.call("get_attribute", person=someone, attribute="city") == city


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_questions_are_distinct(level):
    items = MultiHopFamily().generate(0, level, 200)
    assert len({item.question for item in items}) >= 198


def test_reference_transcripts_fit_the_turn_limit():
    fam = MultiHopFamily()
    for level in fam.levels:
        for item in fam.generate(13, level, 30):
            calls = sum(1 for m in fam.reference_transcript(item) if m.get("tool_calls"))
            assert 1 <= calls < fam.turn_limit
