"""Public: the seeded generator and the tools. An agent's job may import this module.

A world is one support ticket, the routing rules, the on-call rotations and (level 4) the customer records.
Rule semantics: the applicable rule with the highest priority decides; a rule applies when all its ``when``
conditions hold and its ``unless`` condition does not; when no rule applies the ticket goes to the default team.
A time window or shift ``HH:MM-HH:MM`` covers its start up to, not including, its end, and runs past midnight when
the end is not later than the start.
"""

from __future__ import annotations

import random
import re
from typing import Any

from aitrainsai import Item

FAMILY = "dispatch"
LEVELS = (1, 2, 3, 4)

TEAMS = (
    "billing-ops", "identity", "sre", "payments", "data-platform", "api-support", "security-response", "logistics",
    "retention", "partner-eng", "eu-desk", "apac-desk", "vip-desk", "helpdesk", "frontline", "trust-safety",
    "compliance", "growth", "infra", "mobile", "refunds", "integrations", "accounts", "escalations",
)
PEOPLE = (
    "Ana", "Bruno", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
    "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zoe",
    "Aiko", "Bilal", "Carmen", "Dmitri", "Esra", "Felix", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Luca",
)
COMPANIES = (
    "Acme Corp", "Globex", "Initech", "Umbrella Labs", "Hooli", "Vandelay Imports", "Stark Freight", "Wayne Retail",
    "Tyrell Systems", "Cyberdyne", "Soylent Foods", "Wonka Treats", "Gringotts Bank", "Oscorp", "Aperture Science",
    "Black Mesa", "Monarch Paper", "Pied Piper", "Dunder Mifflin", "Bluth Homes", "Krusty Foods", "Nakatomi Trading",
    "Massive Dynamic", "Prestige Worldwide", "Sirius Cybernetics", "Weyland Mining", "Zorg Industries",
    "Blue Sun", "Virtucon", "Spacely Sprockets", "Cogswell Cogs", "Duff Brewing", "Gekko Partners", "Kramerica",
    "Mooby Foods", "Planet Express", "Rich Industries", "Stay Puft", "Taggart Rail", "Yoyodyne",
)
FIELD_VALUES: dict[str, tuple[str, ...]] = {
    "category": ("billing", "login", "outage", "refund", "data-export", "api-error", "security", "shipping",
                 "account-closure", "integration", "invoice", "password-reset"),
    "region": ("EU", "US", "APAC", "LATAM"),
    "tier": ("free", "pro", "enterprise"),
    "severity": ("P1", "P2", "P3", "P4"),
    "channel": ("email", "chat", "phone", "web-form"),
    "language": ("en", "de", "fr", "ja", "es"),
    "day": ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"),
}
WEEKEND = ("Sat", "Sun")
CUSTOMER_FIELDS = ("tier", "region")
RULE_FIELDS = {
    2: ("category", "region", "tier", "severity", "channel"),
    3: ("category", "region", "tier", "severity", "channel", "received"),
    4: ("category", "region", "tier", "severity", "channel", "language", "day", "received"),
}
RULE_COUNT = {2: (4, 5), 3: (5, 6), 4: (5, 7)}
MAX_ID_CHARS = 40


def normalise_destination(answer: str) -> str:
    """An answer as the eval compares it: case, surrounding quotes, a final full stop and a leading 'team' ignored."""
    text = " ".join(str(answer).split()).strip("'\"`*. ").casefold()
    return re.sub(r"^(?:the )?team ", "", text)


# -- times -------------------------------------------------------------------------------------------------------


def minutes(hhmm: str) -> int:
    hours, mins = hhmm.split(":")
    return int(hours) * 60 + int(mins)


def hhmm(total: int) -> str:
    total %= 24 * 60
    return f"{total // 60:02d}:{total % 60:02d}"


def in_window(time: str, start: str, end: str) -> bool:
    """``time`` lies in [start, end), the window running past midnight when end <= start."""
    t, a, b = minutes(time), minutes(start), minutes(end)
    return a <= t < b if a < b else (t >= a or t < b)


# -- rule semantics ------------------------------------------------------------------------------------------------

def condition_holds(condition: dict, facts: dict) -> bool:
    if condition["field"] == "received":
        return in_window(facts["received"], *condition["window"])
    return facts[condition["field"]] in condition["values"]


def rule_applies(rule: dict, facts: dict) -> bool:
    if not all(condition_holds(c, facts) for c in rule["when"]):
        return False
    return not (rule["unless"] and condition_holds(rule["unless"], facts))


def on_call(schedule: dict, day: str, time: str) -> str:
    """Who is on call in ``schedule`` on ``day`` at ``time``, overrides included."""
    rotation = schedule["rotation"]
    shifts = rotation.get("Every day") or rotation["Sat-Sun" if day in WEEKEND else "Mon-Fri"]
    person = next(p for start, end, p in shifts if in_window(time, start, end))
    for override in schedule["overrides"]:
        if override["day"] == day and override["absent"] == person:
            return override["cover"]
    return person


def route(world: dict) -> str:
    """The destination of the world's ticket: a team name, or the name of the person on call."""
    facts = dict(world["request"])
    if "customer" in facts:
        facts.update({k: world["customers"][facts["customer"]][k] for k in CUSTOMER_FIELDS})
    for rule in sorted(world["rules"], key=lambda r: -r["priority"]):
        if rule_applies(rule, facts):
            target = rule["to"]
            break
    else:
        target = {"team": world["default_team"], "on_call": False}
    if not target["on_call"]:
        return target["team"]
    return on_call(world["schedules"][target["team"]], facts.get("day", "Mon"), facts["received"])


# -- text ----------------------------------------------------------------------------------------------------------

def condition_text(condition: dict) -> str:
    if condition["field"] == "received":
        return f"received from {condition['window'][0]} to {condition['window'][1]}"
    return f"{condition['field']} is {' or '.join(condition['values'])}"


def target_text(target: dict) -> str:
    return f"on-call of team {target['team']}" if target["on_call"] else f"team {target['team']}"


def rule_line(rule: dict) -> str:
    parts = [rule["id"], f"priority {rule['priority']}", "when " + " and ".join(map(condition_text, rule["when"]))]
    if rule["unless"]:
        parts.append("unless " + condition_text(rule["unless"]))
    parts.append("to " + target_text(rule["to"]))
    return " | ".join(parts)


# -- generator -----------------------------------------------------------------------------------------------------

def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    items = []
    for index in range(n):
        rng = random.Random(f"{FAMILY}:{seed}:{level}:{index}")
        world, question = _level_one(rng) if level == 1 else _higher_level(rng, level)
        items.append(Item(family=FAMILY, level=level, seed=seed, index=index, question=question,
                          answer=route(world), world=world))
    return items


def _ticket(rng: random.Random) -> tuple[str, str]:
    return f"T-{rng.randint(100000, 999999)}", rng.choice(COMPANIES)


def _level_one(rng: random.Random) -> tuple[dict, str]:
    ticket, company = _ticket(rng)
    request = {"id": ticket, "company": company,
               **{f: rng.choice(FIELD_VALUES[f]) for f in ("category", "region", "tier")}}
    fields = rng.sample(("category", "region", "tier"), 2 if rng.random() < 0.75 else 1)
    teams = rng.sample(TEAMS, len(fields) + 1)
    matches = [rng.random() < 0.5 for _ in fields]
    rules: list[dict[str, Any]] = []
    for rank, (field, team, match) in enumerate(zip(fields, teams, matches)):
        value = request[field] if match else rng.choice([v for v in FIELD_VALUES[field] if v != request[field]])
        rules.append({"id": f"R{rank + 1}", "priority": len(fields) - rank,
                      "when": [{"field": field, "values": [value]}], "unless": None,
                      "to": {"team": team, "on_call": False}})
    world = {"request": request, "rules": rules, "default_team": teams[-1], "schedules": {}, "customers": {}}
    lines = ["Support routing rules, from the highest priority down; the first rule that matches decides:"]
    lines += [f"{r['id']} (priority {r['priority']}): if {condition_text(r['when'][0])}, "
              f"route to team {r['to']['team']}" for r in rules]
    lines.append(f"If no rule matches, route to team {teams[-1]}.")
    lines.append(f"Ticket {ticket} from {company}: category {request['category']}, region {request['region']}, "
                 f"tier {request['tier']}.")
    lines.append(f"Which team handles ticket {ticket}?")
    return world, "\n".join(lines)


def _higher_level(rng: random.Random, level: int) -> tuple[dict, str]:
    ticket, company = _ticket(rng)
    facts = {f: rng.choice(FIELD_VALUES[f]) for f in ("category", "region", "tier", "severity", "channel", "language")}
    facts["day"] = rng.choice(FIELD_VALUES["day"])
    on_boundary = level >= 3 and rng.random() < 0.3
    facts["received"] = hhmm(rng.randrange(24) * 60 + (0 if on_boundary else rng.randrange(0, 60, 5)))

    count = rng.randint(*RULE_COUNT[level])
    priorities = sorted(rng.sample(range(10, 100, 5), count), reverse=True)
    winner = count if rng.random() < 0.15 else rng.randrange(count)  # rank of the deciding rule; count: default
    teams = rng.sample(TEAMS, count + 1)
    rules: list[dict[str, Any]] = []
    for rank, priority in enumerate(priorities):
        if rank < winner:
            mode = rng.choice(("miss", "excepted"))
        elif rank == winner:
            mode = "match"
        else:
            mode = rng.choice(("miss", "match"))
        when, unless = _conditions(rng, level, facts, mode)
        on_call_route = level >= 3 and rng.random() < (0.6 if rank == winner else 0.4)
        rules.append({"id": "", "priority": priority, "when": when, "unless": unless,
                      "to": {"team": teams[rank], "on_call": on_call_route}})
    rng.shuffle(rules)
    for number, rule in enumerate(rules, 1):
        rule["id"] = f"R{number}"

    schedules = {rule["to"]["team"]: _schedule(rng, level, facts) for rule in rules if rule["to"]["on_call"]}

    request = {"id": ticket, "company": company, "received": facts["received"]}
    request.update({f: facts[f] for f in ("category", "severity", "channel")})
    customers = {}
    if level == 4:
        customer = f"C-{rng.randint(1000, 9999)}"
        request.update(customer=customer, language=facts["language"], day=facts["day"])
        customers[customer] = {"customer": customer, "name": company, **{f: facts[f] for f in CUSTOMER_FIELDS}}
    else:
        request.update({f: facts[f] for f in CUSTOMER_FIELDS})
    world = {"request": request, "rules": rules, "default_team": teams[count], "schedules": schedules,
             "customers": customers}
    question = (f"Ticket {ticket} from {company} needs routing. Which team, or which on-call person, should "
                f"receive ticket {ticket}?")
    return world, question


def _conditions(rng: random.Random, level: int, facts: dict, mode: str) -> tuple[list[dict], dict | None]:
    """A rule's conditions: ``match`` applies to ``facts``, ``miss`` fails a condition, ``excepted`` matches but its
    ``unless`` holds."""
    fields = rng.sample(RULE_FIELDS[level], rng.randint(1, 2 if level == 2 else 3))
    failing = rng.choice(fields) if mode == "miss" else None
    when = [_condition(rng, field, facts, field != failing) for field in fields]
    unless = None
    spare = [f for f in RULE_FIELDS[level] if f not in fields and f != "received"]
    if mode == "excepted" or (mode != "miss" and rng.random() < 0.35) or (mode == "miss" and rng.random() < 0.2):
        unless = _condition(rng, rng.choice(spare), facts, mode == "excepted")
    return when, unless


def _condition(rng: random.Random, field: str, facts: dict, holds: bool) -> dict:
    if field == "received":
        hours = rng.randrange(4, 15)
        starts = [h for h in range(24)
                  if in_window(facts["received"], hhmm(h * 60), hhmm((h + hours) * 60)) == holds]
        start = rng.choice(starts) * 60
        return {"field": "received", "window": [hhmm(start), hhmm(start + hours * 60)]}
    others = [v for v in FIELD_VALUES[field] if v != facts[field]]
    if not holds:
        return {"field": field, "values": rng.sample(others, rng.choice((1, 2)))}
    values = [facts[field]] + (rng.sample(others, 1) if rng.random() < 0.4 else [])
    rng.shuffle(values)
    return {"field": field, "values": values}


def _schedule(rng: random.Random, level: int, facts: dict) -> dict:
    people = iter(rng.sample(PEOPLE, 12))
    if level == 3:
        rotation = {"Every day": _shifts(rng, facts, people)}
    else:
        rotation = {"Mon-Fri": _shifts(rng, facts, people), "Sat-Sun": _shifts(rng, facts, people)}
    schedule: dict[str, Any] = {"rotation": rotation, "overrides": []}
    if level == 4:
        if rng.random() < 0.5:  # the person on shift when the ticket arrives is away that day
            current = on_call(schedule, facts["day"], facts["received"])
            schedule["overrides"].append({"day": facts["day"], "absent": current, "cover": next(people)})
        other_days = [d for d in FIELD_VALUES["day"] if d != facts["day"]]
        names = sorted({p for shifts in rotation.values() for _, _, p in shifts})
        schedule["overrides"].append({"day": rng.choice(other_days), "absent": rng.choice(names),
                                      "cover": next(people)})
        rng.shuffle(schedule["overrides"])
    return schedule


def _shifts(rng: random.Random, facts: dict, people) -> list[list[str]]:
    """2-4 shifts covering the day; often one starts exactly when a whole-hour ticket arrives."""
    count = rng.randint(2, 4)
    received = minutes(facts["received"])
    if received % 60 == 0 and rng.random() < 0.7:
        hours = [received // 60] + rng.sample([h for h in range(24) if h != received // 60], count - 1)
    else:
        hours = rng.sample(range(24), count)
    starts = sorted(hours)
    return [[hhmm(start * 60), hhmm(starts[(k + 1) % count] * 60), next(people)] for k, start in enumerate(starts)]


def schedule_lines(team: str, schedule: dict) -> list[str]:
    lines = [f"On-call rotation of team {team}:"]
    for days, shifts in schedule["rotation"].items():
        lines += [f"{days} {start}-{end} {person}" for start, end, person in shifts]
    lines += [f"Override: on {o['day']} {o['cover']} covers all of {o['absent']}'s shifts"
              for o in schedule["overrides"]]
    return lines


# -- tools ---------------------------------------------------------------------------------------------------------

def _key(text: str, what: str) -> str:
    if len(text) > MAX_ID_CHARS:
        raise ValueError(f"{what} is too long ({len(text)} characters)")
    return text.strip()


def list_rules(world: dict) -> str:
    """List every routing rule with its id, priority, conditions, exception and destination, and the default team.

    The applicable rule with the highest priority decides. A rule applies when all its 'when' conditions hold and
    its 'unless' condition does not. 'received from A to B' covers A up to, not including, B (past midnight when B
    is not later than A).
    """
    lines = [rule_line(rule) for rule in world["rules"]]
    lines.append(f"default | to team {world['default_team']}")
    return "\n".join(lines)


def get_request(world: dict, ticket_id: str) -> dict:
    """Look up a support ticket's details.

    Args:
        ticket_id: the ticket id from the question, such as T-482913
    """
    key = _key(ticket_id, "ticket_id").upper()
    if key != world["request"]["id"]:
        raise KeyError(f"ticket {key}")
    return dict(world["request"])


def get_customer(world: dict, customer_id: str) -> dict:
    """Look up a customer's record: name, tier and region.

    Args:
        customer_id: the customer id from the ticket, such as C-1042
    """
    key = _key(customer_id, "customer_id").upper()
    return dict(world["customers"][key])


def get_oncall_schedule(world: dict, team: str) -> str:
    """Show a team's on-call rotation and its overrides.

    A shift A-B covers A up to, not including, B, and runs past midnight when B is not later than A. Use the
    rotation of the day the ticket was received; an override names who covers an absent person's shifts that day.

    Args:
        team: the team name, such as sre
    """
    key = _key(team, "team").lower().removeprefix("team ").strip()
    if key not in world["schedules"]:
        if key in TEAMS:
            raise KeyError(f"team {key} has no on-call rotation in this ticket's routing")
        raise KeyError(f"team {key}")
    return "\n".join(schedule_lines(key, world["schedules"][key]))


TOOLS = (list_rules, get_request, get_customer, get_oncall_schedule)
