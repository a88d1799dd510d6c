"""A frozen job as an installable verifiers environment package, built by the trusted side for prime-rl.

prime-rl's orchestrator loads an environment by id (``vf.load_environment(id, **args)`` imports the module named after
it), so the job becomes a distribution ``aitrainsai-job-<tag>`` with one module, ``aitrainsai_job_<tag>``. Its
``load_environment`` does not import the job's code: it returns :class:`aitrainsai.SandboxedEnv`, whose rows are the
ones the probe froze (the job's environment, served from the core's sandbox, must serve exactly those) and whose tool
results and rewards come from that environment, as in the local trainer. The package holds, under ``job/`` (the
sandbox's job folder):

- the job's files as accepted (``environment.py``, ``rubric.py``, the frozen ``dataset.jsonl`` and ``probe.json``, any
  module of its own), regular files only;
- the family's *public* modules only (its generator and tools), copied file by file, so that the job's ``from
  aitrainsai_family_x import TOOLS`` works in the sandbox. The family's distribution is never installed where prime-rl
  runs: its private module holds the hidden eval's seed.

The one dependency is the core (``aitrainsai``, the sandbox and the remote protocol), at the version that accepted
the job. The sandbox's limits come from the environment's ``args`` in ``rl.toml``.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from aitrainsai import TaskFamily

REQUIRED = ("environment.py", "rubric.py", "dataset.jsonl", "probe.json")


def package_name(digest: str) -> str:
    """The distribution (and environment id) of the job with content hash ``digest``."""
    return f"aitrainsai-job-{digest[:12]}"


def module_name(env_id: str) -> str:
    """The module verifiers imports for ``env_id`` (its ``env_module_name`` rule: '-' becomes '_')."""
    return env_id.replace("-", "_")


def public_files(family: TaskFamily) -> dict[str, Path]:
    """The family's public modules as files: relative path (``package/module.py``) -> source file."""
    files: dict[str, Path] = {}
    for module in family.public_modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ValueError(f"the family's public module {module} cannot be found")
        origin = Path(spec.origin)
        parts = module.split(".")
        relative = Path(*parts, "__init__.py") if origin.name == "__init__.py" else Path(*parts[:-1], origin.name)
        files[relative.as_posix()] = origin
        for depth in range(1, len(parts)):  # the packages above it
            parent = importlib.util.find_spec(".".join(parts[:depth]))
            if parent is not None and parent.origin and Path(parent.origin).name == "__init__.py":
                if ".".join(parts[:depth]) not in family.public_modules:
                    raise ValueError(f"{module} is public but its package {'.'.join(parts[:depth])} is not")
    return files


def build_package(job_dir: Path, family: TaskFamily, digest: str, destination: Path, *, core_version: str) -> str:
    """Write the environment package of the frozen job in ``job_dir`` (content hash ``digest``) into
    ``destination``; returns its environment id."""
    env_id, module, root = copy_job(job_dir, family, digest, destination, REQUIRED)
    (root / "__init__.py").write_text(INIT.format(env_id=env_id, family=family.name, digest=digest))
    (destination / "pyproject.toml").write_text(PYPROJECT.format(
        name=env_id, module=module, core=core_version, family=family.name, what="a verifiers environment"))
    return env_id


def copy_job(job_dir: Path, family: TaskFamily, digest: str, destination: Path,
             required: tuple[str, ...]) -> tuple[str, str, Path]:
    """A package's folder for the frozen job in ``job_dir`` (which must hold ``required`` as regular files): its
    ``job/`` folder with the job's regular files and the family's public modules. Returns the package's id, its
    module's name and the module's folder."""
    env_id = package_name(digest)
    module = module_name(env_id)
    if destination.exists():
        shutil.rmtree(destination)
    root = destination / module
    (root / "job").mkdir(parents=True)
    for name in required:
        source = Path(job_dir) / name
        if source.is_symlink() or not source.is_file():
            raise ValueError(f"the frozen job has no regular file {name}")
    for source in sorted(Path(job_dir).rglob("*")):
        if source.is_file() and not source.is_symlink() and "__pycache__" not in source.parts:
            target = root / "job" / source.relative_to(job_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    for relative, source in public_files(family).items():
        target = root / "job" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return env_id, module, root


INIT = '''"""Generated by aitrainsai: job {digest:.12} of the {family} family as a verifiers environment ({env_id}).
The job's code runs only in the sandbox; this module never imports it."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def load_environment(memory_mb: int = 4096, wall_s: float = 3600.0, **kwargs):
    from aitrainsai import Limits, SandboxedEnv

    limits = Limits(wall_s=wall_s, cpu_s=int(wall_s), memory_mb=memory_mb, tmp_mb=256, out_mb=16)
    return SandboxedEnv(_HERE / "job", limits=limits, **kwargs)
'''

PYPROJECT = '''[project]
name = "{name}"
version = "0.1.0"
description = "aitrainsai job: {what} of the {family} family (generated)"
requires-python = ">=3.11"
dependencies = ["aitrainsai=={core}"]

[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["{module}"]
'''
