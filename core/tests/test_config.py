import pytest

from aitrainsai.config import ConfigError, load_config, parse_override, resolve
from aitrainsai.families import Item, TaskFamily
from aitrainsai.plugins import Plugins


class Train(TaskFamily):
    name = "train_me"
    goal = system_prompt = "x"

    def generate(self, seed, level, n):
        return [Item(family=self.name, level=level, seed=seed, index=i, question=f"q{i}", answer="a") for i in range(n)]

    def solve(self, item, session):
        return "a"


class Held(Train):
    name = "held"
    held_out = True


class Families:
    __name__ = "families"

    from aitrainsai import hookimpl

    @hookimpl
    def register_task_families(self, register):
        register(Train)
        register(Held)


@pytest.fixture
def plugins():
    p = Plugins()
    p.add_builtins()
    p.add(Families(), name="families", distribution="test-families")
    return p


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def problems(exc: ConfigError) -> dict[str, str]:
    return dict(exc.problems)


def test_defaults_load():
    config = load_config()
    assert config.loop.steps >= 1 and config.gpu_backend.use is None  # the core chooses no component


def test_bad_value_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "[loop]\nsteps = -3\ngroup_size = 'many'\n"))
    found = problems(err.value)
    assert "greater than or equal to 1" in found["loop.steps"]
    assert "integer" in found["loop.group_size"]
    assert str(tmp_path / "run.toml") in str(err.value)


def test_unknown_keys_are_rejected_with_their_path(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "colour = 'red'\n[loop]\nstepz = 3\n"))
    assert problems(err.value) == {"colour": "unknown key", "loop.stepz": "unknown key"}


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[loop\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")


def test_overrides_parse_as_toml_and_override_the_file(tmp_path):
    config = load_config(write(tmp_path, "[loop]\nsteps = 3\n"), ["loop.steps=7", "name=my run", "loop.seed=-2"])
    assert config.loop.steps == 7 and config.name == "my run" and config.loop.seed == -2
    assert parse_override("families.train=['a','b']") == (["families", "train"], ["a", "b"])
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_override("loop.steps")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["loop.nope=1"])
    assert problems(err.value) == {"loop.nope": "unknown key"}


def test_component_options_are_validated_by_the_component(plugins):
    config = load_config(None, ["gpu_backend.local.workers=0", "gpu_backend.local.colour=1",
                                "families.train=['train_me']", "families.held_out=['held']"])
    with pytest.raises(ConfigError) as err:
        resolve(config, plugins)
    found = problems(err.value)
    assert "greater than or equal to 1" in found["gpu_backend.local.workers"]
    assert found["gpu_backend.local.colour"] == "unknown key"


def test_unknown_component_names_list_what_is_available(plugins):
    config = load_config(None, ["gpu_backend.use=ray", "gpu_backend.runpod.pods=2", "families.train=['nope']"])
    with pytest.raises(ConfigError) as err:
        resolve(config, plugins)
    found = problems(err.value)
    assert found["gpu_backend.use"] == "no GPU backend named 'ray' (available: local)"
    assert "no GPU backend named 'runpod'" in found["gpu_backend.runpod"]
    assert "available: held, train_me" in found["families.train[0]"]


def test_a_held_out_family_in_training_is_refused(plugins):
    config = load_config(None, ["families.train=['train_me','held']", "families.held_out=[]",
                                "inner_trainer.use=local", "outer_trainer.use=recipe"])
    with pytest.raises(ConfigError) as err:
        resolve(config, plugins)
    assert "'held' is a held-out family" in problems(err.value)["families.train"]


def test_resolved_config_fills_component_defaults(plugins):
    config = load_config(None, ["families.train=['train_me']", "families.held_out=['held']"])
    with pytest.raises(ConfigError) as err:  # no trainers installed in this plugin set
        resolve(config, plugins)
    assert set(problems(err.value)) == {"inner_trainer.use", "outer_trainer.use"}
    plugins.registries["inner_trainers"]._components["local"] = _Trainer
    plugins.registries["outer_trainers"]._components["recipe"] = _Trainer
    resolved = resolve(config, plugins)  # one component of a kind installed: it is the default
    assert resolved.gpu_backend.use == "local" and resolved.gpu_backend.config.workers == 1
    assert resolved.snapshot()["gpu_backend"] == {"use": "local", "local": {"workers": 1, "slots_per_gpu": None,
                                                                   "threads_per_payload": None,
                                                                   "kill_grace_s": 5.0}}
    assert resolved.families.train == ["train_me"] and resolved.loop.steps == 2


def test_families_default_to_every_installed_one_split_by_held_out(plugins):
    plugins.registries["inner_trainers"]._components["local"] = _Trainer
    resolved = resolve(load_config(), plugins, outer=False)
    assert (resolved.families.train, resolved.families.held_out) == (["train_me"], ["held"])
    assert resolved.outer_trainer is None and "outer_trainer" not in resolved.snapshot()


def test_two_components_of_a_kind_and_no_choice_is_an_error_naming_both(plugins):
    plugins.registries["inner_trainers"]._components["local"] = _Trainer
    plugins.registries["inner_trainers"]._components["remote"] = _Trainer
    with pytest.raises(ConfigError) as err:
        resolve(load_config(), plugins, outer=False)
    assert problems(err.value) == {"inner_trainer.use": "choose a inner trainer: local, remote"}


def test_a_recorded_config_resolves_to_the_same_config(plugins):
    from aitrainsai.config import resolve_snapshot

    plugins.registries["inner_trainers"]._components["local"] = _Trainer
    resolved = resolve(load_config(None, ["gpu_backend.local.workers=3", "loop.steps=7"]), plugins, outer=False)
    again = resolve_snapshot(resolved.snapshot(), plugins)
    assert again == resolved and again.gpu_backend.config.workers == 3


def test_trackers_are_chosen_by_name_with_their_options_and_may_change_on_resume(plugins, tmp_path):
    from aitrainsai.config import resolve_snapshot, resume_overrides

    plugins.registries["inner_trainers"]._components["local"] = _Trainer
    bad = load_config(None, ["trackers=['jsonl', 'nope', 'jsonl']", "tracker.jsonl.colour=1", "tracker.other.a=1"])
    with pytest.raises(ConfigError) as err:
        resolve(bad, plugins, outer=False)
    assert problems(err.value) == {"trackers[1]": "no tracker named 'nope' (available: jsonl)",
                                   "trackers[2]": "'jsonl' is listed twice", "tracker.jsonl.colour": "unknown key",
                                   "tracker.other": "options for a tracker this run does not use (trackers = "
                                                    "['jsonl', 'nope', 'jsonl'])"}
    plain = resolve(load_config(), plugins, outer=False)
    assert "trackers" not in plain.snapshot() and "tracker" not in plain.snapshot()  # recorded as before trackers
    chosen = resolve(load_config(None, ["trackers=['jsonl']", f"tracker.jsonl.path='{tmp_path / 'p.jsonl'}'"]),
                     plugins, outer=False)
    assert chosen.snapshot()["trackers"] == ["jsonl"] and resolve_snapshot(chosen.snapshot(), plugins) == chosen
    resumed = resume_overrides(plain.snapshot(), ["trackers=['jsonl']"], plugins)
    assert resolve_snapshot(resumed, plugins).trackers["jsonl"].path is None
    with pytest.raises(ConfigError, match="cannot change when a run resumes"):
        resume_overrides(plain.snapshot(), ["loop.steps=9"], plugins)


def test_the_core_names_no_plugin_component_as_a_default():
    from aitrainsai.config import RunConfig

    config = RunConfig()
    assert (config.gpu_backend.use, config.inner_trainer.use, config.outer_trainer.use) == (None, None, None)
    assert (config.families.train, config.families.held_out) == (None, None)


class _Trainer:
    from aitrainsai.components import ComponentConfig as Config


def test_presets_layer_over_the_default_and_files_override_them(tmp_path):
    (tmp_path / "default.toml").write_text('about = "x"\n[outer_trainer]\nuse = "recipe"\n[loop]\nsteps = 9\n')
    (tmp_path / "big.toml").write_text("[loop]\ngroup_size = 8\ngroups_per_step = 5\n")
    presets = {"default": tmp_path / "default.toml", "big": tmp_path / "big.toml"}
    default = load_config(presets=presets)
    assert default.outer_trainer.use == "recipe" and default.loop.steps == 9
    big = load_config(preset="big", presets=presets)
    assert (big.loop.group_size, big.loop.groups_per_step, big.loop.steps) == (8, 5, 9)  # over the default
    over = load_config(write(tmp_path, "[loop]\ngroup_size = 4\n"), ["loop.steps=3"], preset="big", presets=presets)
    assert (over.loop.group_size, over.loop.groups_per_step, over.loop.steps) == (4, 5, 3)
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        load_config(preset="huge", presets=presets)
    assert load_config().outer_trainer.use is None  # no preset installed: the core chooses nothing


def test_a_preset_name_registered_twice_names_both_plugins(tmp_path):
    from aitrainsai import hookimpl
    from aitrainsai.plugins import PluginError

    class Presets:
        __name__ = "presets"

        def __init__(self, name):
            self.name = name

        @hookimpl
        def register_presets(self, register):
            register("mine", tmp_path / f"{self.name}.toml")

    p = Plugins()
    p.add(Presets("a"), name="a", distribution="dist-a")
    p.add(Presets("b"), name="b", distribution="dist-b")
    with pytest.raises(PluginError, match="two plugins register a preset named 'mine': 'dist-[ab]' and 'dist-[ab]'"):
        _ = p.presets
