"""Public: the seeded generator and the tools. An agent's job may import this module.

A world is a small company directory: people with made-up names, each with relations to other people (manager,
mentor, sibling, best friend) and attributes (city, team, favourite language, pet, hobby). A question names a start
person and a chain of relations, and asks for one attribute of the person the chain ends at.
"""

from __future__ import annotations

import random
from typing import Literal

from aitrainsai import Item

FAMILY = "multi_hop"

Relation = Literal["manager", "mentor", "sibling", "best_friend"]
Attribute = Literal["city", "team", "language", "pet", "hobby"]
RELATIONS: tuple[str, ...] = ("manager", "mentor", "sibling", "best_friend")
ATTRIBUTES: tuple[str, ...] = ("city", "team", "language", "pet", "hobby")


class Level:
    """How one difficulty level is generated."""

    def __init__(self, people: int, hops: tuple[int, ...], facts_in_question: bool, described_start: bool):
        self.people = people
        self.hops = hops
        self.facts_in_question = facts_in_question
        self.described_start = described_start


LEVELS: dict[int, Level] = {
    1: Level(people=6, hops=(1, 2), facts_in_question=True, described_start=False),
    2: Level(people=12, hops=(2, 3), facts_in_question=False, described_start=False),
    3: Level(people=20, hops=(3, 4), facts_in_question=False, described_start=False),
    4: Level(people=30, hops=(4,), facts_in_question=False, described_start=True),
}

FIRST_NAMES = (
    "Ana", "Bram", "Cira", "Dov", "Elin", "Fenna", "Goran", "Hessa", "Ilko", "Jora", "Kael", "Liora", "Mato", "Nadia",
    "Orin", "Pela", "Quill", "Rasa", "Soren", "Tamsin", "Ulla", "Vero", "Wim", "Xara", "Yanis", "Zofi", "Arvo",
    "Bettan", "Caius", "Dalia", "Emrys", "Faro", "Gwen", "Halvar", "Iska", "Jesper", "Kiri", "Lumi", "Mirel", "Nilo",
)
LAST_NAMES = (
    "Kovac", "Tello", "Voss", "Osei", "Marlow", "Quint", "Hadley", "Brisk", "Calder", "Dunmore", "Esk", "Farrow",
    "Galen", "Holm", "Ivers", "Jurado", "Kestrel", "Lind", "Morrow", "Nakai", "Orsolo", "Pryce", "Rook", "Sallow",
    "Thorne", "Umber", "Vantor", "Wexley", "Yarrow", "Zeller", "Aldous", "Brenn", "Corvo", "Dray", "Ember", "Fisk",
    "Gault", "Harrow", "Iveson", "Jessop",
)
ORG_FIRST = ("North", "Bright", "Silver", "Cedar", "Iron", "Blue", "Stone", "Red", "Glen", "Amber", "Frost", "Oak",
             "Sun", "Rain", "Wind", "Lake", "High", "Deep", "Star", "Moss")
ORG_SECOND = ("vale", "water", "field", "ridge", "brook", "haven", "crest", "mont", "wood", "gate", "ford", "hollow",
              "point", "shore", "stead", "wick", "fall", "marsh", "cliff", "moor")
ORG_KIND = ("Labs", "Works", "Systems", "Studio", "Logistics", "Robotics", "Analytics", "Foundry", "Collective",
            "Partners")

VALUES: dict[str, tuple[str, ...]] = {
    "city": ("Oslo", "Lima", "Porto", "Quito", "Hanoi", "Tunis", "Dakar", "Riga", "Perth", "Cusco", "Bergen", "Nagoya"),
    "team": ("Falcon", "Harbor", "Granite", "Willow", "Comet", "Orchid", "Summit", "Lantern", "Pioneer", "Ember"),
    "language": ("Python", "Rust", "Go", "Haskell", "Kotlin", "Ruby", "Elixir", "Swift", "Scala", "OCaml", "Julia",
                 "Zig"),
    "pet": ("cat", "parrot", "tortoise", "rabbit", "ferret", "goldfish", "hamster", "iguana", "dog", "axolotl"),
    "hobby": ("chess", "pottery", "climbing", "birdwatching", "fencing", "origami", "rowing", "juggling", "sailing",
              "knitting"),
}

RELATION_WORDS = {"manager": "manager", "mentor": "mentor", "sibling": "sibling", "best_friend": "best friend"}
QUESTION_TEMPLATES = {
    "city": "In which city does {who} live?",
    "team": "Which team is {who} on?",
    "language": "What is the favourite programming language of {who}?",
    "pet": "What kind of pet does {who} keep?",
    "hobby": "What is the hobby of {who}?",
}
ATTRIBUTE_FACTS = {
    "city": "{person} lives in {value}.",
    "team": "{person} is on the {value} team.",
    "language": "{person}'s favourite programming language is {value}.",
    "pet": "{person} keeps a pet {value}.",
    "hobby": "{person}'s hobby is {value}.",
}
# Clauses that pick out a start person at level 4: "the person who lives in Oslo and whose hobby is chess".
DESCRIPTION_CLAUSES = {
    "city": "who lives in {value}",
    "team": "who is on the {value} team",
    "language": "whose favourite programming language is {value}",
    "pet": "who keeps a pet {value}",
    "hobby": "whose hobby is {value}",
}
MAX_NAME_CHARS = 80
MAX_MATCHES = 40


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    if level not in LEVELS:
        raise ValueError(f"level {level} is not one of {tuple(LEVELS)}")
    return [_item(random.Random(f"{FAMILY}:{seed}:{level}:{index}"), seed, level, index) for index in range(n)]


def _item(rng: random.Random, seed: int, level: int, index: int) -> Item:
    spec = LEVELS[level]
    while True:
        world = _population(rng, spec.people)
        hops = rng.choice(spec.hops)
        chain = _walk(rng, world, hops)
        if chain is None:
            continue
        start, relations, path = chain
        attribute = rng.choice(ATTRIBUTES)
        if spec.described_start:
            description = _describe(rng, world, start)
            if description is None:
                continue
            start_phrase = description
        else:
            start_phrase = start
        break
    answer = world["people"][path[-1]]["attributes"][attribute]
    who = start_phrase
    for relation in relations:
        who = f"the {RELATION_WORDS[relation]} of {who}"
    ask = QUESTION_TEMPLATES[attribute].format(who=who)
    if spec.facts_in_question:
        facts = _facts(rng, world, path, relations, attribute)
        question = "Facts: " + " ".join(facts) + "\nQuestion: " + ask
    else:
        question = f"In the staff directory of {world['organisation']}: {ask}"
    return Item(family=FAMILY, level=level, seed=seed, index=index, question=question, answer=answer, world=world)


def _population(rng: random.Random, size: int) -> dict:
    picks = rng.sample(range(len(FIRST_NAMES) * len(LAST_NAMES)), size)
    names = [f"{FIRST_NAMES[k // len(LAST_NAMES)]} {LAST_NAMES[k % len(LAST_NAMES)]}" for k in picks]
    people: dict[str, dict] = {name: {"relations": {}, "attributes": {}} for name in names}
    for name in names:
        for attribute in ATTRIBUTES:
            people[name]["attributes"][attribute] = rng.choice(VALUES[attribute])
    # Managers form a hierarchy: the first person in this order heads the organisation.
    order = names[:]
    rng.shuffle(order)
    for rank, name in enumerate(order[1:], 1):
        people[name]["relations"]["manager"] = order[rng.randrange(max(0, rank - 4), rank)]
    for name in names:
        others = [other for other in names if other != name]
        people[name]["relations"]["mentor"] = rng.choice(others)
        people[name]["relations"]["best_friend"] = rng.choice(others)
    # Siblings come in pairs; some people have none.
    pool = names[:]
    rng.shuffle(pool)
    for a, b in zip(pool[0:len(pool) // 3 * 2:2], pool[1:len(pool) // 3 * 2:2]):
        people[a]["relations"]["sibling"] = b
        people[b]["relations"]["sibling"] = a
    organisation = f"{rng.choice(ORG_FIRST)}{rng.choice(ORG_SECOND)} {rng.choice(ORG_KIND)}"
    return {"organisation": organisation, "people": people}


def _walk(rng: random.Random, world: dict, hops: int) -> tuple[str, list[str], list[str]] | None:
    """A chain of ``hops`` relations that never revisits a person: (start, relations, people visited)."""
    people = world["people"]
    for _ in range(20):
        start = rng.choice(sorted(people))
        path: list[str] = [start]
        relations: list[str] = []
        while len(relations) < hops:
            options = [r for r in RELATIONS if people[path[-1]]["relations"].get(r) not in (None, *path)]
            if not options:
                break
            relation = rng.choice(options)
            relations.append(relation)
            path.append(people[path[-1]]["relations"][relation])
        if len(relations) == hops:
            return start, relations, path
    return None


def _describe(rng: random.Random, world: dict, person: str) -> str | None:
    """'the person who ... and ...': two attributes that only ``person`` has together, or None."""
    people = world["people"]
    pairs = [(a, b) for i, a in enumerate(ATTRIBUTES) for b in ATTRIBUTES[i + 1:]]
    rng.shuffle(pairs)
    mine = people[person]["attributes"]
    for a, b in pairs:
        matches = [p for p in people if people[p]["attributes"][a] == mine[a] and people[p]["attributes"][b] == mine[b]]
        if matches == [person]:
            clauses = [DESCRIPTION_CLAUSES[x].format(value=mine[x]) for x in (a, b)]
            return f"the person {clauses[0]} and {clauses[1]}"
    return None


def _facts(rng: random.Random, world: dict, path: list[str], relations: list[str], attribute: str) -> list[str]:
    """The facts a level-1 question states: the chain, the answer, and distractors about the same attribute."""
    people = world["people"]
    facts = [f"{a}'s {RELATION_WORDS[r]} is {b}." for a, r, b in zip(path, relations, path[1:])]
    facts += [ATTRIBUTE_FACTS[attribute].format(person=p, value=people[p]["attributes"][attribute]) for p in path]
    outsider = rng.choice([p for p in sorted(people) if p not in path])
    relation = rng.choice([r for r in RELATIONS if r in people[outsider]["relations"]])
    facts.append(f"{outsider}'s {RELATION_WORDS[relation]} is {people[outsider]['relations'][relation]}.")
    rng.shuffle(facts)
    return facts


def _person(world: dict, name: str) -> str:
    """The directory's spelling of ``name`` (case and spacing ignored); KeyError if nobody has it."""
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a name has at most {MAX_NAME_CHARS} characters")
    wanted = " ".join(name.split()).casefold()
    for person in world["people"]:
        if person.casefold() == wanted:
            return person
    raise KeyError(f"nobody named {name!r} in the directory")


def get_relation(world: dict, person: str, relation: Relation) -> str:
    """Look up who is related to a person: their manager, mentor, sibling or best friend.

    Args:
        person: the person's full name, such as "Ana Kovac"
        relation: which relation to follow: manager, mentor, sibling or best_friend
    """
    name = _person(world, person)
    other = world["people"][name]["relations"].get(relation)
    if other is None:
        raise ValueError(f"{name} has no {RELATION_WORDS[relation]} in the directory")
    return other


def get_attribute(world: dict, person: str, attribute: Attribute) -> str:
    """Look up one attribute of a person: city, team, language (favourite programming language), pet or hobby.

    Args:
        person: the person's full name, such as "Ana Kovac"
        attribute: which attribute to read: city, team, language, pet or hobby
    """
    return world["people"][_person(world, person)]["attributes"][attribute]


def find_people(world: dict, attribute: Attribute, value: str) -> list[str]:
    """List everyone whose attribute has the given value, such as everyone whose city is Oslo.

    Args:
        attribute: which attribute to match: city, team, language, pet or hobby
        value: the value to match, such as "Oslo" (case is ignored)
    """
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"a value has at most {MAX_NAME_CHARS} characters")
    wanted = " ".join(value.split()).casefold()
    matches = sorted(p for p, data in world["people"].items() if data["attributes"][attribute].casefold() == wanted)
    return matches[:MAX_MATCHES]


TOOLS = (get_relation, get_attribute, find_people)
