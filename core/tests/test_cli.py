import json

from click.testing import CliRunner

from aitrainsai.cli import cli
from aitrainsai.ledger import Ledger


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
    run.upsert_job("job1", status="done", episode_id="ep1", result={"pre": 0.2, "post": 0.4}, wall_s=3)
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
