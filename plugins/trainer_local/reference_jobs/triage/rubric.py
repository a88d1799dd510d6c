"""Reference rubric: the eval's own scoring rule (1.0 the root service and its action, 0.5 the root service alone),
read from the answer as the eval reads it, plus credit for naming one alerting service of the question and small
format bonuses: signal while the root cause is still rarely named."""

import re

import verifiers as vf

from aitrainsai import extract_answer, last_text
from aitrainsai_family_triage.world import parse_reply

ALERT = re.compile(r"^- (\S+) \(", re.MULTILINE)


def _named(completion) -> tuple[set[str], set[str]]:
    """The services and the actions the final answer names, read by the family's public parser as the eval reads
    them."""
    return parse_reply(extract_answer(last_text(completion, "assistant")))


def triaged(completion, answer, **kwargs) -> float:
    services, actions = _named(completion)
    root, action = str(answer).split()
    if services != {root}:
        return 0.0
    return 1.0 if actions == {action} else 0.5


def one_alerting_service(completion, prompt, **kwargs) -> float:
    """The answer names exactly one service, and it is one of the question's alerts."""
    services, _ = _named(completion)
    return float(len(services) == 1 and services <= set(ALERT.findall(last_text(prompt, "user"))))


def one_action(completion, **kwargs) -> float:
    return float(len(_named(completion)[1]) == 1)


def tagged(completion, **kwargs) -> float:
    reply = last_text(completion, "assistant")
    return float("<answer>" in reply and "</answer>" in reply)


def build_rubric(parser):
    return vf.Rubric(funcs=[triaged, one_alerting_service, one_action, tagged], weights=[1.0, 0.3, 0.1, 0.1],
                     parser=parser)
