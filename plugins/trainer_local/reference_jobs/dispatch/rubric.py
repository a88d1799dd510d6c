"""Reference rubric: the right destination, read and compared as the eval does, plus credit for answering with one
of the teams the question's rules name (the untrained base answers with a person's name), and small format bonuses."""

import re

import verifiers as vf

from aitrainsai import extract_answer, last_text
from aitrainsai_family_dispatch.world import normalise_destination

TEAM = re.compile(r"route to team ([\w\-]+)")


def _answer(completion) -> str:
    return normalise_destination(extract_answer(last_text(completion, "assistant")))


def correct(completion, answer, **kwargs) -> float:
    return float(_answer(completion) == normalise_destination(answer))


def a_named_team(completion, prompt, **kwargs) -> float:
    """The answer is one of the teams the question's rules or default route to."""
    teams = {team.casefold() for team in TEAM.findall(last_text(prompt, "user"))}
    return float(_answer(completion) in teams)


def tagged(completion, **kwargs) -> float:
    reply = last_text(completion, "assistant")
    return float("<answer>" in reply and "</answer>" in reply)


def short(completion, **kwargs) -> float:
    return float(len(last_text(completion, "assistant")) <= 80)


def build_rubric(parser):
    return vf.Rubric(funcs=[correct, a_named_team, tagged, short], weights=[1.0, 0.4, 0.2, 0.1], parser=parser)
