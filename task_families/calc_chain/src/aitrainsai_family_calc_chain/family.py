"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import re

from aitrainsai import Item, TaskFamily, ToolSession
from aitrainsai_family_calc_chain import world

OPERAND = r"(\d+|the number of (\w+) in crate ([A-Z]))"
START = re.compile(r"starts at " + OPERAND)
STEP = re.compile(r"(adds|subtracts|multiplies by|divides by|takes the remainder after dividing by) " + OPERAND)
TOOL_OF_VERB = {
    "adds": "add",
    "subtracts": "subtract",
    "multiplies by": "multiply",
    "divides by": "divide",
    "takes the remainder after dividing by": "remainder",
}


class CalcChainFamily(TaskFamily):
    """Chained integer arithmetic: apply each operation of the question in order to the starting number.

    Scoring is exact: the final integer must equal the item's answer (numbers compare as numbers, so "1,234" counts
    as 1234). Without an ``<answer>`` tag, the last number in the reply is taken.
    """

    name = world.FAMILY
    description = "Chained integer arithmetic with arithmetic tools and crate-count lookups."
    levels = tuple(world.LEVELS)
    default_level = 1
    eval_seed = 329356511
    turn_limit = 12
    answer_fallback = "last_number"
    goal = (
        "Teach the model to carry out a chain of integer operations exactly. Each question names a starting number "
        "and a list of operations (adds, subtracts, multiplies by, divides by with rounding down, takes the "
        "remainder after dividing by) to apply in the order given; the answer is the final integer. Level 1: one or "
        "two operations on small numbers, every number in the question, solvable in one reply. Level 2: three "
        "operations, one operand is a fruit count that only the count_fruit tool reveals. Level 3: four or five "
        "operations with numbers in the hundreds, division and remainders, two counts to look up. Level 4: six or "
        "seven operations, three or four counts to look up (the start may be one). The model should call "
        "count_fruit for every 'the number of X in crate Y', use the arithmetic tools for each step it is not sure "
        "of, and end with <answer>N</answer>."
    )
    system_prompt = (
        "You solve arithmetic chains. Start from the starting number and apply each operation in the order the "
        "question gives it; 'divides by' rounds down to a whole number. Use the tools: add, subtract, multiply, "
        "divide and remainder do the arithmetic exactly, and count_fruit tells you 'the number of <fruit> in crate "
        "<letter>'. When you have the final number, end your reply with <answer>NUMBER</answer>, for example "
        "<answer>42</answer>."
    )
    answer_format = ("End your final reply with <answer>NUMBER</answer>: the final integer, digits only, "
                     "e.g. <answer>42</answer>.")
    public_modules = ("aitrainsai_family_calc_chain", "aitrainsai_family_calc_chain.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def solve(self, item: Item, session: ToolSession) -> str:
        text = item.question.split(". What number", 1)[0]
        start = START.search(text)
        assert start is not None, "the question states its starting number"
        value = self._operand(session, start.group(1), start.group(2), start.group(3))
        for match in STEP.finditer(text, start.end()):
            operand = self._operand(session, match.group(2), match.group(3), match.group(4))
            value = int(session.call(TOOL_OF_VERB[match.group(1)], a=value, b=operand))
        return str(value)

    @staticmethod
    def _operand(session: ToolSession, literal: str, fruit: str | None, crate: str | None) -> int:
        if fruit is None:
            return int(literal)
        return int(session.call("count_fruit", crate=crate, fruit=fruit))
