"""Plugin loading and selection, and the typed facade the rest of aitrainsai uses instead of raw ``pm.hook`` calls.

Plugins are modules named by entry points in the ``aitrainsai`` group. A plugin's name is the name of the
distribution that ships it, exactly as ``aitrainsai plugins`` prints it. ``--plugins`` or ``AITRAINSAI_PLUGINS``
selects them (:class:`Selection`): ``a,b`` loads only those distributions, ``no:a`` every one but ``a``. The core's
own built-in plugins always load. :meth:`Plugins.selection_string` is what loaded, as one selection another process
(a payload) loads again.

A plugin that cannot be loaded (its import fails, its hooks are wrong, its registration raises) is an error by
default; ``Plugins.load(..., tolerant=True)`` leaves it out instead and names it in :attr:`Plugins.broken`, so that
listings and help still work (the command line does this; a run refuses broken plugins).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, overload
from collections.abc import Iterable

import pluggy

from pydantic import BaseModel

from aitrainsai import hookspecs
from aitrainsai.components import ENTRY_POINT_GROUP, Registry, RegistryError
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    import click

    from aitrainsai.backends import JobPayload

    from aitrainsai.backends import GpuBackend
    from aitrainsai.families import TaskFamily
    from aitrainsai.rewards import RewardComponent
    from aitrainsai.trackers import Tracker
    from aitrainsai.trainers import InnerTrainer, OuterTrainer

SELECTION_VARIABLE = "AITRAINSAI_PLUGINS"
VERSIONS_VARIABLE = "AITRAINSAI_PLUGIN_VERSIONS"  # name==version,...: what a run recorded; a payload loads only these
CORE_DISTRIBUTION = "aitrainsai"
BUILTIN_PLUGINS = ("aitrainsai.builtin.local_backend", "aitrainsai.builtin.reward_components",
                   "aitrainsai.builtin.jsonl_tracker")
BLOCK_PREFIX = "no:"

Kind = Literal["task_families", "reward_components", "gpu_backends", "inner_trainers", "outer_trainers", "trackers"]
KINDS: dict[str, tuple[str, str, str]] = {
    "task_families": ("task family", "register_task_families", "aitrainsai.families:TaskFamily"),
    "reward_components": ("reward component", "register_reward_components", "aitrainsai.rewards:RewardComponent"),
    "gpu_backends": ("GPU backend", "register_gpu_backends", "aitrainsai.backends:GpuBackend"),
    "inner_trainers": ("inner trainer", "register_inner_trainers", "aitrainsai.trainers:InnerTrainer"),
    "outer_trainers": ("outer trainer", "register_outer_trainers", "aitrainsai.trainers:OuterTrainer"),
    "trackers": ("tracker", "register_trackers", "aitrainsai.trackers:Tracker"),
}


class PluginError(AitrainsaiError):
    """A plugin could not be found, loaded or registered; the message says which and why."""


@dataclass
class PluginInfo:
    """One plugin distribution and what it provides; ``error`` says why it is left out when it cannot be loaded."""

    name: str
    version: str
    modules: list[str] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)
    builtin: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "modules": self.modules,
                "components": self.components, "builtin": self.builtin, "error": self.error}


class PluginVersion(BaseModel):
    """A plugin's name and version, as a run records them."""

    name: str
    version: str


class VersionChange(BaseModel):
    """A plugin whose installed version is not the one a run recorded (``installed`` None: not installed now)."""

    name: str
    recorded: str
    installed: str | None

    def text(self) -> str:
        return f"{self.name} {self.recorded} (installed: {self.installed or 'none'})"


def canonical(name: str) -> str:
    """A distribution name as packaging compares them: case and runs of ``-``, ``_``, ``.`` do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Selection:
    """Which installed plugins load: only ``only`` when it is set, else every one but ``blocked``.

    As one string (``--plugins``, ``AITRAINSAI_PLUGINS``): ``a,b`` loads only a and b; ``no:a,no:b`` loads every
    installed plugin but a and b (pytest's ``-p no:NAME``); ``""`` loads none but the core's; unset loads every one.
    One selection either names the plugins to load or the ones to leave out: mixing the two is an error, since a
    list of the plugins to load already leaves out every other. The core cannot be left out.
    """

    only: tuple[str, ...] | None = None
    blocked: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str | Iterable[str] | Selection | None) -> Selection:
        if isinstance(value, Selection):
            return value
        names = parse_selection(value)
        if names is None:
            return cls()
        blocked = tuple(name[len(BLOCK_PREFIX):].strip() for name in names if name.startswith(BLOCK_PREFIX))
        only = tuple(name for name in names if not name.startswith(BLOCK_PREFIX))
        if blocked and only:
            raise PluginError(f"plugin selection {','.join(names)!r}: name the plugins to load (a,b) or the ones to "
                              f"leave out (no:a,no:b), not both; a list of plugins to load leaves out every other")
        if not all(blocked):
            raise PluginError(f"plugin selection {','.join(names)!r}: '{BLOCK_PREFIX}' needs a plugin name, "
                              f"e.g. {BLOCK_PREFIX}aitrainsai-outer-openai")
        if any(canonical(name) == CORE_DISTRIBUTION for name in blocked):
            raise PluginError(f"plugin selection {','.join(names)!r}: the core ({CORE_DISTRIBUTION!r}) always loads; "
                              "it cannot be left out")
        return cls(blocked=blocked) if blocked else cls(only=only)

    def includes(self, distribution: str) -> bool:
        name = canonical(distribution)
        if self.only is None:
            return name not in {canonical(blocked) for blocked in self.blocked}
        return name == CORE_DISTRIBUTION or name in {canonical(selected) for selected in self.only}

    def named(self) -> tuple[str, ...]:
        """The plugin names the selection mentions (to load, or to leave out)."""
        return self.blocked if self.only is None else self.only

    def text(self) -> str | None:
        """The selection as ``--plugins`` takes it; None for every installed plugin."""
        if self.only is None:
            return ",".join(BLOCK_PREFIX + name for name in self.blocked) or None
        return ",".join(self.only)

    def describe(self) -> str:
        text = self.text()
        return "every installed plugin" if text is None else repr(text)


def installed_plugins() -> dict[str, list[metadata.EntryPoint]]:
    """Entry points in the ``aitrainsai`` group, by distribution name."""
    found: dict[str, list[metadata.EntryPoint]] = {}
    seen: set[tuple[str, str]] = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else ep.module.split(".")[0]
        if (dist, ep.name) in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add((dist, ep.name))
        found.setdefault(dist, []).append(ep)
    return found


def parse_selection(value: str | Iterable[str] | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; ``None`` means every installed plugin; ``""`` means none but the core's.
    Entries may be ``no:NAME`` (see :class:`Selection`)."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    return [name.strip() for name in names if name.strip()]


def installed_versions() -> dict[str, str]:
    """The installed version of the core and of every plugin distribution, by :func:`canonical` name; nothing is
    imported."""
    versions = {CORE_DISTRIBUTION: _version(CORE_DISTRIBUTION)}
    for dist in installed_plugins():
        versions[canonical(dist)] = _version(dist)
    return versions


def version_changes(recorded: Iterable[PluginVersion], selection: Selection | None = None) -> list[VersionChange]:
    """The recorded plugins (those ``selection`` includes) whose installed version differs or which are gone."""
    installed = installed_versions()
    changes = []
    for plugin in recorded:
        if selection is not None and not selection.includes(plugin.name):
            continue
        now = installed.get(canonical(plugin.name))
        if now != plugin.version:
            changes.append(VersionChange(name=plugin.name, recorded=plugin.version, installed=now))
    return changes


def parse_versions(value: str) -> dict[str, str]:
    """``"a==1.0,b==2.1"`` (:data:`VERSIONS_VARIABLE`) -> ``{"a": "1.0", "b": "2.1"}``; a bad entry is a
    :class:`PluginError`."""
    versions = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        name, sep, version = entry.partition("==")
        if not (sep and name.strip() and version.strip()):
            raise PluginError(f"${VERSIONS_VARIABLE}: {entry!r} is not NAME==VERSION")
        versions[name.strip()] = version.strip()
    return versions


def check_versions(required: dict[str, str]) -> None:
    """Refuse (:class:`PluginError`, one line) when an installed version differs from the one ``required`` names,
    or the distribution is gone: a process of a run loads exactly what the run recorded."""
    installed = installed_versions()
    changes = [VersionChange(name=name, recorded=version, installed=installed.get(canonical(name)))
               for name, version in sorted(required.items()) if installed.get(canonical(name)) != version]
    if changes:
        raise PluginError("this process would load other plugin versions than its run recorded: "
                          f"{', '.join(change.text() for change in changes)}; a plugin changed while the run was going "
                          f"(reinstall the recorded versions, or resume with --allow-version-change)")


def narrow_plugin_env(env: dict[str, str], distributions: Iterable[str]) -> dict[str, str]:
    """``env``'s plugin selection and versions (a run's payload environment) narrowed to ``distributions`` (what a
    payload's runtime says its worker installs): a payload loads the run's plugins that it needs, at the run's
    versions, and no other (a worker that installs only those has no other)."""
    wanted = {canonical(name) for name in distributions}
    narrowed = dict(env)
    if env.get(SELECTION_VARIABLE) is not None:
        names = parse_selection(env[SELECTION_VARIABLE]) or []
        narrowed[SELECTION_VARIABLE] = ",".join(name for name in names if canonical(name) in wanted)
    if env.get(VERSIONS_VARIABLE) is not None:
        versions = parse_versions(env[VERSIONS_VARIABLE])
        narrowed[VERSIONS_VARIABLE] = ",".join(f"{name}=={version}" for name, version in versions.items()
                                               if canonical(name) in wanted)
    return narrowed


def with_env(payload: JobPayload, env: dict[str, str]) -> JobPayload:
    """``payload`` with ``env`` added to its environment (what the run applies in every payload process); the run's
    plugin selection and versions narrowed to the distributions its runtime names, where it names any
    (:func:`narrow_plugin_env`)."""
    if not env:
        return payload
    if payload.runtime.distributions:
        env = narrow_plugin_env(env, payload.runtime.distributions)
    return payload.model_copy(update={"env": {**payload.env, **env}})


def way_out(distribution: str) -> str:
    """How to run without a plugin that cannot be loaded."""
    return (f"leave it out with --plugins {BLOCK_PREFIX}{distribution} (or {SELECTION_VARIABLE}), "
            f"or uninstall it (pip uninstall {distribution})")


class _Failure(Exception):
    """A plugin failed while its components were registered: ``owner`` is to blame."""

    def __init__(self, owner: str, error: PluginError):
        super().__init__(str(error))
        self.owner = owner
        self.error = error


class Plugins:
    """The loaded plugins and one registry per component kind.

    Build one with :meth:`load`; tests build one with ``autoload=False`` and :meth:`add` their own plugin objects.
    """

    def __init__(self, *, tolerant: bool = False) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.tolerant = tolerant
        self.selection = Selection()
        self.broken: dict[str, PluginInfo] = {}  # installed and selected, but left out: they cannot be loaded
        self.left_out: list[str] = []  # installed, not selected
        self._installed: set[str] = set()  # loaded from entry points (not built in, not added by hand)
        self._aside: dict[str, dict[str, str]] | None = None
        self._plugin_owner: dict[str, str] = {}
        self._registries: dict[str, Registry] = {kind: Registry(label, _resolve(base)) for kind, (label, _, base)
                                                 in KINDS.items()}
        self._registered = False

    # -- typed registries --------------------------------------------------------------------------------------
    @property
    def registries(self) -> dict[str, Registry]:
        """Every registry by kind, components registered."""
        self._ensure_registered()
        return self._registries

    @property
    def task_families(self) -> Registry[TaskFamily]:
        return self.registries["task_families"]

    @property
    def reward_components(self) -> Registry[RewardComponent]:
        return self.registries["reward_components"]

    @property
    def gpu_backends(self) -> Registry[GpuBackend]:
        return self.registries["gpu_backends"]

    @property
    def inner_trainers(self) -> Registry[InnerTrainer]:
        return self.registries["inner_trainers"]

    @property
    def outer_trainers(self) -> Registry[OuterTrainer]:
        return self.registries["outer_trainers"]

    @property
    def trackers(self) -> Registry[Tracker]:
        return self.registries["trackers"]

    # -- loading -----------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, selection: str | Iterable[str] | Selection | None = None, *, builtins: bool = True,
             tolerant: bool = False) -> Plugins:
        """Load the built-in plugins and the installed ones ``selection`` includes (else ``AITRAINSAI_PLUGINS``'s).

        A selected plugin that cannot be loaded is a :class:`PluginError`, or with ``tolerant`` is left out and
        named in :attr:`broken` (see :meth:`check_loaded`). Where ``AITRAINSAI_PLUGIN_VERSIONS`` is set (a run's
        payload), an installed version other than the one it names is a :class:`PluginError` before anything loads."""
        plugins = cls(tolerant=tolerant)
        if selection is None:
            selection = os.environ.get(SELECTION_VARIABLE)
            if os.environ.get(VERSIONS_VARIABLE):
                check_versions(parse_versions(os.environ[VERSIONS_VARIABLE]))
        if builtins:
            plugins.add_builtins()
        plugins.add_installed(Selection.parse(selection))
        plugins.register_components()
        return plugins

    def add_builtins(self) -> None:
        import importlib

        version = _version(CORE_DISTRIBUTION)
        for module_name in BUILTIN_PLUGINS:
            self.add(importlib.import_module(module_name), name=module_name, distribution=CORE_DISTRIBUTION,
                     version=version, builtin=True)

    def add_installed(self, selection: Selection | str | Iterable[str] | None) -> None:
        """Load the installed plugins ``selection`` includes; naming one that is not installed is an error."""
        self.selection = selection = Selection.parse(selection)
        installed = installed_plugins()
        known = {canonical(dist) for dist in installed} | {CORE_DISTRIBUTION}
        unknown = [name for name in selection.named() if canonical(name) not in known]
        if unknown:
            raise PluginError(_unknown_plugins(unknown, installed))
        for dist, entry_points in sorted(installed.items()):
            if not selection.includes(dist):
                self.left_out.append(dist)
                continue
            try:
                self._add_distribution(dist, entry_points)
            except PluginError as exc:
                if not self.tolerant:
                    raise
                self._set_broken(dist, exc)

    def _add_distribution(self, dist: str, entry_points: list[metadata.EntryPoint]) -> None:
        version = _version(dist)
        for ep in entry_points:
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginError(f"plugin {dist!r}: entry point {ep.name} = {ep.value} failed to import: "
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())}; {way_out(dist)}") from exc
            self.add(module, name=f"{dist}:{ep.name}", distribution=dist, version=version)
        self._installed.add(dist)

    def _set_broken(self, dist: str, error: PluginError) -> None:
        """Leave ``dist`` out: unregister what it added and remember why."""
        for name, owner in list(self._plugin_owner.items()):
            if owner == dist:
                self.pm.unregister(name=name)
                del self._plugin_owner[name]
        self.infos.pop(dist, None)
        self._installed.discard(dist)
        self.broken[dist] = PluginInfo(dist, _version(dist), error=str(error))
        self._registered = False

    def add(self, plugin: ModuleType | object, *, name: str, distribution: str | None = None,
            version: str = "0", builtin: bool = False) -> None:
        """Register one plugin object (a module, or any object with ``@hookimpl`` methods) and check its hooks."""
        distribution = distribution or name
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {distribution!r}: {exc}") from exc
        impls = self.pm.get_hookcallers(plugin) or []
        unknown = [caller.name for caller in impls if not caller.has_spec()]
        if unknown:
            self.pm.unregister(plugin)
            specs = [n for n in dir(hookspecs) if n.startswith("register_")]
            details = []
            for hook in unknown:
                close = difflib.get_close_matches(hook, specs, 1)
                details.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise PluginError(f"plugin {distribution!r} implements hook {', '.join(details)}, which matches no "
                              f"aitrainsai hook spec; the hooks are: {', '.join(specs)}")
        if not impls:
            self.pm.unregister(plugin)
            raise PluginError(f"plugin {distribution!r} ({name}) implements no aitrainsai hook: decorate its functions "
                              "with aitrainsai.hookimpl (from the aitrainsai package, not a marker of your own)")
        info = self.infos.setdefault(distribution, PluginInfo(distribution, version, builtin=builtin))
        info.modules.append(getattr(plugin, "__name__", name))
        self._plugin_owner[name] = distribution
        self._registered = False

    def register_components(self) -> None:
        """Call every ``register_*`` hook, one implementation at a time, so each component has a known owner.
        With ``tolerant``, a plugin whose registration fails is left out (:meth:`_set_broken`) and the rest
        registered again."""
        while True:
            try:
                self._register_all()
                return
            except _Failure as failure:
                owner_info = self.infos.get(failure.owner)
                if (not self.tolerant or owner_info is None or owner_info.builtin
                        or failure.owner not in self._installed):
                    raise failure.error from failure.error.__cause__
                self._set_broken(failure.owner, failure.error)

    def _register_all(self) -> None:
        for registry in self._registries.values():
            registry.clear()
        for info in self.infos.values():
            info.components = {}
        for kind, (_, hook_name, _) in KINDS.items():
            registry = self._registries[kind]
            caller = getattr(self.pm.hook, hook_name)
            for impl in reversed(caller.get_hookimpls()):  # registration order
                owner = self._plugin_owner.get(impl.plugin_name, impl.plugin_name)

                def register(component, _owner=owner, _registry=registry, _kind=kind):
                    try:
                        _registry.register(component, plugin=_owner)
                    except RegistryError as exc:
                        raise PluginError(str(exc)) from exc
                    self.infos[_owner].components.setdefault(_kind, []).append(component.name)

                try:
                    impl.function(*[{"register": register}[arg] for arg in impl.argnames])
                except PluginError as exc:
                    raise _Failure(owner, exc) from exc
                except Exception as exc:  # the plugin's own code raised
                    error = PluginError(f"plugin {owner!r}: {hook_name} raised {type(exc).__name__}: "
                                        f"{' '.join(str(exc).split())}")
                    error.__cause__ = exc
                    raise _Failure(owner, error) from exc
        self._registered = True

    def _ensure_registered(self) -> None:
        if not self._registered:
            self.register_components()

    @property
    def presets(self) -> dict[str, Path]:
        """Preset run configs by name, from every plugin's ``register_presets``; a name registered twice is an
        error naming both plugins."""
        found: dict[str, Path] = {}
        owners: dict[str, str] = {}
        for impl in reversed(self.pm.hook.register_presets.get_hookimpls()):
            owner = self._plugin_owner.get(impl.plugin_name, impl.plugin_name)

            def register(name: str, path: Path | str, _owner: str = owner) -> None:
                if name in found:
                    raise PluginError(f"two plugins register a preset named {name!r}: {owners[name]!r} and {_owner!r}")
                found[name], owners[name] = Path(path), _owner

            impl.function(register=register)
        return found

    def register_commands(self, cli: click.Group) -> None:
        """Let every plugin add its commands; one that raises is an error, or with ``tolerant`` is left out."""
        for impl in reversed(self.pm.hook.register_commands.get_hookimpls()):
            owner = self._plugin_owner.get(impl.plugin_name, impl.plugin_name)
            try:
                impl.function(cli=cli)
            except Exception as exc:
                error = PluginError(f"plugin {owner!r}: register_commands raised {type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())}")
                if not self.tolerant or owner not in self._installed:
                    raise error from exc
                self._set_broken(owner, error)

    # -- selection, versions, what is missing --------------------------------------------------------------------
    def selection_string(self) -> str:
        """The installed plugins loaded here, as one selection (``a,b``; ``""`` for only the core's): what
        ``AITRAINSAI_PLUGINS`` holds for another process (a payload, a resumed run) to load exactly these again."""
        return ",".join(sorted(self._installed))

    def versions_string(self) -> str:
        """The core's and every installed loaded plugin's version as ``AITRAINSAI_PLUGIN_VERSIONS`` holds them
        (``name==version,...``): what a payload process must find installed."""
        names = [CORE_DISTRIBUTION, *sorted(self._installed)]
        return ",".join(f"{name}=={_version(name)}" for name in names)

    def versions(self) -> list[PluginVersion]:
        """Every loaded plugin's name and version, the core's included: what a run records."""
        return [PluginVersion(name=info.name, version=info.version) for info in self.plugin_list()]

    def check_loaded(self) -> None:
        """Refuse (:class:`PluginError`, one line) when a selected plugin could not be loaded: a run needs all."""
        if self.broken:
            raise PluginError("; ".join(f"plugin {info.name!r} cannot be loaded ({_reason(info)}); a run needs every "
                                        f"selected plugin: {way_out(info.name)}" for info in self.broken.values()))

    def broken_warnings(self) -> list[str]:
        """One line per plugin left out because it cannot be loaded, with the way out."""
        return [f"plugin {info.name!r} cannot be loaded and is left out ({_reason(info)}); {way_out(info.name)}"
                for info in self.broken.values()]

    def explain_missing(self, registry: Registry, name: str) -> str | None:
        """Why component ``name`` is not in ``registry`` when the plugin selection or a broken plugin is the
        reason (naming the distribution that provides it); None when it is simply not installed."""
        kind = next((key for key, value in self._registries.items() if value is registry), None)
        loaded = ", ".join(registry.names()) or "none loaded"
        owner = self._components_left_out().get(kind or "", {}).get(name)
        if owner is not None:
            return (f"no {registry.kind} named {name!r} is loaded: it is installed, in plugin {owner!r}, which the "
                    f"plugin selection ({self.selection.describe()}, from --plugins or {SELECTION_VARIABLE}) leaves "
                    f"out; select {owner} too, or drop the selection (loaded: {loaded})")
        if self.broken:
            return (f"no {registry.kind} named {name!r} (loaded: {loaded}); plugins that cannot be loaded may provide "
                    f"it: {', '.join(sorted(self.broken))}")
        if self.left_out:
            return f"no {registry.kind} named {name!r} (loaded: {loaded}; no installed plugin provides it)"
        return None

    def _components_left_out(self) -> dict[str, dict[str, str]]:
        """kind -> component name -> distribution, for the installed plugins the selection leaves out (loaded aside,
        on demand, for messages only)."""
        if self._aside is None:
            installed = installed_plugins()
            self._aside = _components_of({dist: installed[dist] for dist in self.left_out if dist in installed})
        return self._aside

    # -- queries -----------------------------------------------------------------------------------------------
    def plugin_list(self, include_builtin: bool = True) -> list[PluginInfo]:
        self._ensure_registered()
        return [info for _, info in sorted(self.infos.items()) if include_builtin or not info.builtin]

    @overload
    def create(self, kind: Literal["task_families"], name: str, config: Any = None, **kwargs: Any) -> TaskFamily: ...
    @overload
    def create(self, kind: Literal["reward_components"], name: str, config: Any = None,
               **kwargs: Any) -> RewardComponent: ...
    @overload
    def create(self, kind: Literal["gpu_backends"], name: str, config: Any = None, **kwargs: Any) -> GpuBackend: ...
    @overload
    def create(self, kind: Literal["inner_trainers"], name: str, config: Any = None,
               **kwargs: Any) -> InnerTrainer: ...
    @overload
    def create(self, kind: Literal["outer_trainers"], name: str, config: Any = None,
               **kwargs: Any) -> OuterTrainer: ...
    @overload
    def create(self, kind: Literal["trackers"], name: str, config: Any = None, **kwargs: Any) -> Tracker: ...

    def create(self, kind: Kind, name: str, config: Any = None, **kwargs: Any) -> Any:
        """Instantiate component ``name`` of ``kind`` (see :meth:`Registry.create`); its type is the kind's."""
        if kind not in KINDS:
            raise PluginError(f"no component kind {kind!r}; the kinds are {', '.join(KINDS)}")
        return self.registries[kind].create(name, config, **kwargs)


def load_family(name: str, distribution: str) -> TaskFamily:
    """Task family ``name`` from the installed plugin ``distribution``, loading no other plugin: what a payload
    process that needs one family does. A :class:`PluginError` (one line) when ``AITRAINSAI_PLUGIN_VERSIONS`` is set
    and an installed version differs from it, when ``AITRAINSAI_PLUGINS`` is set and leaves ``distribution`` out,
    when ``distribution`` is not installed or cannot be loaded, or when it registers no family ``name``."""
    if os.environ.get(VERSIONS_VARIABLE):
        check_versions(parse_versions(os.environ[VERSIONS_VARIABLE]))
    selection = os.environ.get(SELECTION_VARIABLE)
    if selection is not None and not Selection.parse(selection).includes(distribution):
        raise PluginError(f"the task family {name!r} is in plugin {distribution!r}, which this process's plugin "
                          f"selection (${SELECTION_VARIABLE}={selection!r}) leaves out")
    registry = Plugins.load([distribution], builtins=False).task_families
    if name not in registry:
        raise PluginError(f"plugin {distribution!r} registers no task family named {name!r} "
                          f"(it has: {', '.join(registry.names()) or 'none'})")
    return registry.create(name)


def _components_of(distributions: dict[str, list[metadata.EntryPoint]]) -> dict[str, dict[str, str]]:
    """kind -> component name -> distribution for ``distributions``, loaded in a plugin manager of their own;
    those that cannot be loaded are skipped."""
    aside = Plugins(tolerant=True)
    for dist, entry_points in sorted(distributions.items()):
        try:
            aside._add_distribution(dist, entry_points)
        except PluginError as exc:
            aside._set_broken(dist, exc)
    aside.register_components()
    return {kind: {name: registry.owner(name) for name in registry.names()}
            for kind, registry in aside._registries.items()}


def _unknown_plugins(unknown: list[str], installed: dict[str, list[metadata.EntryPoint]]) -> str:
    """A selection names plugins that are not installed: say so, with the distribution meant where we can tell (a
    close name, or a component or entry-point name a distribution provides)."""
    hints = []
    provided: dict[str, dict[str, str]] | None = None
    for name in unknown:
        close = difflib.get_close_matches(name, list(installed), 1)
        if close:
            hints.append(f"did you mean {close[0]}?")
            continue
        if provided is None:
            provided = _components_of(installed)
        owners = {(_article(KINDS[kind][0]), components[name]) for kind, components in provided.items()
                  if name in components}
        owners = owners or {("an entry point", dist) for dist, eps in installed.items()
                            if any(ep.name == name for ep in eps)}
        if owners:
            what = " and ".join(f"{label} of plugin {dist!r}" for label, dist in sorted(owners))
            dists = ",".join(sorted({dist for _, dist in owners}))
            hints.append(f"{name!r} is {what}: select the distribution, --plugins {dists}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    available = ", ".join(sorted(installed)) or "none"
    return f"unknown plugin {', '.join(map(repr, unknown))}{hint}; installed plugins: {available}"


def _article(label: str) -> str:
    return ("an " if label[0] in "aeiou" else "a ") + label


def _reason(info: PluginInfo) -> str:
    """The error of a broken plugin without its way out (said once, by the caller)."""
    text = info.error or "unknown error"
    return text.split(f"; {way_out(info.name)}")[0].removeprefix(f"plugin {info.name!r}: ")


def _resolve(path: str) -> type:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"
