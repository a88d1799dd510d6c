"""Reference rubric, verifiers v1: the classic job's rewards (../rubric.py), term for term and weight for weight, as
@vf.reward methods of the task reading its trace. The right final string, read the way the eval reads it (letter case
counts), with credit for a near miss that is nearer than the input string itself (a job that paid any near miss taught
the model to copy the input), for replying in words rather than code (the untrained base writes Python), and a format
bonus."""

import re
from difflib import SequenceMatcher

import verifiers.v1 as vf

from aitrainsai import extract_answer, last_text

SOURCE = re.compile(r"the string '([^']*)'")


def _norm(text: str) -> str:
    return " ".join(str(text).strip().strip("\"'").split())  # case and trailing dots count, as in the eval


def _reply(trace) -> str:
    return last_text(trace.assistant_messages, "assistant")


def _question(data) -> str:
    return data.prompt if isinstance(data.prompt, str) else last_text(data.prompt, "user")


def _similarity(a: str, b: str) -> float:
    return SequenceMatcher(None, a, b).ratio()


class Rubric:
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(_norm(extract_answer(_reply(trace))) == _norm(self.data.answer))

    @vf.reward(weight=0.5)
    async def nearer_than_the_input(self, trace: vf.Trace) -> float:
        """How much closer the final answer is to the right string than the untransformed input is (0 for a copy of
        the input or anything farther, 1 for the right string): dense signal before the answer is exact."""
        target = _norm(self.data.answer)
        found = SOURCE.search(_question(self.data))
        start = _similarity(found.group(1), target) if found else 0.0
        if start >= 1.0:
            return 0.0
        given = _norm(extract_answer(_reply(trace)))
        return max(0.0, _similarity(given, target) - start) / (1.0 - start)

    @vf.reward(weight=0.2)
    async def no_code(self, trace: vf.Trace) -> float:
        reply = _reply(trace)
        return float("```" not in reply and "python" not in reply.lower() and "def " not in reply)

    @vf.reward(weight=0.2)
    async def tagged(self, trace: vf.Trace) -> float:
        reply = _reply(trace)
        return float("<answer>" in reply and "</answer>" in reply)
