"""``aitrainsai export`` from a damaged or foreign ledger: every string that goes into the generated package is data,
a Python literal or a TOML string, never code; from the command, a run or episode id that is no plain name, and a
frozen job that is not the episode's own folder in the run, are refused in one line, with nothing written."""

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from aitrainsai.cli.command import cli
from aitrainsai.jobs.export import ExportError, export_job, package_name
from aitrainsai.jobs.job import job_digest, write_frozen_rows
from aitrainsai.run.ledger import RUN_ID, Ledger

TASKSET = '__all__ = ["load_taskset"]\n\n\ndef load_taskset():\n    return "the job\'s taskset"\n'
RUN = "20261206-120000-abcd"

# each would run code, or break the package, if pasted into the generated files as text
HOSTILE = {
    "quote": 'x"; import os; os.system("touch {marker}") #',
    "triple-quote": 'x"""\nimport os; os.system("touch {marker}")\n"""',
    "single-triple-quote": "x'''; __import__('os').system('touch {marker}') #'''\"\"\"",
    "line-separators": 'x\u2028"""\u2029__import__("os").system("touch {marker}")#\x85',
    "backslashes": 'x\\N{{oops}}\\u12 \\\\"\\',
    "toml-table": 'x"\ndependencies = ["evil"]\n[tool.evil]\nrun = "touch {marker}"\n"',
    "control-and-surrogate": "x\x00\x1b[31m\x7f\udc80",
}


ROWS = [{"question": f"q{i}", "answer": str(i), "world": {}} for i in range(4)]


def frozen_job(folder: Path, left_out: list[int] | None = None) -> tuple[Path, str]:
    folder.mkdir(parents=True)
    (folder / "taskset.py").write_text(TASKSET)
    write_frozen_rows(folder, ROWS, "system", left_out=left_out)
    return folder, job_digest(folder)


def imported(package: Path, module: str) -> str:
    """The package imported in a fresh interpreter: its docstring, as the interpreter read it."""
    code = (f"import json, sys; sys.path.insert(0, {str(package)!r}); import {module}; "
            f"print(json.dumps({module}.__doc__)); print({module}.load_taskset())")
    done = subprocess.run([sys.executable, "-I", "-c", code], cwd=package, capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", "")}, timeout=60)
    assert done.returncode == 0, done.stderr
    doc, result = done.stdout.splitlines()
    assert result == "the job's taskset"
    return json.loads(doc)


@pytest.mark.parametrize("variant", sorted(HOSTILE))
def test_a_hostile_episode_id_is_data_in_the_package(tmp_path, variant):
    """The episode id (and the run id beside it) appear in the package's docstring and description as they are; the
    ``__init__`` holds the template's statements and nothing else, importing it runs none of the id, and the
    ``pyproject.toml`` parses to exactly the template's keys."""
    marker = tmp_path / "ran"
    episode = HOSTILE[variant].format(marker=marker)
    frozen, digest = frozen_job(tmp_path / "frozen")
    name = package_name("calc_chain", episode)
    about = f" for calc_chain (run {RUN}, episode {episode})"
    out = export_job(frozen, digest, tmp_path / "pkg", name=name, family_distribution="aitrainsai-family-calc-chain",
                     about=about)
    module = name.replace("-", "_")
    init = (out / module / "__init__.py").read_text()
    tree, plain = ast.parse(init), ast.parse(
        export_job(frozen, digest, tmp_path / "plain", name=name, family_distribution="aitrainsai-family-calc-chain",
                   about=" for calc_chain").joinpath(module, "__init__.py").read_text())
    docstring = ast.get_docstring(tree, clean=False)
    shown = about.replace("\udc80", "\\udc80")  # a lone surrogate is written as its escape: the file is text
    assert docstring == f"{name}: a verifiers v1 taskset{shown}, exported by aitrainsai."
    assert [ast.dump(node) for node in tree.body[1:]] == [ast.dump(node) for node in plain.body[1:]]
    assert imported(out, module) == docstring and not marker.exists()

    project = tomllib.loads((out / "pyproject.toml").read_text())
    assert project["project"] == {
        "name": name, "version": "0.1.0", "requires-python": ">=3.11",
        "dependencies": ["verifiers==0.4.0", "aitrainsai", "aitrainsai-family-calc-chain"],
        "description": " ".join(f"A verifiers v1 taskset{shown}, exported by aitrainsai".split())}
    assert set(project) == {"build-system", "project", "tool"} and project["tool"] == {
        "hatch": {"build": {"targets": {"wheel": {"packages": [module]}}}}}


@pytest.mark.parametrize(("name", "distribution"), [
    ("aitrainsai-x\nimport-os", "aitrainsai-family-calc-chain"),
    ('aitrainsai"', "aitrainsai-family-calc-chain"),
    ("9-lives", "aitrainsai-family-calc-chain"),
    ("aitrainsai-calc-chain-e0", 'calc"]\n[tool.evil]'),
    ("aitrainsai-calc-chain-e0", "calc chain"),
])
def test_a_name_that_would_be_code_or_a_path_is_refused_in_one_line_before_anything_is_written(tmp_path, name,
                                                                                               distribution):
    frozen, digest = frozen_job(tmp_path / "frozen")
    with pytest.raises(ExportError) as refused:
        export_job(frozen, digest, tmp_path / "pkg", name=name, family_distribution=distribution)
    assert "\n" not in str(refused.value) and not (tmp_path / "pkg").exists()


def forged(tmp_path: Path, run_id: str, episode: str, frozen_at: str = "") -> Path:
    """A ledger whose run and episode carry these ids (as a damaged or foreign ledger may), the episode's accepted
    v1 job frozen where the probe leaves it (``RUN/episodes/ID/probe-1/job``), or at ``frozen_at`` (under tmp)."""
    pytest.importorskip("aitrainsai_family_calc_chain", reason="the export needs the job's family installed")
    runs = tmp_path / "runs"
    ledger = Ledger(runs)
    run = ledger.create_run({}, [], name="forged")
    run.upsert_episode(episode, status="done", family="calc_chain", level=1)
    for table in ("runs", "episodes"):
        ledger.db.write(f"UPDATE {table} SET {'id' if table == 'runs' else 'run_id'} = ?", (run_id,))
    folder = run.dir
    if RUN_ID.fullmatch(run_id):
        folder = run.dir.rename(runs / run_id)
    place = tmp_path / frozen_at if frozen_at else folder / "episodes" / episode / "probe-1" / "job"
    frozen, digest = frozen_job(place)
    ledger.db.write("UPDATE episodes SET data = ?", (json.dumps({"frozen_job": str(frozen), "frozen_digest": digest}),))
    return runs


def test_export_writes_the_episodes_job_as_a_package(tmp_path):
    runs = forged(tmp_path, RUN, "g0000-e0")
    done = CliRunner().invoke(cli, ["export", "--runs-dir", str(runs), RUN, "g0000-e0"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    name = package_name("calc_chain", "g0000-e0")
    package = runs / RUN / "export" / name
    assert done.output == f"package: {package} (pip install {package}; verifiers id {name})\n"
    assert imported(package, name.replace("-", "_")) == (
        f"{name}: a verifiers v1 taskset for calc_chain (run {RUN}, episode g0000-e0), exported by aitrainsai.")


@pytest.mark.parametrize("label", sorted(set(HOSTILE) - {"control-and-surrogate"}))  # SQLite holds no lone surrogate
def test_export_of_a_hostile_episode_id_is_refused_in_one_line(tmp_path, label):
    marker = tmp_path / "ran"
    episode = HOSTILE[label].format(marker=marker)
    runs = forged(tmp_path, RUN, episode, frozen_at="frozen")
    refused = CliRunner().invoke(cli, ["export", "--runs-dir", str(runs), RUN, episode], catch_exceptions=False)
    assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output
    assert "is not one plain name" in refused.output and "nothing exported" in refused.output, refused.output
    assert not list(runs.rglob("pyproject.toml")) and not marker.exists()


@pytest.mark.parametrize("where", ["../elsewhere/job", "runs/episodes/g0000-e0/probe-1/eval"])
def test_a_frozen_job_outside_the_episodes_own_folder_is_never_exported(tmp_path, where):
    """A ledger row naming another folder (a foreign ledger's, the episode's eval/) is refused: nothing of it is
    read or written."""
    runs = forged(tmp_path, RUN, "g0000-e0", frozen_at=where)
    refused = CliRunner().invoke(cli, ["export", "--runs-dir", str(runs), RUN, "g0000-e0"], catch_exceptions=False)
    assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output
    assert "nothing exported" in refused.output and not list(runs.rglob("pyproject.toml"))


@pytest.mark.parametrize("run_id", ['x"""; __import__("os").system("touch {marker}") #', "x\nimport os",
                                    "../outside", ".hidden"])
def test_a_hostile_run_id_is_refused_in_one_line_and_nothing_is_written(tmp_path, run_id):
    marker = tmp_path / "ran"
    run_id = run_id.format(marker=marker)
    runs = forged(tmp_path, run_id, "g0000-e0")
    refused = CliRunner().invoke(cli, ["export", "--runs-dir", str(runs), "forged", "g0000-e0"],
                                 catch_exceptions=False)
    assert refused.exit_code == 1
    assert refused.output.count("\n") == 1 and "is not a run id" in refused.output, refused.output
    assert not list(runs.rglob("pyproject.toml")) and not marker.exists()
    assert not (tmp_path / "outside").exists()  # no folder made outside the runs folder


def test_the_package_holds_neither_the_hidden_rows_nor_the_record_that_names_them(tmp_path):
    """The review's job: build() returned hidden-eval items among its rows; the probe left them out of training and
    named them in probe.json. The package serves only the trained rows, and probe.json stays behind."""
    job, digest = frozen_job(tmp_path / "job", left_out=[1, 3])
    out = export_job(job, digest, tmp_path / "pkg", name="aitrainsai-calc-chain-e0", family_distribution="calc")
    module = out / "aitrainsai_calc_chain_e0"
    assert not (module / "probe.json").exists()
    rows = [json.loads(line) for line in (module / "dataset.jsonl").read_text().splitlines()]
    assert rows == [ROWS[0], ROWS[2]]
    with pytest.raises(ExportError, match="the frozen rows cannot be read"):
        (job / "probe.json").unlink()
        export_job(job, job_digest(job), tmp_path / "pkg2", name="aitrainsai-calc-chain-e0",
                   family_distribution="calc")
    assert not (tmp_path / "pkg2").exists()
