"""Reference rubric, verifiers v1: the classic job's rewards (../rubric.py), term for term and weight for weight, as
@vf.reward methods of the task reading its trace. The right final answer, read the way the eval reads it, with small
shaping bonuses."""

import verifiers.v1 as vf

from aitrainsai import extract_answer


def _reply(trace) -> str:
    """The last model reply that has text, as the classic job reads its completion (a final tool call has none)."""
    for message in reversed(trace.assistant_messages):
        if message.content:
            return str(message.content)
    return ""


def _norm(text: str) -> str:
    return " ".join(str(text).strip().strip("\"'").rstrip(".").split()).casefold()


class Rubric:
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(_norm(extract_answer(_reply(trace))) == _norm(self.data.answer))

    @vf.reward(weight=0.3)
    async def mentions(self, trace: vf.Trace) -> float:
        """Partial credit for naming the answer anywhere: signal before the format is learned."""
        return float(_norm(self.data.answer) in _norm(_reply(trace)))

    @vf.reward(weight=0.2)
    async def tagged(self, trace: vf.Trace) -> float:
        return float("<answer>" in _reply(trace) and "</answer>" in _reply(trace))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(_reply(trace)) <= 160)
