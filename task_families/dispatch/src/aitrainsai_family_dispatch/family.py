"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import json
import re

from aitrainsai import Item, TaskFamily, ToolSession
from aitrainsai_family_dispatch import world

TICKET = re.compile(r"\bT-\d{6}\b")
CONDITION = re.compile(r"received from (\d\d:\d\d) to (\d\d:\d\d)|(\w+) is (\S+(?: or \S+)*)")
SHIFT = re.compile(r"^(Every day|Mon-Fri|Sat-Sun) (\d\d:\d\d)-(\d\d:\d\d) (\S+)$")
OVERRIDE = re.compile(r"^Override: on (\w+) (\S+) covers all of (\S+)'s shifts$")


class DispatchFamily(TaskFamily):
    """Route a support ticket by prioritised rules with exceptions, on-call rotations and customer records.

    The answer is a team name (``billing-ops``) or, when the deciding rule routes to a team's on-call, the name of
    the person on call (``Priya``). Answers compare case-insensitively, ignoring surrounding quotes, a final full stop
    and a leading ``team``; there is no partial credit.
    """

    name = world.FAMILY
    description = "Route support tickets to teams or on-call people by prioritised rules, exceptions and rotations."
    levels = world.LEVELS
    default_level = 1
    eval_seed = 311927074
    turn_limit = 6
    goal = (
        "Teach the model to route a support ticket. Level 1: one or two routing rules and the ticket's fields are in "
        "the question; the first matching rule (highest priority) names the team, else the default team. Levels 2-4: "
        "only the ticket id is given; read the ticket with get_request, the rules with list_rules, pick the "
        "applicable rule with the highest priority (all 'when' conditions hold, the 'unless' condition does not), "
        "and when it routes to a team's on-call, read get_oncall_schedule and name the person on shift at the "
        "ticket's time (level 4: look up tier and region with get_customer, use the weekday or weekend rotation for "
        "the ticket's day, and apply overrides). Answer with the team name or the person's name."
    )
    system_prompt = (
        "You route customer support tickets. Use the tools to read the ticket, the routing rules, customer records "
        "and on-call rotations when the question does not state them. The applicable rule with the highest priority "
        "decides; a rule applies when all its 'when' conditions hold and its 'unless' condition does not; if none "
        "applies, the ticket goes to the default team. A time range ('from A to B' in a rule, 'A-B' in a rotation) "
        "covers A up to, not including, B, and runs past midnight when B is not later than A. When the deciding rule "
        "routes to a team's on-call, the answer is "
        "the person on shift when the ticket was received (after overrides). End your final reply with "
        "<answer>DESTINATION</answer>, where DESTINATION is a team name such as billing-ops or a person's name "
        "such as Priya."
    )
    answer_format = ("End your final reply with <answer>DESTINATION</answer>: a team name (e.g. billing-ops) or the "
                     "on-call person's name (e.g. Priya). Case, quotes and a leading 'team' are ignored.")
    public_modules = ("aitrainsai_family_dispatch", "aitrainsai_family_dispatch.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def normalise_answer(self, answer: str) -> str:
        return world.normalise_destination(answer)

    def solve(self, item: Item, session: ToolSession) -> str:
        found = TICKET.search(item.question)
        assert found is not None, "the question names its ticket"
        ticket = found.group(0)
        facts = json.loads(session.call("get_request", ticket_id=ticket))
        if "customer" in facts:
            customer = json.loads(session.call("get_customer", customer_id=facts["customer"]))
            facts.update({field: customer[field] for field in world.CUSTOMER_FIELDS})
        rules, default = parse_rules(session.call("list_rules"))
        target = next((r["to"] for r in sorted(rules, key=lambda r: -r["priority"])
                       if world.rule_applies(r, facts)), default)
        if not target["on_call"]:
            return target["team"]
        schedule = parse_schedule(session.call("get_oncall_schedule", team=target["team"]))
        return world.on_call(schedule, facts.get("day", "Mon"), facts["received"])


def parse_rules(text: str) -> tuple[list[dict], dict]:
    """The rules and the default destination from ``list_rules`` output."""
    rules: list[dict] = []
    default: dict | None = None
    for line in text.splitlines():
        parts = line.split(" | ")
        target = parse_target(parts[-1])
        if parts[0] == "default":
            default = target
            continue
        rule = {"id": parts[0], "priority": int(parts[1].removeprefix("priority ")), "when": [], "unless": None,
                "to": target}
        for part in parts[2:-1]:
            kind, _, body = part.partition(" ")
            conditions = [parse_condition(m) for m in CONDITION.finditer(body)]
            if kind == "when":
                rule["when"] = conditions
            else:
                (rule["unless"],) = conditions
        rules.append(rule)
    assert default is not None, "list_rules names a default destination"
    return rules, default


def parse_condition(match: re.Match) -> dict:
    if match.group(1):
        return {"field": "received", "window": [match.group(1), match.group(2)]}
    return {"field": match.group(3), "values": match.group(4).split(" or ")}


def parse_target(text: str) -> dict:
    body = text.removeprefix("to ")
    on_call = body.startswith("on-call of ")
    return {"team": body.removeprefix("on-call of ").removeprefix("team "), "on_call": on_call}


def parse_schedule(text: str) -> dict:
    schedule: dict = {"rotation": {}, "overrides": []}
    for line in text.splitlines():
        if shift := SHIFT.match(line):
            days, start, end, person = shift.groups()
            schedule["rotation"].setdefault(days, []).append([start, end, person])
        elif override := OVERRIDE.match(line):
            day, cover, absent = override.groups()
            schedule["overrides"].append({"day": day, "absent": absent, "cover": cover})
    return schedule
