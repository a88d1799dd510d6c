"""Reference rubric: the right destination, read and compared as the eval does, plus credit for answering with one
of the teams the question's rules name (the untrained base answers with a person's name), and small format bonuses."""

import re

import verifiers as vf

from aitrainsai.families import extract_answer

TEAM = re.compile(r"route to team ([\w\-]+)")


def _reply(completion) -> str:
    for message in reversed(completion):
        if getattr(message, "role", "") == "assistant" and getattr(message, "content", None):
            return str(message.content)
    return ""


def _question(prompt) -> str:
    for message in reversed(prompt or []):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", "")
        if role == "user":
            return str(message.get("content") if isinstance(message, dict) else message.content)
    return ""


def _norm(text: str) -> str:
    text = " ".join(str(text).split()).strip("'\"`*. ").casefold()
    return re.sub(r"^(?:the )?team ", "", text)


def correct(completion, answer, **kwargs) -> float:
    return float(_norm(extract_answer(_reply(completion))) == _norm(answer))


def a_named_team(completion, prompt, **kwargs) -> float:
    """The answer is one of the teams the question's rules or default route to."""
    return float(_norm(extract_answer(_reply(completion))) in {t.casefold() for t in TEAM.findall(_question(prompt))})


def tagged(completion, **kwargs) -> float:
    return float("<answer>" in _reply(completion) and "</answer>" in _reply(completion))


def short(completion, **kwargs) -> float:
    return float(len(_reply(completion)) <= 80)


def build_rubric(parser):
    return vf.Rubric(funcs=[correct, a_named_team, tagged, short], weights=[1.0, 0.4, 0.2, 0.1], parser=parser)
