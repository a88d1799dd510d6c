"""What every registered component has in common, and the typed registry that holds one kind of component."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Generic, TypeVar
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict

from aitrainsai.errors import AitrainsaiError

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_\-]*$")
ENTRY_POINT_GROUP = "aitrainsai"  # the entry points that name the plugins


class ComponentConfig(BaseModel):
    """Base of every component's options: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Component:
    """A registered component: a class with a unique ``name`` and an options model ``Config``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type[ComponentConfig]] = ComponentConfig


class RegistryError(AitrainsaiError):
    """A component could not be registered or found."""


T = TypeVar("T", bound=Component)


class Registry(Generic[T]):
    """Components of one kind (subclasses of ``base``), by name, each remembered with the plugin that registered it.
    :meth:`get` returns the class, :meth:`create` an instance of that kind."""

    def __init__(self, kind: str, base: type[T]):
        self.kind = kind
        self.base = base
        self._components: dict[str, type[T]] = {}
        self._owners: dict[str, str] = {}

    def clear(self) -> None:
        """Forget every component (before the plugins register theirs again)."""
        self._components.clear()
        self._owners.clear()

    def register(self, component: type[T], *, plugin: str) -> None:
        if not (isinstance(component, type) and issubclass(component, self.base)):
            raise RegistryError(
                f"plugin {plugin!r} registered {component!r} as a {self.kind}, "
                f"but it is not a subclass of {self.base.__module__}.{self.base.__qualname__}"
            )
        name = getattr(component, "name", None)
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise RegistryError(
                f"plugin {plugin!r} registered {self.kind} {component.__qualname__} with name {name!r}: "
                "a name is lowercase letters, digits, '-' and '_', starting with a letter"
            )
        if name in self._components:
            raise RegistryError(
                f"two plugins register a {self.kind} named {name!r}: "
                f"{self._owners[name]!r} ({_qualname(self._components[name])}) and {plugin!r} ({_qualname(component)})"
            )
        self._components[name] = component
        self._owners[name] = plugin

    def get(self, name: str) -> type[T]:
        try:
            return self._components[name]
        except KeyError:
            known = ", ".join(sorted(self._components)) or "none installed"
            raise RegistryError(f"no {self.kind} named {name!r} (available: {known})") from None

    def create(self, name: str, config: ComponentConfig | dict[str, Any] | None = None, **kwargs: Any) -> T:
        """An instance of component ``name``: ``config`` (its ``Config``, a dict validated against it, or None for
        the defaults) is passed first where the component's ``__init__`` takes one; ``kwargs`` follow."""
        component = self.get(name)
        options = config if isinstance(config, component.Config) else component.Config.model_validate(
            config.model_dump() if isinstance(config, BaseModel) else (config or {}))
        made: T = component(options, **kwargs) if _takes_config(component) else component(**kwargs)  # type: ignore[call-arg]
        return made

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return sorted(self._components)

    def __contains__(self, name: object) -> bool:
        return name in self._components

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._components)


def _takes_config(component: type) -> bool:
    import inspect

    params = list(inspect.signature(component).parameters)
    return bool(params) and params[0] == "config"


def _qualname(obj: type) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def shipped_by(cls: type) -> str | None:
    """The installed distribution with an entry point in the top-level package that defines ``cls`` (the plugin that
    ships it), or None."""
    from importlib import metadata

    package = cls.__module__.split(".")[0]
    owners = {ep.dist.name if ep.dist is not None else ep.module.split(".")[0]
              for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.module.split(".")[0] == package}
    return min(owners, default=None)
