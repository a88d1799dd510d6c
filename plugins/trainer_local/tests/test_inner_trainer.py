"""The local inner trainer as a plugin: conformance and its probe of trainer.toml."""

from aitrainsai import Constraints, EvalInterface, TaskSpec
from aitrainsai.testing import InnerTrainerConformance
from aitrainsai_trainer_local.inner import LocalTrainer


class TestLocalTrainerConformance(InnerTrainerConformance):
    trainer = LocalTrainer
    distribution = "aitrainsai-trainer-local"


def spec(trainer: LocalTrainer) -> TaskSpec:
    return TaskSpec(family="f", level=1, held_out=False, goal="g",
                    constraints=trainer.constraints(Constraints()),
                    eval_interface=EvalInterface(system_prompt="s", tools=[], answer_format="a", turn_limit=2),
                    public_modules=["m"], dev_examples=[])


def test_the_template_config_is_accepted(tmp_path):
    trainer = LocalTrainer()
    (tmp_path / "trainer.toml").write_text(trainer.config_template(spec(trainer)))
    assert trainer.probe(tmp_path, spec(trainer)) == []
    assert "steps = 4\n" in (tmp_path / "trainer.toml").read_text()  # the template stays inside the step budget


def test_a_config_the_trainer_rejects(tmp_path):
    trainer = LocalTrainer()
    (tmp_path / "trainer.toml").write_text('base_model = "gpt-4"\nsteps = 500\nlearning_rate = -1\nbatch = 3\n')
    problems = [str(p) for p in trainer.probe(tmp_path, spec(trainer))]
    assert any("learning_rate: Input should be greater than 0" in p for p in problems), problems
    assert any("batch: unknown key" in p for p in problems)
    (tmp_path / "trainer.toml").write_text('base_model = "gpt-4"\nsteps = 500\n')
    problems = [str(p) for p in trainer.probe(tmp_path, spec(trainer))]
    assert any("base_model 'gpt-4' is not allowed" in p and "trainer.toml:1" in p for p in problems)
    assert any("exceeds the training budget of 4" in p for p in problems)
    (tmp_path / "trainer.toml").write_text('steps = 2\nprompts_per_step = 32\ngroup_size = 32\n')
    assert "at most 256" in str(trainer.probe(tmp_path, spec(trainer))[0])
    (tmp_path / "trainer.toml").write_text('steps = [\n')
    assert "not valid TOML" in str(trainer.probe(tmp_path, spec(trainer))[0])


def test_this_distribution_ships_the_default_presets():
    from aitrainsai import Plugins, load_config

    presets = Plugins.load().presets
    assert {"default", "quickstart", "cpu-long", "reference", "one-gpu", "one-gpu-cpu"} <= set(presets)
    default = load_config(presets=presets)
    assert (default.gpu_backend.use, default.inner_trainer.use, default.outer_trainer.use) == \
        ("local", "local", "recipe")
    reference = load_config(preset="reference", presets=presets)
    assert reference.loop.group_size == 8 and reference.outer_trainer.use == "recipe"
    for name in ("one-gpu", "one-gpu-cpu"):  # held-out triage, untrained vs final policy
        preset = load_config(preset=name, presets=presets)
        assert preset.loop.eval_initial and preset.loop.eval_families == "held_out"
    one_gpu = load_config(preset="one-gpu", presets=presets)
    assert one_gpu.gpu_backend.options()["local"] == {"slots_per_gpu": 8}
    assert one_gpu.inner_trainer.options()["local"] == {"max_train_steps": 16, "eval_size": 200}



def test_the_trainer_takes_the_family_and_loads_no_plugins(tmp_path, monkeypatch):
    """Given the run's family instance, the trainer finds the distribution that ships it from its class alone: no
    plugin is loaded on the orchestrator's side."""
    import json
    from importlib import metadata

    import pytest

    from aitrainsai import Plugins, load_family

    try:
        metadata.version("aitrainsai-family-calc-chain")
    except metadata.PackageNotFoundError:
        pytest.skip("needs the calc_chain family installed (the whole workspace)")
    family = load_family("calc_chain", "aitrainsai-family-calc-chain")

    def refuse(*args, **kwargs):
        raise AssertionError("the trainer loaded plugins")

    monkeypatch.setattr(Plugins, "load", refuse)
    trainer = LocalTrainer()
    assert trainer.family_distribution(family) == "aitrainsai-family-calc-chain"
    payload = trainer.eval_payload(family, 1, trainer.base_models[0], None, tmp_path / "eval", "e")
    assert json.loads((payload.workdir / "job.json").read_text())["distribution"] == "aitrainsai-family-calc-chain"

    class HandMade(type(family)):  # registered by hand in this process: no worker could load it
        name = "hand_made"

    assert trainer.family_distribution(HandMade()) is None
    with pytest.raises(ValueError, match="'hand_made' is not in an installed distribution"):
        trainer.eval_payload(HandMade(), 1, trainer.base_models[0], None, tmp_path / "eval", "e")
