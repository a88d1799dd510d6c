"""Reference rubric, verifiers v1: the classic job's rewards (../rubric.py), term for term and weight for weight, as
@vf.reward methods of the task reading its trace. The right destination, read and compared as the eval does, plus
credit for answering with one of the teams the question's rules name (the untrained base answers with a person's
name), and small format bonuses."""

import re

import verifiers.v1 as vf

from aitrainsai import extract_answer, last_text
from aitrainsai_family_dispatch.world import normalise_destination

TEAM = re.compile(r"route to team ([\w\-]+)")


def _reply(trace) -> str:
    return last_text(trace.assistant_messages, "assistant")


def _question(data) -> str:
    return data.prompt if isinstance(data.prompt, str) else last_text(data.prompt, "user")


def _answer(trace) -> str:
    return normalise_destination(extract_answer(_reply(trace)))


class Rubric:
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(_answer(trace) == normalise_destination(self.data.answer))

    @vf.reward(weight=0.4)
    async def a_named_team(self, trace: vf.Trace) -> float:
        """The answer is one of the teams the question's rules or default route to."""
        teams = {team.casefold() for team in TEAM.findall(_question(self.data))}
        return float(_answer(trace) in teams)

    @vf.reward(weight=0.2)
    async def tagged(self, trace: vf.Trace) -> float:
        reply = _reply(trace)
        return float("<answer>" in reply and "</answer>" in reply)

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(_reply(trace)) <= 80)
