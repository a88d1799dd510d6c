"""The reference jobs' rubrics (plugins/trainer_local/reference_jobs): on each family's own items, the reply the
hidden eval scores 1.0 earns the rubric's top reward, and a wrong reply earns less. A rubric that disagreed with the
eval would train the model towards something the eval does not count (as triage's first rubric did)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import verifiers as vf
from verifiers.utils.message_utils import normalize_messages

from aitrainsai.plugins import Plugins

JOBS = Path(__file__).resolve().parents[1] / "plugins" / "trainer_local" / "reference_jobs"
FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]
WRONG = {"calc_chain": "<answer>-1</answer>", "ledger": "<answer>-1</answer>",
         "triage": "<answer>api-gateway restart</answer>"}


def _rubric(family: str) -> vf.Rubric:
    spec = importlib.util.spec_from_file_location(f"reference_rubric_{family}", JOBS / family / "rubric.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_rubric(vf.XMLParser(["answer"], answer_field="answer"))


def _reward(rubric: vf.Rubric, parser, question: str, answer: str, reply: str) -> float:
    prompt = [{"role": "user", "content": question}]
    completion = normalize_messages([{"role": "assistant", "content": reply}])
    return sum(weight * func(prompt=prompt, completion=completion, answer=answer, parser=parser, info={}, state={})
               for func, weight in zip(rubric.funcs, rubric.weights))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reference_rubric_pays_most_for_what_the_eval_scores_right(family):
    registry = Plugins.load().task_families
    if family not in registry.names():
        pytest.skip(f"the {family} family is not installed")
    scorer = registry.get(family)()
    rubric = _rubric(family)
    best = sum(rubric.weights)
    for item in scorer.generate(5, 1, 6):
        right = f"Working it out.\n<answer>{item.answer}</answer>"
        wrong = WRONG.get(family, "<answer>zzqx</answer>")
        assert scorer.score(item, [{"role": "assistant", "content": right}]) == 1.0
        assert scorer.score(item, [{"role": "assistant", "content": wrong}]) == 0.0
        assert _reward(rubric, rubric.parser, item.question, str(item.answer), right) == pytest.approx(best)
        assert _reward(rubric, rubric.parser, item.question, str(item.answer), wrong) < best - 0.9


def _variants(answer: str) -> list[str]:
    root = answer.split()[0]
    return [f"<answer>{answer.upper()}</answer>", f"<answer>{answer.title()}</answer>", f"<answer>'{answer}'.</answer>",
            f"Let me see.\n{answer}", f"The answer is {answer}.", f"<answer>{answer}</answer> or <answer>x</answer>",
            f"<answer>team {answer}</answer>", f"<answer>{root}</answer>", f"<answer>{root} scale up</answer>",
            f"<answer>{answer} {answer}</answer>", f"<answer> {answer} </answer>", f"<answer>{answer}s</answer>",
            f"<answer>{answer.replace('_', ' ')}</answer>", f"<answer>{answer.replace('_', '-')}s</answer>"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reference_rubric_reads_the_answer_as_the_eval_does(family):
    """The rubric's first term (weight 1) scores what the eval scores, on variants of the right reply: case, quotes,
    a final period, no tags, several tags, partial answers."""
    registry = Plugins.load().task_families
    if family not in registry.names():
        pytest.skip(f"the {family} family is not installed")
    scorer = registry.get(family)()
    rubric = _rubric(family)
    assert rubric.weights[0] == 1.0
    for item in scorer.generate(6, 1, 4):
        prompt = [{"role": "user", "content": item.question}]
        for reply in _variants(str(item.answer)):
            completion = normalize_messages([{"role": "assistant", "content": reply}])
            first = rubric.funcs[0](prompt=prompt, completion=completion, answer=str(item.answer),
                                    parser=rubric.parser, info={}, state={})
            assert first == scorer.score(item, [{"role": "assistant", "content": reply}]), reply
