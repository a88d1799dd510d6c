"""A scaffolded family installs and passes the conformance kit without edits."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_scaffolded_family_passes_the_kit(tmp_path):
    subprocess.run([sys.executable, "-m", "aitrainsai.cli", "new", "family", "tide_tables", "--dir", str(tmp_path)],
                   check=True, capture_output=True)
    root = tmp_path / "tide_tables"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(root)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("AITRAINSAI_PLUGINS", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
                         capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    listed = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "families", "--json", "--plugins",
                             "aitrainsai-family-tide-tables"], capture_output=True, text=True, env=env)
    assert '"tide_tables"' in listed.stdout, listed.stderr
