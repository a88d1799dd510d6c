"""Plugins and families use the core through its front door only: ``aitrainsai`` and ``aitrainsai.testing``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"aitrainsai", "aitrainsai.testing"}


def reach_ins(path: Path, root: Path = ROOT, *, source: str | None = None) -> list[str]:
    """Each import in ``path`` (or in ``source``, named ``path``) of an ``aitrainsai`` module other than the two public
    ones, as ``file:line module``."""
    found = []
    name = str(path) if source is None else path.name
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, name)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] == "aitrainsai" and module not in PUBLIC:
                found.append(f"{path.relative_to(root) if source is None else path}:{node.lineno} {module}")
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


def test_generated_job_code_imports_only_the_front_door():
    """The code the core and the recipe policy write for an agent's job (every family's template in both formats,
    every rubric the recipe writes) runs in a sandbox beside the job: it imports the front door only."""
    from aitrainsai import Plugins, job_template
    from aitrainsai_outer_recipe.policy import RUBRICS, rubric_source

    plugins = Plugins.load()
    generated: dict[str, str] = {}
    for name in plugins.task_families.names():
        spec = plugins.task_families.create(name).task_spec(1)
        for form in ("verifiers", "verifiers-v1"):
            for file, text in job_template(spec, "", form).items():
                if file.endswith(".py"):
                    generated[f"{name}/{form}/{file}"] = text
    for kind in RUBRICS:
        for form in ("verifiers", "verifiers-v1"):
            generated[f"recipe/{form}/rubric-{kind}.py"] = rubric_source(kind, form)
    assert len(generated) > 20
    assert [hit for file, text in generated.items() for hit in reach_ins(Path(file), source=text)] == []
