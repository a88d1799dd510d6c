"""Reference rubric, verifiers v1: the classic job's rewards (../rubric.py), term for term and weight for weight, as
@vf.reward methods of the task reading its trace. The right final number, read the way the eval reads it, with small
shaping bonuses."""

import re

import verifiers.v1 as vf

from aitrainsai import extract_answer


def _reply(trace) -> str:
    """The last model reply that has text, as the classic job reads its completion (a final tool call has none)."""
    for message in reversed(trace.assistant_messages):
        if message.content:
            return str(message.content)
    return ""


class Rubric:
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        given = extract_answer(_reply(trace), "last_number").replace(",", "")
        return float(given.strip() == str(self.data.answer).strip())

    @vf.reward(weight=0.3)
    async def close(self, trace: vf.Trace) -> float:
        """Partial credit for a nearby number: dense signal while exact answers are rare."""
        numbers = re.findall(r"-?\d+", _reply(trace).replace(",", ""))
        if not numbers:
            return 0.0
        error = abs(int(numbers[-1]) - int(self.data.answer))
        return max(0.0, 1.0 - error / max(10, abs(int(self.data.answer))))

    @vf.reward(weight=0.2)
    async def tagged(self, trace: vf.Trace) -> float:
        return float("<answer>" in _reply(trace) and "</answer>" in _reply(trace))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(_reply(trace)) <= 160)
