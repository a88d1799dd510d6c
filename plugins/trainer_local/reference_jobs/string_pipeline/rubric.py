"""Reference rubric: the right final string, read the way the eval reads it (letter case counts), with credit for a
near miss that is nearer than the input string itself (a job that paid any near miss taught the model to copy the
input), for replying in words rather than code (the untrained base writes Python), and a format bonus."""

import re
from difflib import SequenceMatcher

import verifiers as vf

from aitrainsai import extract_answer, last_text


def _norm(text: str) -> str:
    return " ".join(str(text).strip().strip("\"'").split())  # case and trailing dots count, as in the eval


def correct(completion, answer, **kwargs) -> float:
    return float(_norm(extract_answer(last_text(completion, "assistant"))) == _norm(answer))


SOURCE = re.compile(r"the string '([^']*)'")


def _similarity(a: str, b: str) -> float:
    return SequenceMatcher(None, a, b).ratio()


def nearer_than_the_input(completion, answer, prompt, **kwargs) -> float:
    """How much closer the final answer is to the right string than the untransformed input is (0 for a copy of
    the input or anything farther, 1 for the right string): dense signal before the answer is exact."""
    target = _norm(answer)
    found = SOURCE.search(last_text(prompt, "user"))
    start = _similarity(found.group(1), target) if found else 0.0
    if start >= 1.0:
        return 0.0
    given = _norm(extract_answer(last_text(completion, "assistant")))
    return max(0.0, _similarity(given, target) - start) / (1.0 - start)


def no_code(completion, **kwargs) -> float:
    reply = last_text(completion, "assistant")
    return float("```" not in reply and "python" not in reply.lower() and "def " not in reply)


def tagged(completion, **kwargs) -> float:
    reply = last_text(completion, "assistant")
    return float("<answer>" in reply and "</answer>" in reply)


def build_rubric(parser):
    return vf.Rubric(funcs=[correct, nearer_than_the_input, no_code, tagged], weights=[1.0, 0.5, 0.2, 0.2],
                     parser=parser)
