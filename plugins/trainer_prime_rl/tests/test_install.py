"""prime-rl on a worker: cloned at the pinned tag and commit, synced with uv, once per worker. Here the source is a
local git repository with the pinned tag and an empty project, and uv runs offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import pytest
from aitrainsai_trainer_prime_rl.job import Failed, ensure_prime_rl
from aitrainsai_trainer_prime_rl.jobspec import WorkerSpec
from aitrainsai_trainer_prime_rl.pins import STACK

UV = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
pytestmark = pytest.mark.skipif(not Path(UV).exists(), reason="needs uv (make install puts it into .venv)")


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def source(tmp_path):
    repo = tmp_path / "prime-rl"
    repo.mkdir()
    (repo / "pyproject.toml").write_text('[project]\nname = "prime-rl"\nversion = "0.6.0"\n'
                                         'requires-python = ">=3.11"\ndependencies = []\n\n'
                                         '[tool.uv]\npackage = false\n')
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "v0.6.0", cwd=repo)
    git("tag", "v0.6.0", cwd=repo)
    return repo, git("rev-parse", "HEAD", cwd=repo)


def test_prime_rl_is_installed_once_per_worker_at_the_pinned_commit(tmp_path, source, monkeypatch):
    repo, commit = source
    monkeypatch.setenv("AITRAINSAI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "never")
    spec = WorkerSpec(stack=replace(STACK, tag="v0.6.0", commit=commit), source=str(repo), uv=UV)
    root = ensure_prime_rl(spec)
    assert root == tmp_path / "cache" / "prime-rl" / "v0.6.0"
    assert (root / ".venv" / "bin" / "python").exists() and (root / ".aitrainsai-ready").read_text() == commit
    stamp = (root / ".aitrainsai-ready").stat().st_mtime_ns
    (repo / "moved").write_text("a later commit does not matter: the worker keeps its install")
    assert ensure_prime_rl(spec) == root and (root / ".aitrainsai-ready").stat().st_mtime_ns == stamp


def test_a_tag_that_moved_is_refused(tmp_path, source, monkeypatch):
    repo, commit = source
    monkeypatch.setenv("AITRAINSAI_CACHE_DIR", str(tmp_path / "cache"))
    spec = WorkerSpec(stack=replace(STACK, tag="v0.6.0", commit="38494ccb4140897b1c9e7a9ba8da59dcd8940d47"),
                      source=str(repo), uv=UV)
    with pytest.raises(Failed, match=f"prime-rl v0.6.0 is commit {commit} at .*, not the pinned 38494ccb"):
        ensure_prime_rl(spec)
    assert not (tmp_path / "cache" / "prime-rl" / "v0.6.0" / ".aitrainsai-ready").exists()


def test_a_commit_of_main_is_fetched_by_its_hash(tmp_path, source, monkeypatch):
    from aitrainsai_trainer_prime_rl.pins import MAIN_V1

    repo, pinned = source
    (repo / "later.txt").write_text("main moved on after the pin")
    git("add", ".", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "later", cwd=repo)
    monkeypatch.setenv("AITRAINSAI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "never")
    stack = replace(MAIN_V1, commit=pinned)
    root = ensure_prime_rl(WorkerSpec(stack=stack, source=str(repo), uv=UV))
    assert root == tmp_path / "cache" / "prime-rl" / f"main-{pinned[:7]}"
    assert git("rev-parse", "HEAD", cwd=root) == pinned and not (root / "later.txt").exists()
    assert (root / ".aitrainsai-ready").read_text() == pinned
    missing = replace(MAIN_V1, commit="0" * 40)  # a hash the source does not have
    with pytest.raises(Failed, match="git fetch of prime-rl failed"):
        ensure_prime_rl(WorkerSpec(stack=missing, source=str(repo), uv=UV))
