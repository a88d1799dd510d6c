"""Conformance checks for task families."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest

from aitrainsai.chat import Message
from aitrainsai.families import Item, TaskFamily, ToolSession
from aitrainsai.testing.plugins import PluginConformance

TRIVIAL_CEILING = 0.1


class TaskFamilyConformance(PluginConformance):
    """Set ``family`` to the family class and ``distribution`` to its distribution name."""

    family: ClassVar[type[TaskFamily]]
    kind = "task_families"

    @pytest.fixture(scope="class")
    @classmethod
    def fam(cls) -> TaskFamily:
        return cls.family()

    @pytest.fixture(scope="class")
    @classmethod
    def hidden(cls, fam: TaskFamily) -> list[Item]:
        return fam.hidden_eval()

    def component_names(self) -> list[str]:
        return [self.family.name]

    def test_metadata(self, fam: TaskFamily):
        assert isinstance(fam.held_out, bool)
        assert fam.levels and all(isinstance(level, int) for level in fam.levels)
        assert fam.default_level in fam.levels
        assert fam.eval_size > 0 and fam.turn_limit >= 1
        assert fam.goal.strip() and fam.system_prompt.strip() and fam.answer_format.strip()
        assert fam.description.strip() and "\n" not in fam.description, \
            "set description: one line saying what the family is, shown by `aitrainsai families`"
        assert fam.public_modules, "list the modules an agent's job may import (generator, tools)"
        assert "eval_seed" in vars(self.family), "set eval_seed on the family class, in its private module"
        assert self.family.__module__ not in fam.public_modules, "the family class must live in a private module"

    def test_public_module_contract(self, fam: TaskFamily):
        """The job template imports ``generate`` and ``TOOLS`` from the first public module: they must be there and
        be the family's own generator and tools."""
        import importlib

        from aitrainsai.tools import takes_world

        assert fam.public_modules, "list the modules an agent's job may import (generator, tools)"
        modules = {}
        for name in fam.public_modules:
            try:
                modules[name] = importlib.import_module(name)
            except ImportError as exc:
                pytest.fail(f"public module {name!r} cannot be imported: {exc}")
        first = fam.public_modules[0]
        public = modules[first]
        missing = [name for name in ("generate", "TOOLS") if not hasattr(public, name)]
        assert not missing, (f"the job template does `from {first} import TOOLS, generate`; {first} lacks "
                             f"{', '.join(missing)} (export them, e.g. in its __init__.py)")
        tools = public.TOOLS
        assert isinstance(tools, (tuple, list)) and all(callable(tool) for tool in tools), \
            f"{first}.TOOLS must be a tuple of the tool functions"
        assert [tool.__name__ for tool in tools] == [tool.__name__ for tool in fam.tool_functions], \
            f"{first}.TOOLS must be the family's tool_functions, in order"
        for tool in tools:
            takes_world(tool)  # raises when `world` is not the first parameter
        for level in fam.levels:
            ours = [item.to_json() for item in public.generate(11, level, 5)]
            assert ours == [item.to_json() for item in fam.generate(11, level, 5)], \
                f"{first}.generate differs from the family's generate at level {level}"

    @pytest.mark.parametrize("seed", [0, 12345])
    def test_generator_is_deterministic(self, fam: TaskFamily, seed: int):
        for level in fam.levels:
            first = [item.to_json() for item in fam.generate(seed, level, 20)]
            again = [item.to_json() for item in fam.generate(seed, level, 20)]
            assert first == again, f"level {level}: the same seed gave different items"
            assert len(first) == 20
            assert fam.generate(seed, level, 5) == fam.generate(seed, level, 20)[:5], "n must only truncate"
            other = [item.to_json() for item in fam.generate(seed + 1, level, 20)]
            assert first != other, f"level {level}: seeds {seed} and {seed + 1} gave the same items"

    def test_items_are_well_formed(self, fam: TaskFamily):
        for level in fam.levels:
            items = fam.generate(3, level, 50)
            for item in items:
                assert item.family == fam.name and item.level == level
                assert item.question.strip() and str(item.answer).strip()
                json.dumps(item.world)  # the world must be JSON, so that datasets can carry it
            assert len({item.id for item in items}) >= 45, f"level {level}: too many duplicate items"

    def test_levels_get_harder_or_differ(self, fam: TaskFamily):
        questions = [{item.question for item in fam.generate(5, level, 10)} for level in fam.levels]
        for a, b in zip(questions, questions[1:]):
            assert a != b

    def test_dev_and_hidden_are_disjoint(self, fam: TaskFamily, hidden: list[Item]):
        assert len(hidden) == fam.eval_size
        hidden_ids = {item.id for level in fam.levels for item in fam.hidden_eval(level=level)}
        for level in fam.levels:
            dev = fam.dev_examples(level)
            assert dev, f"level {level}: no dev examples"
            assert not hidden_ids & {item.id for item in dev}

    def test_reference_solver_scores_one_on_hidden_set(self, fam: TaskFamily, hidden: list[Item]):
        failures = []
        for item in hidden:
            transcript = fam.reference_transcript(item)
            assert any(m.get("role") == "tool" for m in transcript), "the reference solver must use the tools"
            turns = sum(1 for m in transcript if m.get("role") == "assistant")
            assert turns <= fam.turn_limit, f"the reference solver needs {turns} turns; turn_limit is {fam.turn_limit}"
            if fam.score(item, transcript) != 1.0:
                failures.append(item.question[:80])
        assert not failures, f"{len(failures)} hidden items not solved, e.g. {failures[:3]}"

    def test_reference_solver_at_every_level(self, fam: TaskFamily):
        for level in fam.levels:
            for item in fam.generate(99, level, 20):
                assert fam.score(item, fam.reference_transcript(item)) == 1.0, item.question

    def test_trivial_answers_score_near_zero(self, fam: TaskFamily, hidden: list[Item]):
        most_common = Counter(item.answer for item in hidden).most_common(1)[0][0]
        strategies = {
            "empty": lambda item: "",
            "constant 0": lambda item: "<answer>0</answer>",
            "constant unknown": lambda item: "<answer>unknown</answer>",
            "question echoed": lambda item: item.question,
            "question as answer": lambda item: f"<answer>{item.question}</answer>",
        }
        for label, reply in strategies.items():
            mean = _mean(fam.score(item, _reply(fam, item, reply(item))) for item in hidden)
            assert mean <= TRIVIAL_CEILING, f"{label!r} scores {mean:.3f} on the hidden set"
        # the most common answer is the best constant: it must stay weak too
        mean = _mean(fam.score(item, _reply(fam, item, f"<answer>{most_common}</answer>")) for item in hidden)
        assert mean <= 0.25, f"answering the most common answer {most_common!r} scores {mean:.3f}"

    def test_scores_are_in_unit_interval(self, fam: TaskFamily, hidden: list[Item]):
        for item in hidden[:20]:
            for transcript in (_reply(fam, item, "garbage"), fam.reference_transcript(item), []):
                value = fam.score(item, transcript)
                assert 0.0 <= value <= 1.0 and math.isfinite(value)

    def test_tool_schemas_are_valid(self, fam: TaskFamily):
        schemas = fam.tool_schemas()
        assert schemas, "a family has tools"
        names = [s["function"]["name"] for s in schemas]
        assert len(names) == len(set(names))
        for schema in schemas:
            assert schema["type"] == "function"
            fn = schema["function"]
            assert fn["description"].strip()
            params = fn["parameters"]
            assert params["type"] == "object" and params["additionalProperties"] is False
            assert set(params["required"]) <= set(params["properties"])
            for prop in params["properties"].values():
                assert prop.get("type") in {"string", "integer", "number", "boolean", "array"}
            json.dumps(schema)

    def test_tools_answer_bad_input_with_an_error_string(self, fam: TaskFamily):
        item = fam.generate(1, fam.levels[-1], 1)[0]
        session = ToolSession(fam, item)
        hostile = [None, "", "not json", "[]", "{", json.dumps({"zzz": 1}), "x" * 100_000]
        for schema in fam.tool_schemas():
            name = schema["function"]["name"]
            props = schema["function"]["parameters"]["properties"]
            cases = list(hostile)
            for key in props:
                for value in (None, 10**30, -1, "nope", "z" * 5_000, [1, 2], {"a": 1}, True, 1.5, "UNKNOWN-ID-404"):
                    cases.append(json.dumps({**{k: _sample(p) for k, p in props.items()}, key: value}))
            for arguments in cases:
                result = session.tools and _call(session, name, arguments)
                shown = arguments[:60] if arguments else arguments
                assert isinstance(result, str), f"{name}({shown!r}) returned {result!r}"
        assert _call(session, "no_such_tool", "{}").startswith("error")

    def test_overlap_check_finds_hidden_items(self, fam: TaskFamily, hidden: list[Item]):
        clean = fam.generate(424242, fam.default_level, 50)
        assert fam.overlap(clean) == [], "fresh items flagged as hidden"
        leaked = clean[:10] + hidden[:3] + clean[10:]
        assert fam.overlap(leaked) == [10, 11, 12]
        rows = [{"prompt": [{"role": "user", "content": "Please: " + hidden[5].question.upper()}], "answer": "x"}]
        assert fam.overlap(rows) == [0], "a hidden question inside a prompt, case changed, must be found"
        assert fam.overlap([hidden[7].question]) == [0]

    def test_spec_renders_without_hidden_items(self, fam: TaskFamily):
        hidden_questions = {item.question for level in fam.levels for item in fam.hidden_eval(level=level)}
        for level in fam.levels:
            spec = fam.task_spec(level)
            text = spec.render()
            assert fam.system_prompt in text and fam.name in text
            for schema in spec.eval_interface.tools:
                assert schema["function"]["name"] in text
            assert spec.held_out == fam.held_out
            assert not any(q in text for q in hidden_questions), "the spec shows a hidden-eval item"
            for example in spec.dev_examples:
                assert fam.score(example.item, example.transcript) == 1.0
        with pytest.raises(ValueError):
            fam.task_spec(max(fam.levels) + 100)


    def test_job_template_serves_the_eval_interface(self, fam: TaskFamily, tmp_path):
        """The template the agent is shown, in each job format, run in the sandbox as a job is: the eval's system
        prompt, turn limit and tool names; each row's tools answer as the eval's own tools do on that row's world;
        the template's rubric pays the reference solution 1 and a wrong answer 0. Both formats show the trainer the
        same tool schemas, byte for byte, so a job's format never changes the prompt its model trains on."""
        import importlib.util
        import subprocess
        import sys

        from aitrainsai.isolation import sandbox_works
        from aitrainsai.jobs.format import verifiers_v1_path

        if not sandbox_works():
            pytest.skip("this machine cannot build the sandbox")
        first = fam.public_modules[0]
        if subprocess.run([sys.executable, "-I", "-c", f"import {first}"], capture_output=True).returncode:
            pytest.skip(f"{first} is not installed where a job's sandbox looks (the interpreter's own sys.path, no "
                        "PYTHONPATH): pip install the family to run this check")
        formats = [f for f, missing in (("verifiers", importlib.util.find_spec("verifiers") is None),
                                        ("verifiers-v1", verifiers_v1_path() is None)) if not missing]
        if not formats:
            pytest.skip("needs verifiers for classic jobs (aitrainsai[jobs]) or 0.4.0 for v1 jobs (make install)")
        shown = {job_format: self._served_template(fam, job_format, tmp_path / job_format) for job_format in formats}
        if len(shown) == 2:
            assert shown["verifiers-v1"] == shown["verifiers"], "the two formats show the tools differently"

    @staticmethod
    def _served_template(fam: TaskFamily, job_format: str, folder: Path) -> str:
        """Checks the template in ``job_format`` served from the sandbox; returns its tool schemas as JSON text."""
        from aitrainsai.jobs.job import job_template
        from aitrainsai.jobs.remote_env import RemoteEnvironment

        folder.mkdir(parents=True)
        spec = fam.task_spec(fam.default_level)
        for file, text in job_template(spec, "", job_format).items():  # type: ignore[arg-type]
            (folder / file).write_text(text)
        items = fam.generate(7, fam.default_level, 3)
        (folder / "dataset.jsonl").write_text("".join(json.dumps(
            {"question": i.question, "answer": i.answer, "world": i.world}) + "\n" for i in items))
        names = [schema["function"]["name"] for schema in spec.eval_interface.tools]
        with RemoteEnvironment(folder) as env:
            info = env.load()
            assert info.system_prompt == spec.eval_interface.system_prompt
            assert info.max_turns == spec.eval_interface.turn_limit
            assert [s.function["name"] for s in info.tool_schemas] == names, "not the eval's tools in its order"
            assert [row.answer for row in env.rows(len(items))] == [str(item.answer) for item in items]
            for index, item in enumerate(items):
                state, session = env.start(row=index), ToolSession(fam, item)
                for schema in spec.eval_interface.tools:
                    properties = schema["function"]["parameters"]["properties"]
                    arguments = json.dumps({key: _sample(prop) for key, prop in properties.items()})
                    name = schema["function"]["name"]
                    assert env.tool(state, name, arguments) == _call(session, name, arguments), \
                        f"{job_format} template: {name}({arguments}) differs from the eval's tool on row {index}"
                solved = fam.reference_transcript(item)[len(fam.initial_messages(item)):]
                assert env.score(env.start(row=index), solved).reward == 1.0, f"{job_format}: reference unpaid"
                wrong: list[Message] = [{"role": "assistant", "content": "<answer>unknown</answer>"}]
                assert env.score(env.start(row=index), wrong).reward == 0.0, f"{job_format}: a wrong answer paid"
            return json.dumps([s.model_dump() for s in info.tool_schemas])


def _reply(fam: TaskFamily, item: Item, text: str) -> list[Message]:
    return fam.initial_messages(item) + [{"role": "assistant", "content": text}]


def _call(session: ToolSession, name: str, arguments) -> str:
    from aitrainsai.tools import call_tool

    return call_tool(session.tools, name, arguments)


def _sample(prop: dict):
    return {"string": "a", "integer": 1, "number": 1.0, "boolean": True, "array": []}.get(str(prop.get("type")), "a")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
