"""``TaskSpec.render_compact``: the spec in brief for a small agent, from the same spec as ``render``."""

from aitrainsai.families import Constraints, Item, TaskFamily


def shout(world: dict, text: str) -> str:
    """Shout a text.

    Args:
        text: what to shout
    """
    return text.upper()


class Loud(TaskFamily):
    name = "loud"
    goal = "Teach the model to shout the last word of the question."
    system_prompt = "You shout. Call shout, then end with <answer>WORD</answer>."
    eval_seed = 5
    turn_limit = 3
    public_modules = ("loud_public", "loud_public.words")
    tool_functions = (shout,)

    def generate(self, seed, level, n):
        return [Item(family=self.name, level=level, seed=seed, index=i, question=f"say w{seed}x{i}",
                     answer=f"W{seed}X{i}") for i in range(n)]

    def solve(self, item, session):
        return session.call("shout", text=item.question.split()[-1])


def test_the_compact_spec_holds_the_task_in_brief_and_no_transcript():
    spec = Loud().task_spec(1, Constraints(allowed_bases=["tiny-a", "tiny-b"], max_train_steps=7,
                                           max_dataset_size=321, max_wall_seconds=654))
    text = spec.render_compact()
    assert text.startswith("# Task: loud (level 1)\nGoal: Teach the model to shout the last word of the question.\n")
    assert ("Hard constraints: base model tiny-a or tiny-b; at most 7 training steps; at most 321 dataset items, "
            "none from the hidden eval; at most 654 s wall time.") in text
    assert (f"Hidden eval: {Loud.answer_format} Turn limit 3. Tools: shout. Your job may import loud_public, "
            "loud_public.words.") in text
    first, second = spec.dev_examples[0].item, spec.dev_examples[1].item
    assert f"Example: {first.question} -> {first.answer}" in text and second.question not in text
    assert Loud.system_prompt not in text and "tool_calls" not in text and "Shout a text" not in text
    assert Loud.system_prompt in spec.render()  # the full view has what the brief leaves out
    assert len(text) < len(spec.render()) / 3


def test_the_compact_reward_text_is_the_formula_the_rules_and_each_components_description(monkeypatch):
    from pathlib import Path

    from aitrainsai.builtin.reward_components import Validation
    from aitrainsai.run.prompt import compact_reward_text
    from aitrainsai.plugins import Plugins
    from aitrainsai.reward_spec import load_reward_spec

    plugins = Plugins()
    plugins.add_builtins()
    spec = load_reward_spec(str(Path(__file__).resolve().parents[2] / "reward_specs" / "default.toml"), plugins)
    text = compact_reward_text(spec)
    assert text.splitlines() == [
        "How you are rewarded: reward = 0.35·validation + 0.6·job_quality + 0.05·train_speed.",
        "With no submit_job call that parses, the reward is -0.1. You have 3 submit_job attempts; the first accepted "
        "one ends the episode."]
    assert len(text) < len(spec.agent_text()) / 3
    monkeypatch.setattr(Validation, "description", "1.0 for an accepted first attempt, halved per rejected one")
    assert "\nvalidation: 1.0 for an accepted first attempt, halved per rejected one\n" in compact_reward_text(spec)
