"""``aitrainsai new family NAME``: a new task-family distribution that installs and passes the conformance kit."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

FILES: dict[str, str] = {
    "pyproject.toml": '''\
[project]
name = "{dist}"
version = "0.1.0"
description = "aitrainsai task family: {name}"
requires-python = ">=3.11"
dependencies = ["aitrainsai"]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.aitrainsai]
{name} = "{module}.plugin"

[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["src/{module}"]
''',
    "README.md": '''\
# {dist}

The `{name}` task family for aitrainsai. `world.py` is public (the generator and the tools an agent's job may
import); `family.py` holds the hidden eval, the scorer and the reference solver.

Test it alone: `pip install -e . && pytest tests`.
''',
    "src/{module}/__init__.py": '''\
"""The {name} task family: its public generator and tools.

The job template does ``from {module} import TOOLS, generate``: keep both exported here (the conformance kit checks).
"""

from {module}.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
''',
    "src/{module}/world.py": '''\
"""Public: the seeded generator and the tools. An agent's job may import this module."""

from __future__ import annotations

import random

from aitrainsai import Item

FAMILY = "{name}"
LEVELS = {{1: 2, 2: 3, 3: 4}}  # level -> how many registers the answer adds up
# 10,000 register names keep fresh questions apart from the hidden ones (the kit checks 50 against 600).


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    items = []
    for index in range(n):
        rng = random.Random(f"{{FAMILY}}:{{seed}}:{{level}}:{{index}}")
        registers = {{f"r{{k}}": rng.randint(100, 999) for k in rng.sample(range(10_000), 6)}}
        names = rng.sample(sorted(registers), LEVELS[level])
        question = f"What is the sum of registers {{', '.join(names)}}?"
        answer = str(sum(registers[name] for name in names))
        items.append(Item(family=FAMILY, level=level, seed=seed, index=index, question=question, answer=answer,
                          world={{"registers": registers}}))
    return items


# A tool that reads the item's state takes it as its first parameter, `world`; one that needs none (add) omits it.
def read_register(world: dict, name: str) -> int:
    """Read the value of a register.

    Args:
        name: the register's name, such as r12
    """
    return world["registers"][name]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


TOOLS = (read_register, add)
''',
    "src/{module}/family.py": '''\
"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import re

from aitrainsai import Item, TaskFamily, ToolSession
from {module} import world


class {cls}(TaskFamily):
    name = world.FAMILY
    levels = tuple(world.LEVELS)
    default_level = 1
    eval_seed = {eval_seed}
    turn_limit = 6
    description = "Add up register values read with tools."  # one line, shown by `aitrainsai families`
    goal = "Teach the model to read registers with the tools and add their values."
    system_prompt = ("You can call tools. Read each register the question names, add the values, and end with "
                     "<answer>NUMBER</answer>.")
    public_modules = ("{module}", "{module}.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def solve(self, item: Item, session: ToolSession) -> str:
        names = re.findall(r"r\\d+", item.question)
        total = int(session.call("read_register", name=names[0]))
        for name in names[1:]:
            total = int(session.call("add", a=total, b=int(session.call("read_register", name=name))))
        return str(total)
''',
    "src/{module}/plugin.py": '''\
"""Registers the {name} family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from {module}.family import {cls}

    register({cls})
''',
    "tests/test_{name}.py": '''\
from aitrainsai.testing import TaskFamilyConformance
from {module}.family import {cls}


class Test{cls}(TaskFamilyConformance):
    family = {cls}
    distribution = "{dist}"
''',
}


def family_names(name: str) -> dict[str, str]:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"family name {name!r}: use lowercase letters, digits and '_', starting with a letter")
    return {
        "name": name,
        "dist": "aitrainsai-family-" + name.replace("_", "-"),
        "module": "aitrainsai_family_" + name,
        "cls": "".join(part.capitalize() for part in name.split("_")) + "Family",
        "eval_seed": str(secrets.randbelow(10**9)),
    }


def new_family(name: str, destination: Path) -> Path:
    """Write the distribution into ``destination``/``name``; refuse to overwrite an existing directory."""
    names = family_names(name)
    root = Path(destination) / name
    if root.exists():
        raise FileExistsError(f"{root} already exists")
    for relative, template in FILES.items():
        path = root / relative.format(**names)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**names))
    return root
