"""The public API: ``aitrainsai`` re-exports what plugins use, loads it on first use, and says so in one list."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import aitrainsai
import aitrainsai.testing


def test_every_public_name_resolves_and_is_listed():
    for name in aitrainsai.__all__:
        extra = aitrainsai._EXTRAS.get(aitrainsai._EXPORTS.get(name, ""))
        if extra is not None and importlib.util.find_spec(extra[1]) is None:
            # the core alone: a name that needs an extra says which, in one line
            needs = rf"aitrainsai\.{name} needs {extra[1]}: pip install 'aitrainsai\[{extra[0]}\]'"
            with pytest.raises(ImportError, match=needs):
                getattr(aitrainsai, name)
            continue
        assert getattr(aitrainsai, name) is not None, name
    for name in aitrainsai.testing.__all__:
        assert getattr(aitrainsai.testing, name) is not None, name
    assert set(aitrainsai.__all__) <= set(dir(aitrainsai))
    assert len(aitrainsai.__all__) == len(set(aitrainsai.__all__))


def test_a_name_that_is_not_public_is_an_attribute_error():
    try:
        _ = aitrainsai.LOCK_NAME
    except AttributeError as exc:
        assert "LOCK_NAME" in str(exc)
    else:
        raise AssertionError("a private name was exported")


def test_the_type_checking_imports_name_what_loads_at_run_time():
    """Type checkers read the TYPE_CHECKING imports, the interpreter the lazy table: they must say the same."""
    tree = ast.parse(Path(aitrainsai.__file__).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    imported = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported == aitrainsai._EXPORTS


def test_importing_the_package_loads_none_of_the_core():
    """Sandboxed processes import the package (``-m aitrainsai.jobs.env_server``): that alone must not load the core."""
    code = "import sys, aitrainsai; print(sorted(m for m in sys.modules if m.startswith(('aitrainsai', 'pydantic'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['aitrainsai', 'aitrainsai.hookspecs']"


def test_a_name_whose_extra_is_missing_says_what_to_install_in_one_line():
    code = ("import sys; sys.modules['verifiers'] = None\n"
            "import aitrainsai\n"
            "try:\n    aitrainsai.SandboxedEnv\n"
            "except ImportError as exc:\n    print(exc)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "aitrainsai.SandboxedEnv needs verifiers: pip install 'aitrainsai[jobs]'"
