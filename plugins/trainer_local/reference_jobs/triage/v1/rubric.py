"""Reference rubric, verifiers v1: the classic job's rewards (../rubric.py), term for term and weight for weight, as
@vf.reward methods of the task reading its trace. The eval's own scoring rule (1.0 the root service and its action,
0.5 the root service alone), read from the answer as the eval reads it, plus credit for naming one alerting service of
the question and small format bonuses: signal while the root cause is still rarely named."""

import re

import verifiers.v1 as vf

from aitrainsai import extract_answer, last_text
from aitrainsai_family_triage.world import parse_reply

ALERT = re.compile(r"^- (\S+) \(", re.MULTILINE)


def _reply(trace) -> str:
    return last_text(trace.assistant_messages, "assistant")


def _question(data) -> str:
    return data.prompt if isinstance(data.prompt, str) else last_text(data.prompt, "user")


def _named(trace) -> tuple[set[str], set[str]]:
    """The services and the actions the final answer names, read by the family's public parser as the eval reads
    them."""
    return parse_reply(extract_answer(_reply(trace)))


class Rubric:
    @vf.reward(weight=1.0)
    async def triaged(self, trace: vf.Trace) -> float:
        services, actions = _named(trace)
        root, action = str(self.data.answer).split()
        if services != {root}:
            return 0.0
        return 1.0 if actions == {action} else 0.5

    @vf.reward(weight=0.3)
    async def one_alerting_service(self, trace: vf.Trace) -> float:
        """The answer names exactly one service, and it is one of the question's alerts."""
        services, _ = _named(trace)
        return float(len(services) == 1 and services <= set(ALERT.findall(_question(self.data))))

    @vf.reward(weight=0.1)
    async def one_action(self, trace: vf.Trace) -> float:
        return float(len(_named(trace)[1]) == 1)

    @vf.reward(weight=0.1)
    async def tagged(self, trace: vf.Trace) -> float:
        reply = _reply(trace)
        return float("<answer>" in reply and "</answer>" in reply)
