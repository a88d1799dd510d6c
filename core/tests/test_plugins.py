import pytest

from aitrainsai import hookimpl
from aitrainsai.families import TaskFamily
from aitrainsai.hookspecs import HookimplMarker
from aitrainsai.plugins import PluginError, Plugins, PluginVersion, Selection, parse_selection, version_changes
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


def test_backends_trainers_and_trackers_register_into_their_registries():
    from aitrainsai.backends import GpuBackend
    from aitrainsai.trackers import Tracker
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

    class Board(Tracker):
        name = "board"
        start = log = None

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

        @hookimpl
        def register_trackers(self, register):
            register(Board)

    plugins = fresh()
    plugins.add(Kinds(), name="kinds", distribution="aitrainsai-kinds")
    assert plugins.gpu_backends.names() == ["local", "ray"]
    assert plugins.inner_trainers.get("prime-rl") is Prime
    assert plugins.outer_trainers.owner("openai") == "aitrainsai-kinds"
    assert plugins.trackers.names() == ["board", "jsonl"]
    assert plugins.infos["aitrainsai-kinds"].components == {
        "gpu_backends": ["ray"], "inner_trainers": ["prime-rl"], "outer_trainers": ["openai"], "trackers": ["board"]}


# -- selection (no:NAME), broken plugins, what is missing: installed plugins faked by entry points -------------------
FAKE_SOURCES = {
    "aitrainsai-fake-alpha": '''
from aitrainsai import hookimpl
from aitrainsai.rewards import RewardComponent


class Alpha(RewardComponent):
    name = "alpha"

    def score(self, episode):
        return 1.0

    def explain(self):
        return "alpha"


@hookimpl
def register_reward_components(register):
    register(Alpha)
''',
    "aitrainsai-fake-beta": '''
from aitrainsai import hookimpl
from aitrainsai.rewards import RewardComponent


class Beta(RewardComponent):
    name = "beta"

    def score(self, episode):
        return 0.0

    def explain(self):
        return "beta"


@hookimpl
def register_reward_components(register):
    register(Beta)
''',
    "aitrainsai-fake-broken": "raise ImportError('the module it needs is not installed')\n",
    "aitrainsai-fake-raises": '''
from aitrainsai import hookimpl


@hookimpl
def register_reward_components(register):
    raise RuntimeError("cannot read my data file")
''',
}


@pytest.fixture
def fake_installed(monkeypatch, tmp_path):
    """Replace the installed plugins by the fakes above (``which``: their names), each version 1.0."""
    from importlib import metadata

    import aitrainsai.plugins as plugins_module

    def install(*which: str) -> None:
        entry_points = {}
        for dist in which:
            module = dist.replace("-", "_")
            (tmp_path / f"{module}.py").write_text(FAKE_SOURCES[dist])
            entry_points[dist] = [metadata.EntryPoint(dist.rsplit("-", 1)[1], module, "aitrainsai")]
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(plugins_module, "installed_plugins", lambda: dict(entry_points))
        monkeypatch.setattr(plugins_module, "_version", lambda dist: "0.1.0" if dist == "aitrainsai" else "1.0")

    monkeypatch.delenv("AITRAINSAI_PLUGINS", raising=False)
    return install


def test_selection_syntax():
    assert Selection.parse(None) == Selection()
    assert Selection.parse("") == Selection(only=())
    assert Selection.parse("a, b") == Selection(only=("a", "b"))
    assert Selection.parse("no:a,no: b") == Selection(blocked=("a", "b"))
    assert Selection.parse("no:a").text() == "no:a" and Selection.parse("a,b").text() == "a,b"
    assert Selection.parse(None).text() is None and Selection.parse("").text() == ""
    assert Selection.parse("no:Aitrainsai_Fake.Alpha").includes("aitrainsai-fake-beta")
    assert not Selection.parse("no:Aitrainsai_Fake.Alpha").includes("aitrainsai-fake-alpha")
    assert Selection.parse("").includes("aitrainsai") and not Selection.parse("").includes("x")
    with pytest.raises(PluginError, match="not both"):
        Selection.parse("a,no:b")
    with pytest.raises(PluginError, match="needs a plugin name"):
        Selection.parse("no:")
    with pytest.raises(PluginError, match="always loads"):
        Selection.parse("no:aitrainsai")


def test_no_name_loads_every_other_plugin_and_the_selection_travels_as_one_string(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    plugins = Plugins.load("no:aitrainsai-fake-alpha")
    assert [info.name for info in plugins.plugin_list()] == ["aitrainsai", "aitrainsai-fake-beta"]
    assert "alpha" not in plugins.reward_components and "beta" in plugins.reward_components
    assert plugins.selection_string() == "aitrainsai-fake-beta"
    again = Plugins.load(plugins.selection_string())  # what a payload process loads
    assert [info.name for info in again.plugin_list()] == ["aitrainsai", "aitrainsai-fake-beta"]
    assert Plugins.load("").selection_string() == ""
    assert Plugins.load().selection_string() == "aitrainsai-fake-alpha,aitrainsai-fake-beta"
    assert [(v.name, v.version) for v in plugins.versions()] == [("aitrainsai", "0.1.0"),
                                                                 ("aitrainsai-fake-beta", "1.0")]


def test_no_name_of_a_plugin_not_installed_is_an_error_with_a_hint(fake_installed):
    fake_installed("aitrainsai-fake-alpha")
    with pytest.raises(PluginError,
                       match=r"unknown plugin 'aitrainsai-fake-alph' \(did you mean aitrainsai-fake-alpha"):
        Plugins.load("no:aitrainsai-fake-alph")


def test_a_component_name_in_the_selection_names_the_distribution_that_ships_it(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    with pytest.raises(PluginError) as err:
        Plugins.load("beta")
    assert ("'beta' is a reward component of plugin 'aitrainsai-fake-beta': select the distribution, --plugins "
            "aitrainsai-fake-beta") in str(err.value)


def test_a_component_left_out_by_the_selection_is_explained(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    plugins = Plugins.load("aitrainsai-fake-beta")
    message = plugins.explain_missing(plugins.reward_components, "alpha")
    assert "installed, in plugin 'aitrainsai-fake-alpha'" in message and "leaves out" in message
    assert "none installed" not in message
    assert "no installed plugin provides it" in plugins.explain_missing(plugins.reward_components, "gamma")
    assert Plugins.load().explain_missing(plugins.reward_components, "gamma") is None


def test_a_broken_plugin_is_an_error_naming_the_way_out(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-broken")
    with pytest.raises(PluginError) as err:
        Plugins.load()
    message = str(err.value)
    assert "'aitrainsai-fake-broken'" in message and "the module it needs is not installed" in message
    assert "--plugins no:aitrainsai-fake-broken" in message and "pip uninstall aitrainsai-fake-broken" in message
    assert "alpha" in Plugins.load("no:aitrainsai-fake-broken").reward_components


@pytest.mark.parametrize("broken", ["aitrainsai-fake-broken", "aitrainsai-fake-raises"])
def test_tolerant_loading_leaves_a_broken_plugin_out_and_names_it(fake_installed, broken):
    fake_installed("aitrainsai-fake-alpha", broken)
    plugins = Plugins.load(tolerant=True)
    assert list(plugins.broken) == [broken] and broken not in plugins.infos
    assert "alpha" in plugins.reward_components
    assert plugins.selection_string() == "aitrainsai-fake-alpha"
    (warning,) = plugins.broken_warnings()
    assert f"no:{broken}" in warning and "left out" in warning
    with pytest.raises(PluginError, match=f"a run needs every selected plugin.*no:{broken}"):
        plugins.check_loaded()
    assert "may provide it: " + broken in plugins.explain_missing(plugins.reward_components, "gamma")


def test_version_changes(fake_installed):
    fake_installed("aitrainsai-fake-alpha")
    recorded = [PluginVersion(name="aitrainsai", version="0.1.0"), PluginVersion(name="aitrainsai-fake-alpha",
                                                                                 version="0.9"),
                PluginVersion(name="aitrainsai-fake-gone", version="2.0")]
    changes = version_changes(recorded)
    assert [(c.name, c.recorded, c.installed) for c in changes] == [("aitrainsai-fake-alpha", "0.9", "1.0"),
                                                                    ("aitrainsai-fake-gone", "2.0", None)]
    assert version_changes(recorded, Selection.parse("no:aitrainsai-fake-gone")) == changes[:1]


def test_create_names_every_kind_and_refuses_another_in_one_line():
    from typing import get_args

    from aitrainsai.plugins import KINDS, Kind, Plugins

    assert set(get_args(Kind)) == set(KINDS)  # the typed overloads cover every kind
    with pytest.raises(PluginError, match="no component kind 'families'; the kinds are task_families, "):
        Plugins.load().create("families", "calc_chain")  # type: ignore[call-overload]
