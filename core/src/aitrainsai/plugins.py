"""Plugin loading and selection, and the typed facade the rest of aitrainsai uses instead of raw ``pm.hook`` calls.

Plugins are modules named by entry points in the ``aitrainsai`` group. A plugin's name is the name of the
distribution that ships it, exactly as ``aitrainsai plugins`` prints it; ``--plugins a,b`` or ``AITRAINSAI_PLUGINS``
restricts loading to those distributions. The core's own built-in plugins always load.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

from aitrainsai import hookspecs
from aitrainsai.components import Registry, RegistryError

if TYPE_CHECKING:
    import click

ENTRY_POINT_GROUP = "aitrainsai"
SELECTION_VARIABLE = "AITRAINSAI_PLUGINS"
CORE_DISTRIBUTION = "aitrainsai"
BUILTIN_PLUGINS = ("aitrainsai.builtin.local_backend", "aitrainsai.builtin.reward_components")

KINDS = {
    "task_families": ("task family", "register_task_families", "aitrainsai.families:TaskFamily"),
    "reward_components": ("reward component", "register_reward_components", "aitrainsai.rewards:RewardComponent"),
    "gpu_backends": ("GPU backend", "register_gpu_backends", "aitrainsai.backends:GpuBackend"),
    "inner_trainers": ("inner trainer", "register_inner_trainers", "aitrainsai.trainers:InnerTrainer"),
    "outer_trainers": ("outer trainer", "register_outer_trainers", "aitrainsai.trainers:OuterTrainer"),
}


class PluginError(Exception):
    """A plugin could not be found, loaded or registered; the message says which and why."""


@dataclass
class PluginInfo:
    """One loaded plugin distribution and what it provides."""

    name: str
    version: str
    modules: list[str] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)
    builtin: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "modules": self.modules,
                "components": self.components, "builtin": self.builtin}


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
    """``"a, b"`` -> ``["a", "b"]``; ``None`` means every installed plugin; ``""`` means none but the core's."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    return [name.strip() for name in names if name.strip()]


class Plugins:
    """The loaded plugins and one registry per component kind.

    Build one with :meth:`load`; tests build one with ``autoload=False`` and :meth:`add` their own plugin objects.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
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
    def task_families(self) -> Registry:
        return self.registries["task_families"]

    @property
    def reward_components(self) -> Registry:
        return self.registries["reward_components"]

    @property
    def gpu_backends(self) -> Registry:
        return self.registries["gpu_backends"]

    @property
    def inner_trainers(self) -> Registry:
        return self.registries["inner_trainers"]

    @property
    def outer_trainers(self) -> Registry:
        return self.registries["outer_trainers"]

    # -- loading -----------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, selection: str | Iterable[str] | None = None, *, builtins: bool = True) -> "Plugins":
        """Load the built-in plugins and the installed ones, restricted to ``selection`` (else ``AITRAINSAI_PLUGINS``)."""
        plugins = cls()
        if builtins:
            plugins.add_builtins()
        if selection is None:
            selection = os.environ.get(SELECTION_VARIABLE)
        plugins.add_installed(parse_selection(selection))
        plugins.register_components()
        return plugins

    def add_builtins(self) -> None:
        import importlib

        version = _version(CORE_DISTRIBUTION)
        for module_name in BUILTIN_PLUGINS:
            self.add(importlib.import_module(module_name), name=module_name, distribution=CORE_DISTRIBUTION,
                     version=version, builtin=True)

    def add_installed(self, selected: list[str] | None) -> None:
        installed = installed_plugins()
        if selected is not None:
            unknown = [name for name in selected if name not in installed and name != CORE_DISTRIBUTION]
            if unknown:
                available = ", ".join(sorted(installed)) or "none"
                hints = [m for name in unknown for m in difflib.get_close_matches(name, list(installed), 1)]
                hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
                raise PluginError(f"unknown plugin {', '.join(map(repr, unknown))}{hint}; installed plugins: {available}")
        for dist, entry_points in sorted(installed.items()):
            if selected is not None and dist not in selected:
                continue
            for ep in entry_points:
                try:
                    module = ep.load()
                except Exception as exc:
                    raise PluginError(f"plugin {dist!r}: entry point {ep.name} = {ep.value} failed to import: "
                                      f"{type(exc).__name__}: {exc}") from exc
                self.add(module, name=f"{dist}:{ep.name}", distribution=dist, version=_version(dist))

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
        """Call every ``register_*`` hook, one implementation at a time, so each component has a known owner."""
        for registry in self._registries.values():
            registry.__init__(registry.kind, registry.base)
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

                impl.function(*[{"register": register}[arg] for arg in impl.argnames])
        self._registered = True

    def _ensure_registered(self) -> None:
        if not self._registered:
            self.register_components()

    def register_commands(self, cli: "click.Group") -> None:
        self.pm.hook.register_commands(cli=cli)

    # -- queries -----------------------------------------------------------------------------------------------
    def plugin_list(self, include_builtin: bool = True) -> list[PluginInfo]:
        self._ensure_registered()
        return [info for _, info in sorted(self.infos.items()) if include_builtin or not info.builtin]

    def create(self, kind: str, name: str, config: Any = None, **kwargs: Any) -> Any:
        """Instantiate component ``name`` of ``kind`` with its validated config (defaults when ``config`` is None)."""
        component = self.registries[kind].get(name)
        options = component.Config.model_validate(config or {})
        return component(options, **kwargs) if _takes_config(component) else component(**kwargs)


def _takes_config(component: type) -> bool:
    import inspect

    params = list(inspect.signature(component.__init__).parameters)
    return len(params) > 1 and params[1] == "config"


def _resolve(path: str) -> type:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"
