"""What a job may see: the one place that computes it; every sandbox strategy and the session apply it.

Agent code sees the interpreter and the installed packages read-only, except that of each installed task family's
package it sees only the family's public modules (its hidden eval and scorer are absent), and never the runs
directory (ledgers, other episodes' jobs and results). Every family installed in this environment counts, not only
those of a run or of the plugin selection: a job must not read another family's hidden eval either.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class PackageView:
    """A package folder of which the sandbox sees only ``visible`` (file names in it); the rest is absent."""

    path: str
    visible: tuple[str, ...]


@cache
def family_package_views() -> tuple[PackageView, ...]:
    """How the sandbox shows each installed task family's package: its public modules only (cached per process). A
    plugin that cannot be loaded shows nothing of its package."""
    from aitrainsai.plugins import Plugins, Selection, installed_plugins

    plugins = Plugins.load(Selection(), tolerant=True)  # everything installed, whatever the selection
    registry = plugins.task_families
    views: dict[str, set[str]] = {}
    for name in registry.names():
        family = registry.get(name)
        root = _module_file(family.__module__.split(".")[0]).parent
        visible = views.setdefault(str(root), set())
        for module in family.public_modules:
            origin = _module_file(module)
            if origin.is_relative_to(root):
                visible.add(str(origin.relative_to(root)))
    installed = installed_plugins()
    for dist in plugins.broken:
        for entry_point in installed.get(dist, []):
            broken = _package_dir(entry_point.module.split(".")[0])
            if broken is not None:
                views[str(broken)] = set()
    return tuple(PackageView(path, tuple(sorted(names))) for path, names in sorted(views.items()))


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"no file for module {name}")
    return Path(spec.origin).resolve()


def hidden_family_files() -> list[str]:
    """Every file of an installed task family's package that is not one of its public modules."""
    hidden = []
    for view in family_package_views():
        for folder, _, files in os.walk(view.path):
            for name in files:
                path = os.path.join(folder, name)
                if os.path.relpath(path, view.path) not in view.visible:
                    hidden.append(path)
    return hidden


def hidden_paths(runs_dir: Path) -> list[Path]:
    """What no job may read, wherever the sandbox would otherwise show it: the runs directory and the private
    modules of every installed task family (:func:`hidden_family_files`' Python sources)."""
    private = sorted(Path(p) for p in hidden_family_files() if p.endswith(".py") and "__pycache__" not in Path(p).parts)
    return list(dict.fromkeys([Path(runs_dir).resolve(), *private]))


def _package_dir(package: str) -> Path | None:
    """The folder of ``package``, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).resolve() if locations else None
