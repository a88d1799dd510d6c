import pytest

from aitrainsai import hookimpl
from aitrainsai.families import TaskFamily
from aitrainsai.hookspecs import HookimplMarker
from aitrainsai.plugins import PluginError, Plugins, parse_selection
from aitrainsai.rewards import RewardComponent


class Echo(RewardComponent):
    name = "echo"

    def score(self, episode):
        return 1.0

    def explain(self):
        return "echo: always 1"


class EchoPlugin:
    __name__ = "echo_plugin"

    @hookimpl
    def register_reward_components(self, register):
        register(Echo)


def fresh() -> Plugins:
    plugins = Plugins()
    plugins.add_builtins()
    return plugins


def test_builtins_register_local_backend_and_reward_components():
    plugins = Plugins.load("")
    assert "local" in plugins.gpu_backends
    assert plugins.reward_components.names() == ["job_quality", "train_speed", "validation"]
    assert plugins.gpu_backends.owner("local") == "aitrainsai"


def test_a_plugin_object_registers_components():
    plugins = fresh()
    plugins.add(EchoPlugin(), name="echo", distribution="aitrainsai-echo", version="1.2")
    assert "echo" in plugins.reward_components
    info = plugins.infos["aitrainsai-echo"]
    assert info.version == "1.2" and info.components == {"reward_components": ["echo"]}


def test_duplicate_component_names_both_plugins():
    plugins = fresh()

    class Again:
        __name__ = "again"

        @hookimpl
        def register_reward_components(self, register):
            register(type("Validation2", (Echo,), {"name": "validation"}))

    plugins.add(Again(), name="again", distribution="aitrainsai-again")
    with pytest.raises(PluginError) as err:
        plugins.register_components()
    message = str(err.value)
    assert "'validation'" in message and "'aitrainsai'" in message and "'aitrainsai-again'" in message


def test_a_misspelled_hook_is_an_error_at_load_time():
    class Typo:
        __name__ = "typo"

        @hookimpl
        def register_task_familes(self, register):
            pass

    with pytest.raises(PluginError, match="register_task_familes.*did you mean 'register_task_families'"):
        fresh().add(Typo(), name="typo", distribution="aitrainsai-typo")


def test_a_foreign_marker_is_an_error_not_a_silent_no_op():
    other = HookimplMarker("aitrainsai_typo")

    class Foreign:
        __name__ = "foreign"

        @other
        def register_task_families(self, register):
            pass

    with pytest.raises(PluginError, match="implements no aitrainsai hook"):
        fresh().add(Foreign(), name="foreign", distribution="aitrainsai-foreign")


def test_an_impl_with_an_argument_the_spec_lacks_is_an_error():
    class Extra:
        __name__ = "extra"

        @hookimpl
        def register_task_families(self, register, surprise):
            pass

    with pytest.raises(PluginError, match="aitrainsai-extra"):
        fresh().add(Extra(), name="extra", distribution="aitrainsai-extra")


def test_registering_the_wrong_kind_is_an_error():
    class Wrong:
        __name__ = "wrong"

        @hookimpl
        def register_task_families(self, register):
            register(Echo)

    plugins = fresh()
    plugins.add(Wrong(), name="wrong", distribution="aitrainsai-wrong")
    with pytest.raises(PluginError, match="not a subclass of aitrainsai.families.TaskFamily"):
        plugins.register_components()


def test_bad_component_names_are_refused():
    class Bad:
        __name__ = "bad"

        @hookimpl
        def register_reward_components(self, register):
            register(type("Bad", (Echo,), {"name": "Has Spaces"}))

    plugins = fresh()
    plugins.add(Bad(), name="bad", distribution="aitrainsai-bad")
    with pytest.raises(PluginError, match="'Has Spaces'"):
        plugins.register_components()


def test_unknown_plugin_name_lists_the_installed_ones(monkeypatch):
    with pytest.raises(PluginError, match="unknown plugin 'aitrainsai-nope'.*installed plugins:"):
        Plugins.load("aitrainsai-nope")
    monkeypatch.setenv("AITRAINSAI_PLUGINS", "aitrainsai-nope-either")
    with pytest.raises(PluginError, match="aitrainsai-nope-either"):
        Plugins.load()


def test_selecting_nothing_loads_only_the_core():
    plugins = Plugins.load("")
    assert list(plugins.infos) == ["aitrainsai"]
    assert len(plugins.task_families) == 0


def test_parse_selection():
    assert parse_selection(None) is None
    assert parse_selection("") == []
    assert parse_selection(" a, b ,") == ["a", "b"]


def test_create_validates_options():
    plugins = Plugins.load("")
    component = plugins.create("reward_components", "validation", {"decay": 0.25})
    assert component.config.decay == 0.25
    with pytest.raises(Exception, match="decay"):
        plugins.create("reward_components", "validation", {"decay": 3})


def test_task_family_base_is_abstract():
    with pytest.raises(TypeError):
        TaskFamily()


def test_backends_and_trainers_register_into_their_registries():
    from aitrainsai.backends import GpuBackend
    from aitrainsai.trainers import InnerTrainer, OuterTrainer

    class Ray(GpuBackend):
        name = "ray"
        capacity = 4
        submit = wait = cancel = None

    class Prime(InnerTrainer):
        name = "prime-rl"
        base_models = ("Qwen/Qwen3-0.6B",)
        probe = payload = result = None

    class Frozen(OuterTrainer):
        name = "openai"
        policy_version = 0
        sample = update = save_state = load_state = None

    class Kinds:
        __name__ = "kinds"

        @hookimpl
        def register_gpu_backends(self, register):
            register(Ray)

        @hookimpl
        def register_inner_trainers(self, register):
            register(Prime)

        @hookimpl
        def register_outer_trainers(self, register):
            register(Frozen)

    plugins = fresh()
    plugins.add(Kinds(), name="kinds", distribution="aitrainsai-kinds")
    assert plugins.gpu_backends.names() == ["local", "ray"]
    assert plugins.inner_trainers.get("prime-rl") is Prime
    assert plugins.outer_trainers.owner("openai") == "aitrainsai-kinds"
    assert plugins.infos["aitrainsai-kinds"].components == {
        "gpu_backends": ["ray"], "inner_trainers": ["prime-rl"], "outer_trainers": ["openai"]}
