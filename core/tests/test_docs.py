"""The hook reference stays honest: every hook is documented and tested."""

import inspect
from pathlib import Path

from aitrainsai import hookspecs

ROOT = Path(__file__).resolve().parents[2]


def hooks():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("register_") and callable(fn)}


def _parameters(fn) -> str:
    """The hook's parameters as the reference names them, ``(register)``: the types are in its signature."""
    parameters = inspect.signature(fn).parameters.values()
    return str(inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in parameters]))


def test_every_hook_is_documented_with_its_signature():
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for name, fn in hooks().items():
        assert f"`{name}{_parameters(fn)}`" in contributing, f"{name} missing from CONTRIBUTING.md"
        assert len(inspect.getdoc(fn) or "") > 60, f"{name} needs a docstring that serves as reference"


def test_every_hook_has_a_test():
    sources = "\n".join(p.read_text() for p in ROOT.glob("core/tests/*.py"))
    for name in hooks():
        assert f"def {name}(" in sources, f"no test plugin implements {name}"
