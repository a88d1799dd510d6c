"""Reference rubric: the right final number, read the way the eval reads it, with small shaping bonuses."""

import re

import verifiers as vf

from aitrainsai import extract_answer


def _reply(completion) -> str:
    for message in reversed(completion):
        if getattr(message, "role", "") == "assistant" and getattr(message, "content", None):
            return str(message.content)
    return ""


def correct(completion, answer, **kwargs) -> float:
    given = extract_answer(_reply(completion), "last_number").replace(",", "")
    return float(given.strip() == str(answer).strip())


def close(completion, answer, **kwargs) -> float:
    """Partial credit for a nearby number: dense signal while exact answers are rare."""
    numbers = re.findall(r"-?\d+", _reply(completion).replace(",", ""))
    if not numbers:
        return 0.0
    error = abs(int(numbers[-1]) - int(answer))
    return max(0.0, 1.0 - error / max(10, abs(int(answer))))


def tagged(completion, **kwargs) -> float:
    return float("<answer>" in _reply(completion) and "</answer>" in _reply(completion))


def short(completion, **kwargs) -> float:
    return float(len(_reply(completion)) <= 160)


def build_rubric(parser):
    return vf.Rubric(funcs=[correct, close, tagged, short], weights=[1.0, 0.3, 0.2, 0.1], parser=parser)
