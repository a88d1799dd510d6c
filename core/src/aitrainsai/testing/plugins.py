"""Conformance checks every plugin distribution passes, whatever its kind."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import ClassVar

import pytest

from aitrainsai.plugins import CORE_DISTRIBUTION, Plugins, installed_plugins

HEAVY_MODULES = ("torch", "transformers", "peft", "trl", "tinker", "runpod", "ray", "verifiers", "numpy")


class PluginConformance:
    """Set ``distribution`` (the pip name) and ``kind`` (a registry name such as ``"task_families"``)."""

    distribution: ClassVar[str]
    kind: ClassVar[str]

    def component_names(self) -> list[str]:
        return []

    def _skip_builtin(self):
        if self.distribution == CORE_DISTRIBUTION:
            pytest.skip("built into the core: always loaded, no entry point")

    def test_distribution_is_discovered(self):
        self._skip_builtin()
        assert self.distribution in installed_plugins(), (
            f"{self.distribution} has no entry point in the 'aitrainsai' group; add "
            '[project.entry-points.aitrainsai] to its pyproject.toml and pip install it')

    def test_selected_alone_it_registers_its_components(self):
        plugins = Plugins.load([self.distribution])
        provided = plugins.infos[self.distribution].components.get(self.kind, [])
        assert provided, f"{self.distribution} registers no {self.kind}"
        for name in self.component_names():
            assert name in provided
            assert plugins.registries[self.kind].owner(name) == self.distribution

    def test_left_out_when_not_selected(self):
        self._skip_builtin()
        plugins = Plugins.load("")
        assert self.distribution not in plugins.infos
        for name in self.component_names():
            assert name not in plugins.registries[self.kind]

    def test_loading_imports_nothing_heavy(self):
        code = (
            "import json, sys\n"
            "from aitrainsai.plugins import Plugins\n"
            f"Plugins.load([{self.distribution!r}])\n"
            f"print(json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        heavy = json.loads(out.stdout.strip().splitlines()[-1])
        assert heavy == [], f"loading {self.distribution} imports {heavy}: import them inside the component's methods"

    def test_component_configs_have_defaults_and_forbid_unknown_keys(self):
        plugins = Plugins.load([self.distribution])
        registry = plugins.registries[self.kind]
        for name in plugins.infos[self.distribution].components.get(self.kind, []):
            component = registry.get(name)
            component.Config()  # every option has a default
            assert component.Config.model_config.get("extra") == "forbid", f"{name}.Config must forbid unknown keys"
