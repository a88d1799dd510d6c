"""docs/api.md lists the front door's names by kind, generated from ``aitrainsai._SECTIONS``; this test keeps it
current. Regenerate: ``.venv/bin/python core/tests/test_api_doc.py``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import aitrainsai

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def summary(obj: object) -> str:
    """The first sentence of ``obj``'s docstring, on one line (a constant: its value)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        if isinstance(obj, (str, int, float)) or kind_of(obj) == "type":
            return f"`{obj!r}`".replace("|", "\\|")
        return f"an instance of `{type(obj).__name__}`: {summary(type(obj))}"
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__  # not a base class's
    doc = inspect.cleandoc(own) if isinstance(own, str) else ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    sentence = first.split(". ", 1)[0].rstrip(".")
    return (sentence + "." if sentence else "").replace("|", "\\|")


def kind_of(obj: object) -> str:
    if getattr(obj, "__origin__", None) is not None or type(obj).__name__ in ("TypeAliasType", "_LiteralGenericAlias",
                                                                             "_UnionGenericAlias", "UnionType"):
        return "type"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if inspect.isroutine(obj) else "constant"


def api_page() -> str:
    lines = ["# The public API", "",
             "Everything a plugin, a task family or a script imports from the core: `from aitrainsai import NAME`, "
             "and the conformance kits and fakes from `aitrainsai.testing`. Every other module is private and may "
             "move; a test fails when a plugin or family imports one. Generated from the front door's table "
             "(`aitrainsai._SECTIONS`) by `.venv/bin/python core/tests/test_api_doc.py`; a test keeps it current.",
             "", "`hookimpl`: the marker a plugin's hook implementations carry (`@hookimpl`).", ""]
    for title, modules in aitrainsai._SECTIONS.items():
        lines += [f"## {title}", "", "| name | kind | defined in | what it is |", "|---|---|---|---|"]
        for module, names in modules.items():
            for name in names:
                obj = getattr(aitrainsai, name)
                lines.append(f"| `{name}` | {kind_of(obj)} | `{module}` | {summary(obj)} |")
        lines.append("")
    from aitrainsai import testing

    lines += ["## aitrainsai.testing", "", "| name | kind | what it is |", "|---|---|---|"]
    for name in sorted(testing.__all__):
        obj = getattr(testing, name)
        lines.append(f"| `{name}` | {kind_of(obj)} | {summary(obj)} |")
    return "\n".join(lines) + "\n"


def test_the_api_page_lists_every_public_name_as_the_front_door_has_it():
    pytest.importorskip("verifiers")  # SandboxedEnv needs the jobs extra
    page = api_page()
    assert "|  |" not in page and ":  |" not in page, "a public name without a docstring: " + ", ".join(
        line.split("`")[1] for line in page.splitlines() if line.endswith(("|  |", ":  |")))
    assert PAGE.read_text() == page, "docs/api.md is stale: .venv/bin/python core/tests/test_api_doc.py"


if __name__ == "__main__":
    PAGE.write_text(api_page())
    print(f"wrote {PAGE}")
