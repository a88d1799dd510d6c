"""Reference rubric: the right final answer, read the way the eval reads it, with small shaping bonuses."""

import verifiers as vf

from aitrainsai import extract_answer


def _reply(completion) -> str:
    for message in reversed(completion):
        if getattr(message, "role", "") == "assistant" and getattr(message, "content", None):
            return str(message.content)
    return ""


def _norm(text: str) -> str:
    return " ".join(str(text).strip().strip("\"'").rstrip(".").split()).casefold()


def correct(completion, answer, **kwargs) -> float:
    return float(_norm(extract_answer(_reply(completion))) == _norm(answer))


def mentions(completion, answer, **kwargs) -> float:
    """Partial credit for naming the answer anywhere: signal before the format is learned."""
    return float(_norm(answer) in _norm(_reply(completion)))


def tagged(completion, **kwargs) -> float:
    return float("<answer>" in _reply(completion) and "</answer>" in _reply(completion))


def short(completion, **kwargs) -> float:
    return float(len(_reply(completion)) <= 160)


def build_rubric(parser):
    return vf.Rubric(funcs=[correct, mentions, tagged, short], weights=[1.0, 0.3, 0.2, 0.1], parser=parser)
