import pytest
from click.testing import CliRunner

from aitrainsai.cli.command import cli
from aitrainsai.reward_spec import RewardSpecError, load_reward_spec
from aitrainsai.rewards import EpisodeOutcome, ProbeAttempt


def write(tmp_path, text):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return str(path)


def test_default_spec_is_the_reference_design(plugins):
    spec = load_reward_spec("default", plugins)
    assert spec.formula() == "reward = 0.35·validation + 0.6·job_quality + 0.05·train_speed"
    assert spec.max_attempts == 3
    never = EpisodeOutcome(family="f", level=1, parsed_submission=False)
    assert spec.reward(never) == (-0.1, {})
    done = EpisodeOutcome(family="f", level=1, parsed_submission=True, attempts=[ProbeAttempt(attempt=1, ok=True)],
                          job_status="done", baseline_scores={"a": 0.5}, post=0.5, train_seconds=900,
                          train_budget_seconds=1800)
    total, parts = spec.reward(done)  # uplift 0 -> term 0.5; quality 0.25*0.5 + 0.75*0.5 = 0.5; speed 0.5
    assert parts == pytest.approx({"validation": 1.0, "job_quality": 0.5, "train_speed": 0.5})
    assert total == pytest.approx(0.35 + 0.6 * 0.5 + 0.05 * 0.5)


def test_agent_text_comes_from_the_same_spec(plugins, tmp_path):
    spec = load_reward_spec(write(tmp_path, """
no_submission = -0.3
max_attempts = 5
[[terms]]
component = "validation"
weight = 0.5
options = { decay = 0.8 }
[[terms]]
component = "job_quality"
weight = 0.5
"""), plugins)
    text = spec.agent_text()
    assert "reward = 0.5·validation + 0.5·job_quality" in text
    assert "multiplied by 0.8" in text and "-0.3" in text and "at most 5 submit_job attempts" in text
    assert "train_speed" not in text


@pytest.mark.parametrize("text, message", [
    ('[[terms]]\ncomponent = "vibes"\nweight = 1\n', "no reward component named 'vibes'"),
    ('[[terms]]\ncomponent = "validation"\nweight = "lots"\n', "terms.0.weight"),
    ('[[terms]]\ncomponent = "validation"\nweight = nan\n', "terms.0.weight"),
    ('[[terms]]\ncomponent = "validation"\nweight = 1\noptions = { decay = 7 }\n', "terms[0].options: decay"),
    ('[[terms]]\ncomponent = "validation"\nweight = 1\ncolour = 1\n', "terms.0.colour"),
    ('max_attempts = 0\n[[terms]]\ncomponent = "validation"\nweight = 1\n', "max_attempts"),
    ("terms = []\n", "terms"),
    ("[[terms]\n", "not valid TOML"),
])
def test_bad_specs_are_refused_with_the_key(plugins, tmp_path, text, message):
    with pytest.raises(RewardSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_reward_spec(write(tmp_path, text), plugins)


def test_reward_show_prints_formula_and_agent_text():
    out = CliRunner().invoke(cli, ["reward", "show"]).output
    assert "reward = 0.35·validation + 0.6·job_quality + 0.05·train_speed" in out
    assert "What the agent is told:" in out and "How you are rewarded:" in out
    bad = CliRunner().invoke(cli, ["reward", "show", "no-such-spec"])
    assert bad.exit_code == 1 and "no reward spec 'no-such-spec'" in bad.output
