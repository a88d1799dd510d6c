"""Each package's modules import one another without a cycle, ``TYPE_CHECKING`` and deferred imports included: the
core and every plugin read top-down. A plugin's imports of the core are edges out of its graph, never a cycle."""

import ast
from pathlib import Path

import pytest

import aitrainsai

CORE = Path(aitrainsai.__file__).resolve().parent
PLUGINS = sorted(init.parent for init in (Path(__file__).resolve().parents[2] / "plugins").glob("*/src/*/__init__.py"))
# the front door loads its names lazily: ``from aitrainsai import X`` imports the module that defines X (or module X)
FRONT_DOOR = {**aitrainsai._EXPORTS, "hookimpl": "aitrainsai.hookspecs"}


def module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_from(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of an ``import from``, relative ones resolved against ``name``'s package."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports: deferred and ``TYPE_CHECKING`` imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = imported_from(name, path, node)
            for alias in node.names:
                if module == "aitrainsai":
                    found.add(FRONT_DOOR.get(alias.name, f"aitrainsai.{alias.name}"))
                else:
                    found.update({module, f"{module}.{alias.name}"})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of the same package it imports."""
    files = {module_name(package, path): path for path in package.rglob("*.py")}
    return {name: imports(name, path, set(files)) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_core_has_no_import_cycle():
    core = graph(CORE)
    assert len(core) > 30
    assert cycles(core) == []


def test_no_room_imports_a_room_above_it():
    """``isolation/`` imports no other room, ``jobs/`` only ``isolation/``, ``run/`` both, ``cli/`` all: the engine
    never imports the command line."""
    rooms = ["isolation", "jobs", "run", "cli"]

    def room(module: str) -> int | None:
        parts = module.split(".")
        return rooms.index(parts[1]) if len(parts) > 1 and parts[1] in rooms else None

    upward = sorted(f"{name} -> {other}" for name, imported in graph(CORE).items() for other in imported
                    if room(name) is not None and room(other) is not None and room(other) > room(name))
    assert upward == []


@pytest.mark.parametrize("package", PLUGINS, ids=lambda package: package.name)
def test_a_plugin_has_no_import_cycle(package):
    assert cycles(graph(package)) == []


def test_every_plugin_is_checked():
    assert len(PLUGINS) >= 10


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_check_reads_typing_only_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    assert cycles(graph(package)) == [["pkg.a", "pkg.b"]]
