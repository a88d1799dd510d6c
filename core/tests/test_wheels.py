"""Wheels of distributions installed from a local folder, for workers with no index that holds them."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from aitrainsai.backends import Runtime
from aitrainsai.wheels import build_local_wheels, local_source
from pydantic import ValidationError

CORE = Path(__file__).resolve().parents[1]


def test_only_distributions_installed_from_a_folder_are_local():
    assert local_source("aitrainsai") == CORE  # the workspace installs it editable
    assert local_source("pluggy") is None  # from an index
    assert local_source("no-such-distribution") is None


def test_the_wheel_is_built_here_without_an_index(tmp_path):
    built = build_local_wheels(["pluggy", "aitrainsai"], tmp_path / "wheels")
    assert list(built) == ["aitrainsai"]
    names = zipfile.ZipFile(built["aitrainsai"]).namelist()
    assert "aitrainsai/backends.py" in names and not [n for n in names if "/tests/" in n or n.startswith("tests/")]
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == [built["aitrainsai"].name]  # no build leftovers


def test_no_deps_names_only_distributions_of_the_runtime():
    assert Runtime(distributions={"a": "==1"}, no_deps=["a"]).no_deps == ["a"]
    with pytest.raises(ValidationError, match="no_deps names b, which distributions does not"):
        Runtime(distributions={"a": "==1"}, no_deps=["b"])
