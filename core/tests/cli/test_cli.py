import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from aitrainsai.cli.command import cli
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.record import JobProgress

# the core's test folders are not on pytest's path: this one imports helpers of the ledger's and plugins' tests
sys.path[:0] = [str(Path(__file__).parents[1] / "run"), str(Path(__file__).parents[1])]
from test_ledger import DAMAGE, damaged_ledger  # noqa: E402


def invoke(*args, runs_dir=None):
    extra = ["--runs-dir", str(runs_dir)] if runs_dir else []
    return CliRunner().invoke(cli, [*extra, *args], catch_exceptions=False)


def test_every_command_explains_itself_with_an_example():
    for command in (["run"], ["runs"], ["show"], ["plugins"], ["families"], ["new", "family"], ["reward", "show"], []):
        result = invoke(*command, "--help")
        assert result.exit_code == 0, result.output
        assert "Example" in result.output, f"{command} --help has no example"


def test_plugins_json_lists_the_core():
    result = invoke("plugins", "--json", "--plugins", "")
    core = json.loads(result.output)[0]
    assert core["name"] == "aitrainsai" and core["builtin"] and core["components"]["gpu_backends"] == ["local"]


def test_runs_and_show(tmp_path):
    assert "no runs" in invoke("runs", runs_dir=tmp_path).output
    ledger = Ledger(tmp_path)
    run = ledger.create_run({"loop": {"steps": 1}, "families": {"train": ["a"], "held_out": ["b"]}},
                            [{"name": "aitrainsai", "version": "0.1.0"}], name="demo")
    run.upsert_episode("ep1", status="done", step=0, family="a", reward=0.5)
    run.add_message("ep1", {"role": "user", "content": "teach [bold]it[/bold]"})
    run.add_message("ep1", {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "write_file", "arguments": "{}"}}]})
    run.add_probe("ep1", 1, False, ["trainer.toml: steps: too many"], 0.1)
    run.upsert_job("job1", status="done", episode_id="ep1", progress=JobProgress(pre=0.2, post=0.4), wall_s=3)
    listing = invoke("runs", runs_dir=tmp_path).output
    assert run.id in listing and "demo" in listing
    shown = invoke("show", "demo", runs_dir=tmp_path).output
    assert "ep1" in shown and "job1" in shown and "0.400" in shown
    transcript = invoke("show", "latest", "--episode", "ep1", runs_dir=tmp_path).output
    assert "teach [bold]it[/bold]" in transcript and "write_file" in transcript and "steps: too many" in transcript
    data = json.loads(invoke("show", run.id, "--json", runs_dir=tmp_path).output)
    assert data["episodes"][0]["reward"] == 0.5
    missing = CliRunner().invoke(cli, ["--runs-dir", str(tmp_path), "show", "nope"])
    assert missing.exit_code == 1 and "no run 'nope'" in missing.output


def test_run_rejects_a_bad_config_naming_the_key(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text("[loop]\nsteps = 0\nwhat = 1\n")
    result = CliRunner().invoke(cli, ["run", "--config", str(bad), "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "loop.steps: Input should be greater than or equal to 1" in result.output
    assert "loop.what: unknown key" in result.output
    result = CliRunner().invoke(cli, ["run", "-s", "loop.steps=abc", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "loop.steps" in result.output


def test_new_family_refuses_bad_names_and_existing_dirs(tmp_path):
    assert CliRunner().invoke(cli, ["new", "family", "Bad-Name", "--dir", str(tmp_path)]).exit_code == 1
    assert invoke("new", "family", "tides", "--dir", str(tmp_path)).exit_code == 0
    again = CliRunner().invoke(cli, ["new", "family", "tides", "--dir", str(tmp_path)])
    assert again.exit_code == 1 and "already exists" in again.output


# -- bad input: one clear line, and nothing created before it is checked ----------------------------------------------
DAMAGED_LEDGER_COMMANDS = [["runs"], ["show", "demo"], ["show", "latest", "--json"], ["report", "demo"],
                           ["export", "demo", "e1"], ["run", "-s", "loop.steps=1"], ["run", "--resume", "demo"],
                           ["job", "run", "--family", "calc_chain"]]


@functools.cache
def default_plugins_installed() -> bool:
    """Whether the default run's config resolves: its families, trainers and backend are installed (not so when the
    core is tested alone)."""
    from aitrainsai.config import ConfigError, load_config, resolve
    from aitrainsai.plugins import Plugins

    try:
        plugins = Plugins.load()
        resolve(load_config(None, [], None, presets=plugins.presets), plugins)
    except ConfigError:
        return False
    return True


def needs_default_plugins(command) -> None:
    if command[0] in ("run", "job") and not default_plugins_installed():
        pytest.skip("`run` and `job run` need the default run's plugins installed")


def one_line_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("command", DAMAGED_LEDGER_COMMANDS, ids=" ".join)
def test_a_damaged_ledger_is_one_line_from_every_command(tmp_path, kind, command):
    needs_default_plugins(command)
    damaged_ledger(tmp_path, kind)
    before = run_dirs(tmp_path)
    line = one_line_error(invoke(*command, runs_dir=tmp_path))
    assert str(tmp_path / "ledger.sqlite") in line and "damaged" in line
    assert run_dirs(tmp_path) == before, "a run was created on a damaged ledger"


def run_dirs(runs_dir: Path) -> list[str]:
    return sorted(p.name for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.exists() else []


READ_ONLY = """mount --bind -o ro "$0" "$0" && exec "$@" --runs-dir "$0" """


def read_only_mount_works(tmp_path) -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    check = subprocess.run([unshare, "-m", "sh", "-c", READ_ONLY, str(tmp_path), "sh", "-c", "! touch \"$2\"/x", "-"],
                           capture_output=True)
    return check.returncode == 0


@pytest.mark.parametrize("command", DAMAGED_LEDGER_COMMANDS, ids=" ".join)
def test_a_read_only_runs_directory_is_one_line_from_every_command(tmp_path, command):
    """On a read-only bind mount (as root, chmod would not stop the writes); skipped where mounts are not allowed."""
    needs_default_plugins(command)
    runs = tmp_path / "runs"
    ledger = Ledger(runs)
    ledger.create_run({"families": {"train": ["a"], "held_out": []}}, [], name="demo")
    ledger.close()
    if not read_only_mount_works(runs):
        pytest.skip("cannot make a read-only bind mount here (needs `unshare -m` and mount rights)")
    before = run_dirs(runs)
    cli_path = Path(sys.executable).with_name("aitrainsai")
    result = subprocess.run(["unshare", "-m", "sh", "-c", READ_ONLY, str(runs), str(cli_path), *command],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"Error: cannot use the runs directory {runs}: not writable "
                                                  "(a read-only file system, or no permission); give a writable one "
                                                  "with --runs-dir"]
    assert run_dirs(runs) == before


def no_run_was_created(runs_dir: Path) -> bool:
    rows = Ledger(runs_dir).summaries() if (runs_dir / "ledger.sqlite").exists() else []
    return not run_dirs(runs_dir) and not rows


@pytest.mark.parametrize("args, says", [
    (["--family", "calc_chain", "--level", "99"], "calc_chain has levels 1, 2, 3, 4, not 99"),
    (["--family", "calc_chain", "--level", "0"], "not 0"),
    (["--family", "nope"], "no task family named 'nope'"),
    (["--family", "calc_chain", "-s", "loop.steps=0"], "loop.steps"),
    (["--family", "calc_chain", "-s", "inner_trainer.use=nope"], "nope"),
    (["--family", "calc_chain", "-s", "reward_spec=nope"], "no reward spec 'nope'"),
])
def test_job_run_checks_every_argument_before_creating_a_run(tmp_path, args, says):
    needs_default_plugins(["job"])
    runs = tmp_path / "runs"
    result = CliRunner().invoke(cli, ["job", "run", *args, "--runs-dir", str(runs)], catch_exceptions=False)
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: "), result.output
    assert no_run_was_created(runs), sorted(runs.iterdir())


def test_job_run_checks_the_job_files_before_creating_a_run(tmp_path):
    needs_default_plugins(["job"])
    runs, job = tmp_path / "runs", tmp_path / "job"
    job.mkdir()
    (job / "dataset.py").write_bytes(b"\xff\xfe not text")
    result = CliRunner().invoke(cli, ["job", "run", "--family", "calc_chain", "--dir", str(job), "--runs-dir",
                                      str(runs)], catch_exceptions=False)
    assert result.exit_code == 2 and "dataset.py" in result.output and "utf-8" in result.output, result.output
    (job / "dataset.py").write_text("x" * 1_000_001)
    result = CliRunner().invoke(cli, ["job", "run", "--family", "calc_chain", "--dir", str(job), "--runs-dir",
                                      str(runs)], catch_exceptions=False)
    assert result.exit_code == 2 and "at most 1000000" in result.output, result.output
    assert no_run_was_created(runs)


def test_run_checks_the_reward_spec_before_creating_a_run(tmp_path):
    needs_default_plugins(["run"])
    runs = tmp_path / "runs"
    result = CliRunner().invoke(cli, ["run", "-s", "reward_spec=nope", "--runs-dir", str(runs)],
                                catch_exceptions=False)
    assert result.exit_code == 2 and "no reward spec 'nope'" in result.output, result.output
    assert no_run_was_created(runs)


@pytest.mark.parametrize("args", [["run"], ["job", "run", "--family", "calc_chain"]])
def test_no_run_starts_where_the_sandbox_cannot_be_built(tmp_path, monkeypatch, args):
    import aitrainsai.isolation

    needs_default_plugins(args)
    monkeypatch.setattr(aitrainsai.isolation, "sandbox_problem",
                        lambda: "bwrap: No permissions to create new namespace")
    result = CliRunner().invoke(cli, ["--runs-dir", str(tmp_path / "runs"), *args])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["Error: this machine cannot build the sandbox agent code runs in: "
                                                  "bwrap: No permissions to create new namespace"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# -- plugin selection, broken plugins, versions on resume --------------------------------------------------------------
import test_plugins  # noqa: E402

fake_installed = test_plugins.fake_installed  # the fixture, shared with test_plugins


def test_a_broken_plugin_leaves_help_and_listings_working_naming_the_way_out(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-broken")
    for args in (["--help"], ["plugins"], ["families"], ["reward", "show"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0 and "Traceback" not in result.output, (args, result.output)
        warnings = result.stderr.strip().splitlines()
        assert len(warnings) == 1, (args, result.stderr)
        assert "'aitrainsai-fake-broken' cannot be loaded and is left out" in warnings[0]
        assert "--plugins no:aitrainsai-fake-broken" in warnings[0] and "pip uninstall" in warnings[0]
    listed = {p["name"]: p for p in json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).stdout)}
    assert "the module it needs is not installed" in listed["aitrainsai-fake-broken"]["error"]
    assert listed["aitrainsai-fake-alpha"]["error"] is None
    quiet = CliRunner().invoke(cli, ["plugins", "--plugins", "no:aitrainsai-fake-broken"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and "aitrainsai-fake-broken" not in quiet.stdout


@pytest.mark.parametrize("args", [["run"], ["job", "run", "--family", "alpha"]])
def test_a_run_refuses_a_broken_plugin_in_one_line(tmp_path, fake_installed, args):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-broken")
    line = one_line_error(invoke(*args, runs_dir=tmp_path / "runs"))
    assert "plugin 'aitrainsai-fake-broken' cannot be loaded" in line and "a run needs every selected plugin" in line
    assert "--plugins no:aitrainsai-fake-broken" in line
    assert no_run_was_created(tmp_path / "runs")
    left_out = invoke(*args, "--plugins", "no:aitrainsai-fake-broken", runs_dir=tmp_path / "runs")
    assert "cannot be loaded" not in left_out.output  # it gets past the plugins (and stops later: no trainer here)


def test_a_selection_mixing_names_and_no_names_is_one_line(fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    line = one_line_error(CliRunner().invoke(cli, ["plugins", "--plugins",
                                                   "aitrainsai-fake-alpha,no:aitrainsai-fake-beta"]))
    assert "not both" in line


def recorded_run(runs_dir: Path, selection: str | None, versions: dict[str, str]):
    plugins = [{"name": name, "version": version, "builtin": name == "aitrainsai"}
               for name, version in versions.items()]
    return Ledger(runs_dir).create_run({"loop": {"steps": 0}}, plugins, name="demo", selection=selection)


def test_resume_refuses_changed_plugin_versions_unless_allowed(tmp_path, fake_installed):
    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    runs = tmp_path / "runs"
    run = recorded_run(runs, "aitrainsai-fake-alpha,aitrainsai-fake-gone",
                       {"aitrainsai": "0.1.0", "aitrainsai-fake-alpha": "0.9", "aitrainsai-fake-gone": "2.0"})
    line = one_line_error(invoke("run", "--resume", "demo", runs_dir=runs))
    assert ("recorded aitrainsai-fake-alpha 0.9 (installed: 1.0), aitrainsai-fake-gone 2.0 (installed: none); "
            "install the recorded versions, or continue with --allow-version-change") in line
    assert list(run.events()) == []
    allowed = invoke("run", "--resume", "demo", "--allow-version-change", runs_dir=runs)
    assert "recorded other plugin versions" not in allowed.output and "loop.steps" in allowed.output, allowed.output
    (event,) = run.events("plugin_versions_changed")
    assert [(c["name"], c["recorded"], c["installed"]) for c in event.data["changes"]] == [
        ("aitrainsai-fake-alpha", "0.9", "1.0"), ("aitrainsai-fake-gone", "2.0", None)]
    again = invoke("run", "--resume", "demo", runs_dir=runs)  # the accepted versions are the recorded ones now
    assert "recorded other plugin versions" not in again.output and "loop.steps" in again.output, again.output


def test_resume_uses_the_recorded_selection_unless_plugins_is_given(tmp_path, fake_installed, monkeypatch):
    from aitrainsai.plugins import Plugins

    fake_installed("aitrainsai-fake-alpha", "aitrainsai-fake-beta")
    runs = tmp_path / "runs"
    recorded_run(runs, "aitrainsai-fake-beta", {"aitrainsai": "0.1.0", "aitrainsai-fake-beta": "1.0"})
    loaded = []
    load = Plugins.load.__func__
    monkeypatch.setattr(Plugins, "load", classmethod(lambda cls, selection=None, **kw: loaded.append(selection)
                                                     or load(cls, selection, **kw)))
    monkeypatch.setenv("AITRAINSAI_PLUGINS", "aitrainsai-fake-alpha")  # a standing preference: the record wins
    invoke("run", "--resume", "demo", runs_dir=runs)
    assert loaded[0] == "aitrainsai-fake-beta"
    loaded.clear()
    invoke("run", "--resume", "demo", "--plugins", "aitrainsai-fake-alpha,aitrainsai-fake-beta", runs_dir=runs)
    assert loaded[0] == "aitrainsai-fake-alpha,aitrainsai-fake-beta"


def test_a_new_run_records_its_plugin_selection_and_versions(tmp_path, monkeypatch):
    import aitrainsai.cli.command
    import aitrainsai.run.loop

    from aitrainsai.plugins import installed_plugins

    if not {"aitrainsai-outer-openai", "aitrainsai-outer-recipe"} <= set(installed_plugins()):
        pytest.skip("needs the openai and recipe outer trainers installed")
    summary = aitrainsai.run.loop.LoopSummary(steps=0, launched=0, skipped=0, dropped=0)
    monkeypatch.setattr(aitrainsai.run.loop, "run_loop", lambda *a, **k: summary)
    monkeypatch.setattr(aitrainsai.cli.command, "_require_sandbox", lambda: None)
    result = invoke("run", "--no-report", "--plugins", "no:aitrainsai-outer-openai", "-s", "outer_trainer.use=recipe",
                    runs_dir=tmp_path)
    if result.exit_code == 2:
        pytest.skip(f"the default run's config does not resolve here: {result.output}")
    assert result.exit_code == 0, result.output
    info = Ledger(tmp_path).run("latest").info()
    assert info.selection is not None
    assert "aitrainsai-outer-openai" not in info.selection and "aitrainsai-outer-recipe" in info.selection
    assert {p["name"] for p in info.plugins} == {"aitrainsai", *info.selection.split(",")}
    shown = " ".join(invoke("show", "latest", runs_dir=tmp_path).output.split())
    assert f"(selection: '{info.selection.split(',')[0]}" in shown and "aitrainsai-family-" in shown


def test_families_print_their_description():
    from aitrainsai.plugins import Plugins

    registry = Plugins.load().task_families
    if not len(registry):
        pytest.skip("no task family installed")
    rows = json.loads(invoke("families", "--json").output)
    assert all(row["description"] == registry.get(row["name"]).description for row in rows)
    name = rows[0]["name"]
    assert registry.get(name).description[:20] in invoke("families").output


def test_new_family_dir_is_the_parent_folder(tmp_path):
    assert "PARENT/NAME" in invoke("new", "family", "--help").output
    result = invoke("new", "family", "tides", "--dir", str(tmp_path))
    assert result.exit_code == 0 and (tmp_path / "tides" / "pyproject.toml").exists()


def test_the_commands_of_a_plugin_group_take_the_common_options():
    import click

    from aitrainsai.cli.command import common_options

    @click.group()
    def group():
        """A plugin's group."""

    @group.command()
    def sub():
        """A command of it."""

    common_options(group)
    assert {"plugins", "runs_dir"} <= {p.name for p in sub.params}, "a plugin group's command refuses --runs-dir"
