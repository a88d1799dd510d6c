"""A minimal third-party plugin, written to a temporary directory, pip-installed, discovered and selected."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN = '''
from aitrainsai import hookimpl
from aitrainsai.families import Item, TaskFamily
from aitrainsai.rewards import RewardComponent


def shout(world: dict, text: str) -> str:
    """Shout text.

    Args:
        text: what to shout
    """
    return text.upper()


class HelloFamily(TaskFamily):
    name = "hello_family"
    goal = "Teach shouting."
    system_prompt = "Shout the word with the tool."
    public_modules = ("aitrainsai_hello",)
    tool_functions = (shout,)

    def generate(self, seed, level, n):
        return [Item(family=self.name, level=level, seed=seed, index=i, question=f"shout w{seed}x{i}",
                     answer=f"W{seed}X{i}") for i in range(n)]

    def solve(self, item, session):
        return session.call("shout", text=item.question.split()[-1])


class HelloBonus(RewardComponent):
    name = "hello_bonus"

    def score(self, episode):
        return 0.5

    def explain(self):
        return "hello_bonus: always 0.5"


@hookimpl
def register_task_families(register):
    register(HelloFamily)


@hookimpl
def register_reward_components(register):
    register(HelloBonus)


@hookimpl
def register_commands(cli):
    @cli.command()
    def hello():
        """Say hello from a plugin."""
        print("hello from a plugin")
'''

PYPROJECT = '''
[project]
name = "aitrainsai-hello"
version = "0.3.1"
dependencies = ["aitrainsai"]

[project.entry-points.aitrainsai]
hello = "aitrainsai_hello"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
include = ["aitrainsai_hello.py"]
'''


BROKEN = PYPROJECT.replace("aitrainsai-hello", "aitrainsai-broken").replace("hello", "broken")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """aitrainsai-hello, and beside it aitrainsai-broken, whose module fails to import."""
    source = tmp_path_factory.mktemp("aitrainsai-hello")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "aitrainsai_hello.py").write_text(PLUGIN)
    broken = tmp_path_factory.mktemp("aitrainsai-broken")
    (broken / "pyproject.toml").write_text(BROKEN)
    (broken / "aitrainsai_broken.py").write_text("import a_module_nobody_installed\n")
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source), str(broken)], check=True, capture_output=True)
    return target


def cli(site: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(site), **(env or {})}
    environment.pop("AITRAINSAI_PLUGINS", None) if "AITRAINSAI_PLUGINS" not in (env or {}) else None
    return subprocess.run([sys.executable, "-m", "aitrainsai.cli", *args], capture_output=True, text=True,
                          env=environment)


def test_discovered_with_version_and_components(site):
    out = cli(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    hello = next(p for p in json.loads(out.stdout) if p["name"] == "aitrainsai-hello")
    assert hello["version"] == "0.3.1"
    assert hello["components"] == {"task_families": ["hello_family"], "reward_components": ["hello_bonus"]}


def test_selected_by_name_and_left_out_when_not_named(site):
    only = json.loads(cli(site, "plugins", "--json", "--plugins", "aitrainsai-hello").stdout)
    assert [p["name"] for p in only] == ["aitrainsai", "aitrainsai-hello"]
    none = json.loads(cli(site, "--plugins", "", "plugins", "--json").stdout)
    assert [p["name"] for p in none] == ["aitrainsai"]
    via_env = json.loads(cli(site, "plugins", "--json", env={"AITRAINSAI_PLUGINS": ""}).stdout)
    assert [p["name"] for p in via_env] == ["aitrainsai"]


def test_its_components_show_up_in_the_registries(site):
    code = textwrap.dedent("""
        from aitrainsai.plugins import Plugins
        p = Plugins.load(["aitrainsai-hello"])
        print(p.task_families.owner("hello_family"), p.reward_components.owner("hello_bonus"))
        print("hello_family" in Plugins.load("").task_families)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.stdout.split() == ["aitrainsai-hello", "aitrainsai-hello", "False"], out.stderr


def test_families_command_and_plugin_command(site):
    families = json.loads(cli(site, "families", "--json", "--plugins", "aitrainsai-hello").stdout)
    assert [f["name"] for f in families] == ["hello_family"]
    out = cli(site, "hello", "--plugins", "aitrainsai-hello")
    assert out.returncode == 0 and "hello from a plugin" in out.stdout, out.stderr
    out = cli(site, "--plugins", "", "hello")
    assert out.returncode != 0 and "No such command 'hello'" in out.stderr


def test_unknown_plugin_name_is_an_error_listing_installed(site):
    out = cli(site, "plugins", "--plugins", "aitrainsai-helo")
    assert out.returncode != 0
    assert "unknown plugin 'aitrainsai-helo' (did you mean aitrainsai-hello?)" in out.stderr
    assert "installed plugins:" in out.stderr and "aitrainsai-hello" in out.stderr


def test_a_broken_plugin_leaves_help_and_listings_working_and_a_run_refuses_it(site, tmp_path):
    way_out = "leave it out with --plugins no:aitrainsai-broken"
    for args in (["--help"], ["plugins"], ["families"]):
        out = cli(site, *args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr)
        assert "plugin 'aitrainsai-broken' cannot be loaded and is left out" in out.stderr, out.stderr
        assert "No module named 'a_module_nobody_installed'" in out.stderr and way_out in out.stderr
        assert "pip uninstall aitrainsai-broken" in out.stderr
    assert "hello" in cli(site, "--help").stdout  # the working plugin's command is still there
    out = cli(site, "run", "--runs-dir", str(tmp_path / "runs"))
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert "a run needs every selected plugin" in out.stderr and way_out in out.stderr
    quiet = cli(site, "plugins", "--plugins", "no:aitrainsai-broken")
    assert quiet.returncode == 0 and quiet.stderr == "" and "aitrainsai-hello" in quiet.stdout


def test_selecting_a_family_by_its_name_points_at_the_distribution(site):
    out = cli(site, "plugins", "--plugins", "hello_family")
    assert out.returncode == 1
    assert ("'hello_family' is a task family of plugin 'aitrainsai-hello': select the distribution, --plugins "
            "aitrainsai-hello") in out.stderr
