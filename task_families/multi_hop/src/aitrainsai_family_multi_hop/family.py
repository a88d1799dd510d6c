"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import json
import re

from aitrainsai import Item, TaskFamily, ToolSession
from aitrainsai_family_multi_hop import world

_RELATION_PREFIX = re.compile(
    r"the (" + "|".join(re.escape(word) for word in world.RELATION_WORDS.values()) + r") of ")
_RELATION_BY_WORD = {word: relation for relation, word in world.RELATION_WORDS.items()}
_QUESTION_PATTERNS = {
    attribute: re.compile(re.escape(template).replace(re.escape("{who}"), "(?P<who>.+)") + "$")
    for attribute, template in world.QUESTION_TEMPLATES.items()
}
_DESCRIPTION_PATTERNS = {
    attribute: re.compile("^" + re.escape(clause).replace(re.escape("{value}"), "(?P<value>.+)") + "$")
    for attribute, clause in world.DESCRIPTION_CLAUSES.items()
}


class MultiHopFamily(TaskFamily):
    """Follow a chain of relations through a staff directory and report one attribute of the person it ends at.

    Scoring is exact match on the attribute value after a canonical form: case, surrounding whitespace and quotes,
    and a final period are ignored ("oslo." equals "Oslo"). No partial credit.
    """

    name = world.FAMILY
    description = "Multi-hop lookups in a generated staff directory: follow 1-4 relations, then read an attribute."
    levels = tuple(world.LEVELS)
    default_level = 1
    eval_seed = 194036211
    turn_limit = 10
    goal = (
        "Teach the model to answer multi-hop questions about people in a company directory. A question names a start "
        "person and a chain of relations, e.g. 'the mentor of the manager of Ana Kovac' (start at Ana Kovac, take "
        "their manager, then that person's mentor), and asks for one attribute (city, team, favourite programming "
        "language, pet, hobby) of the person the chain ends at. The model must resolve the chain from the inside out "
        "and report the attribute of the LAST person, not of the start or of someone in between. Level 1 states "
        "every fact needed in the question (1-2 hops, with distractors: the same attribute of the others on the "
        "chain and an unrelated relation); levels 2-3 give 2-4 hops whose facts are only reachable with the tools "
        "get_relation and get_attribute, in larger directories; level 4 names "
        "the start person only by two attributes, so the model must first find them with find_people. The answer is "
        "the attribute value alone, e.g. <answer>Oslo</answer>."
    )
    system_prompt = (
        "You answer questions about people in a company directory. A phrase like \"the mentor of the manager of Ana "
        "Kovac\" means: start at Ana Kovac, find their manager, then find that person's mentor. Resolve the chain one "
        "step at a time, starting from the named person. If the question lists facts, use them; otherwise look the "
        "facts up with the tools: get_relation(person, relation) gives the related person, get_attribute(person, "
        "attribute) gives an attribute, and find_people(attribute, value) lists people with that value. Reply with "
        "the attribute of the last person in the chain only, and end your reply with <answer>VALUE</answer>, for "
        "example <answer>Oslo</answer>."
    )
    answer_format = (
        "End your final reply with <answer>VALUE</answer>: the attribute value as the directory spells it, e.g. "
        "<answer>Oslo</answer>. Case, surrounding spaces or quotes and a final period are ignored."
    )
    answer_fallback = "last_line"
    public_modules = ("aitrainsai_family_multi_hop", "aitrainsai_family_multi_hop.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def normalise_answer(self, answer: str) -> str:
        text = " ".join(str(answer).split()).strip("\"'`").strip()
        return text.removesuffix(".").strip().casefold()

    def solve(self, item: Item, session: ToolSession) -> str:
        if "\nQuestion: " in item.question:
            ask = item.question.rsplit("\nQuestion: ", 1)[1]
        else:
            ask = item.question.split(": ", 1)[1]
        attribute, who = next((attribute, match.group("who")) for attribute, pattern in _QUESTION_PATTERNS.items()
                              if (match := pattern.match(ask)))
        relations = []
        while match := _RELATION_PREFIX.match(who):
            relations.append(_RELATION_BY_WORD[match.group(1)])
            who = who[match.end():]
        person = self._start(who, session)
        for relation in reversed(relations):
            person = session.call("get_relation", person=person, relation=relation)
        return session.call("get_attribute", person=person, attribute=attribute)

    def _start(self, phrase: str, session: ToolSession) -> str:
        """The start person: a name, or 'the person <clause> and <clause>' resolved with find_people."""
        if not phrase.startswith("the person "):
            return phrase
        candidates: set[str] | None = None
        for clause in phrase.removeprefix("the person ").split(" and "):
            attribute, value = next((attribute, match.group("value")) for attribute, pattern in
                                    _DESCRIPTION_PATTERNS.items() if (match := pattern.match(clause)))
            found = set(json.loads(session.call("find_people", attribute=attribute, value=value)))
            candidates = found if candidates is None else candidates & found
        assert candidates is not None  # a description has at least one clause
        (person,) = candidates
        return person
