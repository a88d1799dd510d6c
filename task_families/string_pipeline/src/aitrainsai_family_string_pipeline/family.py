"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import re
from aitrainsai import Item, TaskFamily, ToolSession
from aitrainsai_family_string_pipeline import world

QUESTION = re.compile(r"Take (?:the string '(?P<string>[^']*)'|the note labelled '(?P<note>[^']*)') and "
                      r"(?:apply these steps in order: (?P<steps>.*)|(?P<step>.*))\. What is the result\?", re.S)
SETTING = r"(?:, where k is the setting '(\w+)')?"
SLICE = re.compile(r"(keep the first|keep the last|drop the first) (\d+|k) characters?" + SETTING)
ROTATE = re.compile(r"rotate it (left|right) by (\d+|k)" + SETTING)
REPLACE = re.compile(r"replace every '([^']+)' with '([^']*)'")
CASE = re.compile(r"convert it to (uppercase|lowercase|title case)")
QUOTES = ("'", '"', "`")


class StringPipelineFamily(TaskFamily):
    """Composed string transforms: apply each step of the question, in order, to the input string.

    Scoring is exact and case-sensitive: the final string must equal the item's answer. Canonical form: runs of
    whitespace count as one space, edge whitespace is ignored, and one pair of matching quotes around the whole
    answer ('...', "..." or `...`) is ignored, since answers are letters and spaces only.
    """

    name = world.FAMILY
    description = "Composed string transforms (reverse, case, replace, slice, rotate, remove repeats) with tools."
    levels = tuple(world.LEVELS)
    default_level = 1
    eval_seed = 252543802
    turn_limit = 10
    goal = (
        "Teach the model to apply a pipeline of string transforms exactly, in order: reverse, convert to "
        "uppercase/lowercase/title case, replace every 'x' with 'y' (case-sensitive), keep the first/last n "
        "characters, drop the first n characters, rotate left/right by n (left moves the first n characters to the "
        "end), and remove repeated characters keeping the first of each. The answer is the final string, exact and "
        "case-sensitive. Level 1: one easy transform (uppercase, title case, or keep the first n characters) of one "
        "short made-up word given in the question, answerable in one reply. Level 2: two or three transforms of "
        "one or two words. Level 3: three or four transforms; the input "
        "is a note only read_note reveals and one step's number is a setting only read_setting reveals. Level 4: "
        "five or six transforms of a three- or four-word note, two numbers from settings, two-letter replacements. "
        "The model should call the matching tool for each step, passing the previous tool result on unchanged, and "
        "end with <answer>STRING</answer>."
    )
    system_prompt = (
        "You transform strings. Apply each step of the question to the string, in the order given, and keep exact "
        "letter case. The tools do each transform exactly: reverse, change_case, replace, slice_text (keep the first "
        "n: start=0, end=n; keep the last n: start=-n; drop the first n: start=n), remove_repeats and rotate; "
        "read_note gives the text of a note and read_setting the number in a setting. When you have the final "
        "string, end your reply with <answer>STRING</answer>, for example <answer>kelOma</answer>, with no quotes."
    )
    answer_format = ("End your final reply with <answer>STRING</answer>: the final string, exact and case-sensitive, "
                     "without quotes (surrounding quotes and extra spaces are ignored).")
    public_modules = ("aitrainsai_family_string_pipeline", "aitrainsai_family_string_pipeline.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def normalise_answer(self, answer: str) -> str:
        """Whitespace collapsed and one pair of matching surrounding quotes dropped; case kept, no number parsing."""
        text = " ".join(str(answer).split())
        if len(text) >= 2 and text[0] == text[-1] and text[0] in QUOTES:
            text = " ".join(text[1:-1].split())
        return text

    def solve(self, item: Item, session: ToolSession) -> str:
        match = QUESTION.fullmatch(item.question)
        assert match is not None, f"not a question of this family: {item.question!r}"
        if match["note"] is not None:
            text = session.call("read_note", label=match["note"])
        else:
            text = match["string"]
        if match["steps"] is not None:
            steps = [re.sub(r"^\d+\) ", "", step) for step in match["steps"].split("; ")]
        else:
            steps = [match["step"]]
        for step in steps:
            text = self._apply(session, step, text)
        return text

    @staticmethod
    def _apply(session: ToolSession, step: str, text: str) -> str:
        if step == "reverse it":
            return session.call("reverse", text=text)
        if step.startswith("remove repeated characters"):
            return session.call("remove_repeats", text=text)
        if found := CASE.fullmatch(step):
            case = {"uppercase": "upper", "lowercase": "lower", "title case": "title"}[found[1]]
            return session.call("change_case", text=text, case=case)
        if found := REPLACE.fullmatch(step):
            return session.call("replace", text=text, old=found[1], new=found[2])
        if found := SLICE.fullmatch(step):
            n = _number(session, found[2], found[3])
            bounds = {"keep the first": {"start": 0, "end": n}, "keep the last": {"start": -n},
                      "drop the first": {"start": n}}[found[1]]
            return session.call("slice_text", text=text, **bounds)
        if found := ROTATE.fullmatch(step):
            return session.call("rotate", text=text, direction=found[1], n=_number(session, found[2], found[3]))
        raise ValueError(f"unrecognised step {step!r}")


def _number(session: ToolSession, literal: str, setting: str | None) -> int:
    return int(session.call("read_setting", label=setting)) if setting else int(literal)
