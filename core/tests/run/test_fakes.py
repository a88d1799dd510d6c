"""The fakes the engine tests run on keep the contracts of their kinds: the task families of :mod:`aitrainsai.testing`
(tally and its held-out twin) the family contract, the scripted policy the outer trainer's."""

import asyncio

import pytest

from aitrainsai.plugins import CORE_DISTRIBUTION, Plugins
from aitrainsai.testing import (FAKE_FAMILIES, FAKES, OuterTrainerConformance, ScriptedPolicy, TaskFamilyConformance,
                                call)
from aitrainsai.testing.tally.family import Tally, TallyHeldOut


class TestTally(TaskFamilyConformance):
    family = Tally
    distribution = CORE_DISTRIBUTION  # shipped in the core, registered by hand: no entry point, no hook of the core

    def test_selected_alone_it_registers_its_components(self):
        plugins = Plugins.load("")
        assert self.family.name not in plugins.task_families
        plugins.add(FAKE_FAMILIES, name="tally", distribution="test-tally")
        assert plugins.task_families.owner(self.family.name) == "test-tally"


class TestTallyHeldOut(TestTally):
    family = TallyHeldOut

    def test_job_template_serves_the_eval_interface(self):
        pytest.skip("tally's template, checked in the sandbox there (seconds each)")


def test_the_held_out_twin_draws_items_of_its_own():
    tally, twin = Tally(), TallyHeldOut()
    assert twin.held_out and not tally.held_out
    assert {i.family for i in twin.generate(3, 2, 5)} == {"tally_held_out"}
    assert [i.question for i in twin.generate(3, 2, 5)] != [i.question for i in tally.generate(3, 2, 5)]
    assert [i.id for i in twin.hidden_eval()] != [i.id for i in tally.hidden_eval()]


@pytest.mark.parametrize("level", Tally.levels)
def test_a_question_names_one_bin_more_than_its_level(level):
    (item,) = Tally().generate(0, level, 1)
    assert item.question.count("-") == level + 1 and len(item.world["bins"]) == level + 3


class TestScriptedPolicy(OuterTrainerConformance):
    trainer = ScriptedPolicy
    distribution = CORE_DISTRIBUTION  # shipped in the core, registered by hand (FAKES)

    def test_selected_alone_it_registers_its_components(self):
        plugins = Plugins.load("")
        assert self.trainer.name not in plugins.outer_trainers
        plugins.add(FAKES, name="given-numbers", distribution="test-given-numbers")
        assert plugins.outer_trainers.owner(self.trainer.name) == "test-given-numbers"


def test_the_scripted_policy_plays_each_conversation_from_its_start():
    """The n-th turn of a conversation is the script's n-th entry, whichever conversation asked before; then done."""
    policy = ScriptedPolicy([call("read_file", path="trainer.toml"), "not a call"])

    def turn(*earlier: str):
        messages = [{"role": "user", "content": "task"}, *({"role": "assistant", "content": t} for t in earlier)]
        return asyncio.run(policy.sample(messages, [], None, mode="eval"))  # type: ignore[arg-type]

    first = turn()
    assert first.message["tool_calls"][0]["function"]["name"] == "read_file" and first.parse_error is None
    assert turn().message == first.message  # another conversation starts over
    assert turn("read").parse_error == "no JSON tool call found" and turn("read").message["content"] == "not a call"
    assert turn("read", "not a call").message == {"role": "assistant", "content": "done"}
