import json

import pytest

from aitrainsai import Item, ToolSession, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_dispatch import world
from aitrainsai_family_dispatch.family import DispatchFamily


class TestDispatchFamily(TaskFamilyConformance):
    family = DispatchFamily
    distribution = "aitrainsai-family-dispatch"


def when(field, *values):
    return {"field": field, "values": list(values)}


def hours(start, end):
    return {"field": "received", "window": [start, end]}


def rule(rule_id, priority, conditions, to, unless=None, on_call=False):
    return {"id": rule_id, "priority": priority, "when": conditions, "unless": unless,
            "to": {"team": to, "on_call": on_call}}


@pytest.fixture
def hand_world():
    """A level-4 ticket: R1 is excepted (region EU), R3 misses (tier), R2 routes to the sre on-call."""
    return {
        "request": {"id": "T-100200", "company": "Globex", "customer": "C-4242", "category": "outage",
                    "severity": "P1", "channel": "phone", "language": "de", "day": "Sat", "received": "22:00"},
        "customers": {"C-4242": {"customer": "C-4242", "name": "Globex", "tier": "enterprise", "region": "EU"}},
        "rules": [
            rule("R1", 90, [when("category", "outage")], "eu-desk", unless=when("region", "EU")),
            rule("R2", 60, [when("severity", "P1", "P2"), hours("20:00", "06:00")], "sre", on_call=True),
            rule("R3", 80, [when("tier", "pro")], "vip-desk"),
        ],
        "default_team": "helpdesk",
        "schedules": {"sre": {
            "rotation": {"Mon-Fri": [["06:00", "18:00", "Ana"], ["18:00", "06:00", "Bruno"]],
                         "Sat-Sun": [["10:00", "22:00", "Chen"], ["22:00", "10:00", "Dara"]]},
            "overrides": [{"day": "Sat", "absent": "Dara", "cover": "Eli"},
                          {"day": "Sun", "absent": "Chen", "cover": "Fatima"}],
        }},
    }


def hand_item(world_dict, level=4):
    return Item(family="dispatch", level=level, seed=0, index=0, question="Route ticket T-100200.",
                answer=world.route(world_dict), world=world_dict)


def test_hand_checked_route_follows_priority_exception_rotation_and_override(hand_world):
    # R1 is excepted, R3 does not match, R2 applies; Sat 22:00 starts Dara's shift; Eli covers Dara on Sat.
    assert world.route(hand_world) == "Eli"
    hand_world["schedules"]["sre"]["overrides"] = []
    assert world.route(hand_world) == "Dara"
    hand_world["request"]["received"] = "21:55"
    assert world.route(hand_world) == "Chen"
    hand_world["request"]["received"] = "19:00"  # outside R2's window: no rule applies
    assert world.route(hand_world) == "helpdesk"
    hand_world["customers"]["C-4242"]["region"] = "US"  # R1's exception no longer holds
    assert world.route(hand_world) == "eu-desk"


def test_time_windows_cover_start_not_end_and_wrap_midnight():
    assert world.in_window("20:00", "20:00", "06:00")
    assert world.in_window("05:59", "20:00", "06:00")
    assert not world.in_window("06:00", "20:00", "06:00")
    assert world.in_window("09:00", "09:00", "17:00") and not world.in_window("17:00", "09:00", "17:00")


def test_hand_checked_tool_results(hand_world):
    tools = DispatchFamily().tools(hand_item(hand_world))
    rules = call_tool(tools, "list_rules", {})
    assert rules.splitlines() == [
        "R1 | priority 90 | when category is outage | unless region is EU | to team eu-desk",
        "R2 | priority 60 | when severity is P1 or P2 and received from 20:00 to 06:00 | to on-call of team sre",
        "R3 | priority 80 | when tier is pro | to team vip-desk",
        "default | to team helpdesk",
    ]
    assert json.loads(call_tool(tools, "get_request", {"ticket_id": "t-100200"}))["customer"] == "C-4242"
    assert json.loads(call_tool(tools, "get_customer", {"customer_id": "C-4242"}))["region"] == "EU"
    schedule = call_tool(tools, "get_oncall_schedule", {"team": "sre"})
    assert "Sat-Sun 22:00-10:00 Dara" in schedule
    assert "Override: on Sat Eli covers all of Dara's shifts" in schedule


def test_reference_solver_on_hand_world(hand_world):
    family = DispatchFamily()
    item = hand_item(hand_world)
    transcript = family.reference_transcript(item)
    assert transcript[-1]["content"] == "<answer>Eli</answer>"
    called = [m["tool_calls"][0]["function"]["name"] for m in transcript if m.get("tool_calls")]
    assert called == ["get_request", "get_customer", "list_rules", "get_oncall_schedule"]


def test_level_one_states_everything_in_the_question():
    for item in world.generate(11, 1, 30):
        lines = item.question.splitlines()
        assert item.world["request"]["id"] in lines[-1]
        assert f"team {item.answer}" in item.question
        assert not item.world["schedules"] and not item.world["customers"]
        assert all(len(r["when"]) == 1 for r in item.world["rules"])


def test_higher_levels_hide_the_facts_and_use_rotations():
    for level in (2, 3, 4):
        items = world.generate(11, level, 40)
        for item in items:
            request = item.world["request"]
            assert item.answer not in item.question
            assert request["category"] not in item.question
        people = sum(item.answer in world.PEOPLE for item in items)
        assert (people == 0) if level == 2 else (people >= 10), (level, people)
    assert all(item.world["customers"] for item in world.generate(11, 4, 10))


def test_levels_need_more_rules():
    def mean_rules(level):
        return sum(len(i.world["rules"]) for i in world.generate(3, level, 40)) / 40
    assert mean_rules(1) < mean_rules(2) < mean_rules(4)


def test_answers_spread_and_both_rules_and_default_win_at_level_one():
    items = world.generate(21, 1, 200)
    defaults = sum(item.answer == item.world["default_team"] for item in items)
    first = sum(item.answer == item.world["rules"][0]["to"]["team"] for item in items)
    assert 0.15 < defaults / 200 < 0.5 and 0.25 < first / 200 < 0.7


def test_answer_normalisation():
    family = DispatchFamily()
    item = hand_item({**world.generate(1, 1, 1)[0].world}, level=1)

    def reply(text: str) -> list:
        return family.initial_messages(item) + [{"role": "assistant", "content": text}]

    assert family.score(item, reply(f"<answer>Team {item.answer.upper()}.</answer>")) == 1.0
    assert family.score(item, reply(f"<answer>'{item.answer}'</answer>")) == 1.0
    assert family.score(item, reply("<answer>nobody</answer>")) == 0.0


@pytest.mark.parametrize("name, arguments", [
    ("get_request", {"ticket_id": "T-999999"}),
    ("get_request", {"ticket_id": "x" * 5000}),
    ("get_request", {"ticket_id": ["T-100200"]}),
    ("get_request", {}),
    ("get_customer", {"customer_id": "C-0000"}),
    ("get_customer", {"customer_id": 12}),
    ("get_oncall_schedule", {"team": "vip-desk"}),
    ("get_oncall_schedule", {"team": "nonexistent"}),
    ("get_oncall_schedule", {"team": None}),
    ("list_rules", {"verbose": True}),
])
def test_bad_tool_input_is_an_error_string(hand_world, name, arguments):
    session = ToolSession(DispatchFamily(), hand_item(hand_world))
    result = call_tool(session.tools, name, json.dumps(arguments))
    assert result.startswith("error: "), result
    assert len(result) < 600


def test_generation_rejects_unknown_level():
    with pytest.raises(ValueError):
        world.generate(1, 9, 1)
