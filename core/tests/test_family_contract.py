"""What a family's public module must offer the job template, checked by the conformance kit, and the one rule for
a tool's ``world`` parameter shared by the core and the template."""

import functools
import importlib
import sys

import pytest

from aitrainsai.families import TaskFamily
from aitrainsai.jobs.job import job_template
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai.tools import ToolSchemaError, bind, takes_world, tool_schema

PUBLIC = '''
from aitrainsai.families import Item


def generate(seed, level, n):
    return [Item(family="contract", level=level, seed=seed, index=i, question=f"shout w{seed}x{i}",
                 answer=f"W{seed}X{i}", world={"loud": True}) for i in range(n)]


def shout(world: dict, text: str) -> str:
    """Shout text.

    Args:
        text: what to shout
    """
    return text.upper() if world["loud"] else text


TOOLS = (shout,)
'''


def family_with_public_module(tmp_path, monkeypatch, module: str, source: str) -> TaskFamily:
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(module, None)
    reference = _reference(tmp_path)  # the family's own generator and tools

    class Contract(TaskFamily):
        name = "contract"
        goal = system_prompt = "Shout."
        eval_seed = 5
        public_modules = (module,)
        tool_functions = reference.TOOLS

        def generate(self, seed, level, n):
            return reference.generate(seed, level, n)

        def solve(self, item, session):
            return session.call("shout", text=item.question.split()[-1])

    return Contract()


def _reference(tmp_path):
    (tmp_path / "contract_reference.py").write_text(PUBLIC)
    return importlib.import_module("contract_reference")


def test_the_kit_refuses_a_public_module_without_what_the_template_imports(tmp_path, monkeypatch):
    emptied = family_with_public_module(tmp_path, monkeypatch, "contract_emptied", '"""Emptied."""\n')
    with pytest.raises(AssertionError, match="from contract_emptied import TOOLS, generate.*lacks generate, TOOLS"):
        TaskFamilyConformance().test_public_module_contract(emptied)
    other = family_with_public_module(tmp_path, monkeypatch, "contract_other",
                                      PUBLIC.replace('f"shout w{seed}x{i}"', 'f"whisper w{seed}x{i}"'))
    with pytest.raises(AssertionError, match="contract_other.generate differs"):
        TaskFamilyConformance().test_public_module_contract(other)
    whole = family_with_public_module(tmp_path, monkeypatch, "contract_whole", PUBLIC)
    TaskFamilyConformance().test_public_module_contract(whole)


def loud(world: dict, text: str) -> str:
    """Shout.

    Args:
        text: what to shout
    """
    return text.upper()


def plain(text: str) -> str:
    """Echo.

    Args:
        text: what to echo
    """
    return text


def late(text: str, world: dict) -> str:
    """World not first."""
    return text


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def test_world_is_the_first_parameter_or_none():
    assert takes_world(loud) and not takes_world(plain)
    assert takes_world(logged(loud)), "a decorated tool keeps its signature (the template's co_varnames did not)"
    assert bind(logged(loud), {})("a") == "A" and bind(plain, {}) is plain
    assert list(tool_schema(logged(loud))["function"]["parameters"]["properties"]) == ["text"]
    with pytest.raises(ToolSchemaError, match="'world' must be its first parameter"):
        takes_world(late)
    with pytest.raises(ToolSchemaError, match="'world' must be its first parameter"):
        tool_schema(late)


def test_the_job_template_uses_the_cores_rule(tmp_path, monkeypatch):
    family = family_with_public_module(tmp_path, monkeypatch, "contract_whole", PUBLIC)
    environment = job_template(family.task_spec(1), "")["environment.py"]
    assert "from aitrainsai import takes_world" in environment and "takes_world(tool)" in environment
    assert "co_varnames" not in environment


def test_last_text_reads_dicts_and_message_objects_and_skips_empty_messages():
    from types import SimpleNamespace

    from aitrainsai.families import final_reply, last_text

    messages = [{"role": "user", "content": "q1"}, SimpleNamespace(role="assistant", content="a1"),
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "  "},
                SimpleNamespace(role="assistant", content=None), {"role": "tool", "content": "r"}]
    assert last_text(messages, "user") == "q2"
    assert last_text(messages, "assistant") == "a1"
    assert last_text(messages, "system") == "" and last_text(None, "user") == ""
    assert final_reply([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": ""}]) == "x"
