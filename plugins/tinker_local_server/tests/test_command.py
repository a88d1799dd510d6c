"""The ``aitrainsai tinker-serve`` command this distribution registers, and the refusals that come before any model
is loaded (one line on stderr, exit status 2)."""

from __future__ import annotations

import os
import subprocess
import sys

from aitrainsai_tinker_local_server.__main__ import serve


def aitrainsai(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITRAINSAI_")}
    return subprocess.run([sys.executable, "-m", "aitrainsai.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_command_is_this_distributions():
    shown = aitrainsai("tinker-serve", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "Serve the Tinker API" in shown.stdout and "--state-dir" in shown.stdout
    alone = aitrainsai("--plugins", "aitrainsai-tinker-local-server", "tinker-serve", "--help")
    assert alone.returncode == 0, alone.stderr


def test_bad_input_refuses_to_start_in_one_line(tmp_path):
    refused = aitrainsai("tinker-serve", "--port", "70000", "--state-dir", str(tmp_path))
    assert refused.returncode == 2
    assert refused.stderr.strip() == "aitrainsai tinker-serve: port 70000 is outside 0..65535"
    keyed = aitrainsai("tinker-serve", "--state-dir", str(tmp_path), "--api-key", "sk-nope")
    assert keyed.returncode == 2 and keyed.stderr.strip().endswith("--api-key must start with 'tml-' (the tinker "
                                                                   "SDK sends no other keys)")


def test_a_bad_rate_card_or_billing_key_refuses_to_start_in_one_line(tmp_path, capsys):
    assert serve(0, tmp_path, rates='{"prefil": 0.5}') == 2
    assert serve(0, tmp_path, rates="{not json") == 2
    assert serve(0, tmp_path, billing_key="sk-billing") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("aitrainsai tinker-serve: ") for line in lines)
    assert "--rates is not a rate card" in lines[0] and "--billing-key must start with 'tml-'" in lines[2]


def test_a_bad_allow_host_refuses_to_start_in_one_line(tmp_path, capsys):
    for name in ["evil host", "a/b", "host:99999", "", "-x", "x" * 300, "\u043f\u0440\u0438\u043c\u0435\u0440"]:
        assert serve(0, tmp_path, allow_hosts=[name]) == 2, name
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 7 and all(line.startswith("aitrainsai tinker-serve: --allow-host ") for line in lines)
