"""Private: the tally families' hidden eval, scorer and reference solver, and the plugin that registers them."""

from __future__ import annotations

import re

from aitrainsai.families import Item, TaskFamily, ToolSession
from aitrainsai.hookspecs import hookimpl
from aitrainsai.testing.tally import held_out, world

LABEL = re.compile(r"[a-z]+-\d+")


class Tally(TaskFamily):
    """Sum a few bins' counts, each read with the ``count`` tool: every part of the family contract, in
    milliseconds."""

    name = world.FAMILY
    description = "A fake family for tests: add up bins whose counts only a tool reads."
    levels = world.LEVELS
    eval_size = 40
    eval_seed = 4721
    turn_limit = 6
    goal = ("Teach the model to add up bins: call count for every bin the question names, then answer with the "
            "total in <answer>N</answer>.")
    system_prompt = ("You add up bins. The count tool says how many things a bin holds; call it for every bin the "
                     "question names, then end your reply with <answer>TOTAL</answer>.")
    answer_format = "End your final reply with <answer>TOTAL</answer>: the sum, digits only."
    public_modules = ("aitrainsai.testing.tally", "aitrainsai.testing.tally.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.items(self.name, seed, level, n)

    def solve(self, item: Item, session: ToolSession) -> str:
        asked = LABEL.findall(item.question.split(":", 1)[0])
        return str(sum(int(session.call("count", label=label)) for label in asked))


class TallyHeldOut(Tally):
    """Tally under another name, held out: what a run evaluates and never trains on."""

    name = held_out.FAMILY
    description = "A fake held-out family for tests: tally under another name."
    held_out = True
    eval_seed = 5903
    public_modules = ("aitrainsai.testing.tally.held_out", "aitrainsai.testing.tally.world")


class FakeFamiliesPlugin:
    """A plugin that registers the tally families: ``plugins.add(FAKE_FAMILIES, ...)`` in a test."""

    __name__ = "fake_families"

    @hookimpl
    def register_task_families(self, register):
        register(Tally)
        register(TallyHeldOut)


FAKE_FAMILIES = FakeFamiliesPlugin()
