"""Plugins and families use the core through its front door only: ``aitrainsai`` and ``aitrainsai.testing``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"aitrainsai", "aitrainsai.testing"}


def reach_ins(path: Path, root: Path = ROOT) -> list[str]:
    """Each import in ``path`` of an ``aitrainsai`` module other than the two public ones, as ``file:line module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] == "aitrainsai" and module not in PUBLIC:
                found.append(f"{path.relative_to(root)}:{node.lineno} {module}")
    return found


def test_no_plugin_or_family_imports_a_private_core_module():
    files = [path for folder in ("plugins", "task_families") for path in (ROOT / folder).rglob("*.py")]
    assert len(files) > 100  # the walk found the distributions
    assert [hit for path in files for hit in reach_ins(path)] == []


def test_the_check_sees_a_reach_in(tmp_path):
    module = tmp_path / "plugin.py"
    module.write_text("from aitrainsai import hookimpl\nfrom aitrainsai.run.ledger import LOCK_NAME\n"
                      "def f():\n    import aitrainsai.cli\n")
    assert reach_ins(module, tmp_path) == ["plugin.py:2 aitrainsai.run.ledger", "plugin.py:4 aitrainsai.cli"]
