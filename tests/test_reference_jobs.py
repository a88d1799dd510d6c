"""The reference jobs' rubrics (plugins/trainer_local/reference_jobs): on each family's own items, the reply the
hidden eval scores 1.0 earns the rubric's top reward, and a wrong reply earns less. A rubric that disagreed with the
eval would train the model towards something the eval does not count (as triage's first rubric did).

Each job's verifiers v1 form (``<family>/v1/rubric.py``, the same rewards as ``@vf.reward`` methods) is held to the
same expectations, scored as the local trainer scores it: by the job's taskset in the sandbox, on the trace of a
rollout; its reward must equal the classic job's on every reply, tool calls included."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import verifiers as vf
from verifiers.utils.message_utils import normalize_messages

from aitrainsai import Constraints, RemoteEnvironment, job_template, write_frozen_rows
from aitrainsai.isolation import sandbox_works
from aitrainsai.jobs.format import verifiers_v1_path
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


# -- the v1 form of each job ---------------------------------------------------------------------------------------

needs_v1 = pytest.mark.skipif(not sandbox_works() or verifiers_v1_path() is None,
                              reason="needs the sandbox and the v1 runtime (make install)")
CONTROL_FAMILY = "multi_hop"


def _job(folder: Path, job: str, form: str, items) -> Path:
    """The reference job ``job`` in ``form`` (verifiers: its rubric.py; verifiers-v1: its v1/rubric.py), the
    template's entry file, and ``items`` as its frozen rows."""
    plugins = Plugins.load()
    family = plugins.task_families.get(CONTROL_FAMILY if job == "control" else job)()
    trainer = plugins.inner_trainers.get("local")()
    spec = family.task_spec(1, trainer.constraints(Constraints()))
    entry = "taskset.py" if form == "verifiers-v1" else "environment.py"
    folder.mkdir(parents=True)
    (folder / entry).write_text(job_template(spec, trainer.config_template(spec), form)[entry])
    for name in ("dataset.py", "trainer.toml"):
        shutil.copyfile(JOBS / job / name, folder / name)
    shutil.copyfile(JOBS / job / ("v1/rubric.py" if form == "verifiers-v1" else "rubric.py"), folder / "rubric.py")
    write_frozen_rows(folder, [{"question": i.question, "answer": str(i.answer), "world": i.world} for i in items],
                      spec.eval_interface.system_prompt)
    return folder


def _tool_replies(answer: str, call: dict) -> list[list[dict]]:
    """Rollouts with tool calls: the answer after a tool result, and a rollout cut off at a call (no final text)."""
    tool_call = {"id": "c1", "type": "function", "function": call}
    result = {"role": "tool", "tool_call_id": "c1", "content": "a result"}
    return [[{"role": "assistant", "content": "", "tool_calls": [tool_call]}, result,
             {"role": "assistant", "content": f"<answer>{answer}</answer>"}],
            [{"role": "assistant", "content": f"Perhaps {answer}.", "tool_calls": [tool_call]}, result,
             {"role": "assistant", "content": "", "tool_calls": [tool_call]}]]


def _scores(folder: Path, completions: list[tuple[int, list[dict]]]):
    """The job's reward functions, and (reward, each function's score) for each (row, completion), from its env in
    the sandbox."""
    with RemoteEnvironment(folder) as env:
        info = env.load()
        scores = []
        for row, completion in completions:
            score = env.score(env.start(row=row), completion)
            scores.append((score.reward, score.metrics))
        assert env.reward_errors() == []
    return info.reward_funcs, scores


@needs_v1
@pytest.mark.parametrize("job", FAMILIES + ["control"])
def test_the_v1_reference_rubric_scores_as_the_eval_and_the_classic_rubric(tmp_path, job):
    """On the eval's own items: the v1 rubric's main term scores the fourteen variants as the eval does, the right
    reply earns the top reward and a wrong one less (as the classic tests above ask), and the whole reward, and each
    term, equal the classic job's on every reply, tool calls included."""
    family_name = CONTROL_FAMILY if job == "control" else job
    registry = Plugins.load().task_families
    if family_name not in registry.names():
        pytest.skip(f"the {family_name} family is not installed")
    scorer = registry.get(family_name)()
    items = list(scorer.generate(5, 1, 6)) + list(scorer.generate(6, 1, 4))
    call = next((c["function"] for m in scorer.reference_transcript(scorer.dev_examples(1)[0])
                 if m.get("role") == "assistant" for c in m.get("tool_calls") or []), None)
    asked: list[tuple[int, list[dict]]] = []
    for row, item in enumerate(items):
        answer = str(item.answer)
        replies = [f"Working it out.\n<answer>{answer}</answer>", WRONG.get(family_name, "<answer>zzqx</answer>"),
                   "", "x" * 170, *_variants(answer)]
        asked += [(row, [{"role": "assistant", "content": reply}]) for reply in replies]
        asked += [(row, completion) for completion in (_tool_replies(answer, call) if call else [])]
    funcs, v1 = _scores(_job(tmp_path / "v1", job, "verifiers-v1", items), asked)
    rubric = _rubric(job)  # the classic job's rewards, as verifiers 0.2.1 calls them
    assert {(f.name, f.weight) for f in funcs} == {(f.__name__, w) for f, w in zip(rubric.funcs, rubric.weights)}
    classic = []
    for row, completion in asked:
        arguments = {"prompt": [{"role": "user", "content": items[row].question}], "answer": str(items[row].answer),
                     "completion": normalize_messages(completion), "parser": rubric.parser, "info": {}, "state": {}}
        terms = {f.__name__: f(**arguments) for f in rubric.funcs}
        classic.append((sum(w * terms[f.__name__] for f, w in zip(rubric.funcs, rubric.weights)), terms))
    names = {f.name for f in funcs}
    for (_, completion), (reward, terms), (classic_reward, classic_terms) in zip(asked, v1, classic):
        assert reward == pytest.approx(classic_reward), completion
        assert {k: v for k, v in terms.items() if k in names} == pytest.approx(
            {k: v for k, v in classic_terms.items() if k in names}), completion
    if job == "control":
        return
    (main,) = [f.name for f in funcs if f.weight == 1.0]
    assert main == _rubric(job).funcs[0].__name__
    best = sum(f.weight for f in funcs)
    for (row, completion), (reward, terms) in zip(asked, v1):
        item, reply = items[row], completion[-1]["content"]
        if len(completion) > 1:
            continue
        if reply.startswith("Working it out."):
            assert reward == pytest.approx(best)
        elif reply == WRONG.get(family_name, "<answer>zzqx</answer>"):
            assert reward < best - 0.9
        assert terms[main] == scorer.score(item, [{"role": "assistant", "content": reply}]), reply
