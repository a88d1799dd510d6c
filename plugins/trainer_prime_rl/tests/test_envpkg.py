"""The job as an environment package: it builds, installs into a fresh virtual environment (core and package wheels
only) and loads there, served from the sandbox, with the verifiers prime-rl v0.6.0 pins (0.1.15.dev180, which ``make
install`` puts apart in ``.venv/pinned``; the other third-party packages come from this environment's site), for every
family; the family's private module is not there."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from aitrainsai import build_local_wheels, job_template, write_frozen_rows
from aitrainsai_trainer_prime_rl.envpkg import build_package, module_name, package_name, public_files
from aitrainsai_trainer_prime_rl.pins import STACK
from aitrainsai_trainer_prime_rl.testing import installed_family

PINNED = Path(sys.prefix) / "pinned" / "prime-rl-verifiers"
FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]

LOAD = """
import json, sys
import verifiers as vf
results = {}
for env_id in sys.argv[1:]:
    env = vf.load_environment(env_id)
    row = env.dataset[0]
    results[env_id] = {"rows": len(env.dataset), "tools": sorted(t.name for t in env.tool_defs),
                       "max_turns": env.max_turns, "system": env.system_prompt,
                       "first": row["prompt"][0]["content"], "sandboxed": type(env).__name__}
from importlib import metadata
print(json.dumps({"verifiers": metadata.version("verifiers"), **results}))
"""


def frozen_job(folder: Path, family, rows: int = 12) -> Path:
    """A job as the probe leaves it: the template's files and the frozen dataset.jsonl."""
    from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer

    spec = family.task_spec()
    trainer = PrimeRlTrainer()
    spec = spec.model_copy(update={"constraints": trainer.constraints(spec.constraints)})
    folder.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (folder / name).write_text(text)
    items = family.generate(7, family.default_level, rows)
    write_frozen_rows(folder, [{"question": i.question, "answer": i.answer, "world": i.world} for i in items],
                      spec.eval_interface.system_prompt)
    return folder


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory):
    """A virtual environment with no site packages of its own but the pinned verifiers and this one's third-party
    packages, read through a path file that does not run their .pth files: the workspace's editable distributions
    (the core, the families) are not importable there."""
    if not (PINNED / "verifiers").is_dir():
        pytest.skip(f"needs verifiers {STACK.verifiers} in {PINNED} (make install puts it there)")
    root = tmp_path_factory.mktemp("fresh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "outer.pth").write_text(f"{PINNED}\n{sysconfig.get_paths()['purelib']}\n")
    core = build_local_wheels(["aitrainsai"], root / "wheels")["aitrainsai"]
    return python, core, root


@pytest.mark.slow  # builds a virtual environment and installs every family into it
def test_every_family_loads_as_an_installed_environment(fresh_python, tmp_path):
    python, core, root = fresh_python
    packages, ids = [], {}
    for name in FAMILIES:
        family = installed_family(name)
        job = frozen_job(tmp_path / "jobs" / name, family)
        digest = f"{len(ids):02d}" + "ab" * 20
        env_id = build_package(job, family, digest, tmp_path / "pkgs" / name, core_version="0.1.0")
        assert env_id == package_name(digest) and (tmp_path / "pkgs" / name / module_name(env_id)).is_dir()
        packages.append(tmp_path / "pkgs" / name)
        ids[env_id] = family
    wheels = tmp_path / "envwheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), *map(str, packages)], check=True, capture_output=True, timeout=600)
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                    str(core), *map(str, wheels.glob("*.whl"))], check=True, capture_output=True, timeout=600)
    check = subprocess.run([python, "-c", LOAD, *ids], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    results = json.loads(check.stdout.strip().splitlines()[-1])
    assert results.pop("verifiers") == STACK.verifiers
    for env_id, family in ids.items():
        got = results[env_id]
        interface = family.task_spec().eval_interface
        assert got["rows"] == 12 and got["max_turns"] == interface.turn_limit
        assert got["system"] == got["first"] == interface.system_prompt
        assert got["sandboxed"] == "SandboxedEnv"  # the job's code is served from the sandbox, not imported
        assert got["tools"] == sorted(t["function"]["name"] for t in interface.tools)
    private = subprocess.run(
        [python, "-c", f"import {module_name(next(iter(ids)))}, aitrainsai_family_calc_chain.family"],
        capture_output=True, text=True, timeout=120)
    # prime-rl's process has no family package at all (the public modules are in the sandbox's job folder only)
    assert private.returncode != 0 and "No module named 'aitrainsai_family_calc_chain'" in private.stderr
    assert not list((tmp_path / "pkgs").rglob("family.py"))


def test_only_public_modules_are_copied():
    family = installed_family("calc_chain")
    files = public_files(family)
    assert sorted(files) == ["aitrainsai_family_calc_chain/__init__.py", "aitrainsai_family_calc_chain/world.py"]
