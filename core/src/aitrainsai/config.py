"""Run configuration: pydantic models loaded from TOML, with ``key.path=value`` overrides from the command line.

The run config has one section per component kind. ``use`` picks the component; a sub-table named after a component
holds that component's options, validated against the component's own ``Config`` model once plugins are loaded::

    [gpu_backend]
    use = "local"
    [gpu_backend.local]
    workers = 2

Every error names the key path and the reason.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TRAIN_FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch"]
HELD_OUT_FAMILIES = ["triage"]


class ConfigError(Exception):
    """A run config that cannot be used; ``problems`` are ``(key path, reason)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        self.source = source
        super().__init__("\n".join(f"{source}: {path or '(top level)'}: {reason}" for path, reason in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoopConfig(Strict):
    steps: int = Field(2, ge=1, description="outer steps")
    group_size: int = Field(2, ge=2, description="episodes per task (a GRPO group)")
    groups_per_step: int = Field(1, ge=1, description="groups trained on per outer step")
    max_steps_off_policy: int = Field(2, ge=0, description="oldest policy lag still trained on")
    eval_every: int = Field(0, ge=0, description="outer steps between evaluations with no update (0: only at the end)")
    final_eval: bool = Field(True, description="evaluate the held-out and training families when the run ends")
    eval_episodes: int = Field(1, ge=1, description="episodes per family in an evaluation")
    max_agent_turns: int = Field(16, ge=1, description="agent turns per episode")
    max_group_factor: int = Field(3, ge=1, description="stop after steps x groups_per_step x this many groups")
    seed: int = 0


class ComponentSection(BaseModel):
    """``use`` names the component; other keys are component names holding that component's options."""

    model_config = ConfigDict(extra="allow")

    use: str

    def options(self) -> dict[str, dict[str, Any]]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _options_are_tables(self) -> "ComponentSection":
        for key, value in self.options().items():
            if not isinstance(value, dict):
                raise ValueError(f"{key!r} must be a table of options for the component named {key!r}")
        return self


class GpuBackendSection(ComponentSection):
    use: str = "local"


class InnerTrainerSection(ComponentSection):
    use: str = "local"


class OuterTrainerSection(ComponentSection):
    use: str = "recipe"


class FamiliesSection(BaseModel):
    """Which families train the agent and which are held out; sub-tables hold per-family options."""

    model_config = ConfigDict(extra="allow")

    train: list[str] = Field(default_factory=lambda: list(TRAIN_FAMILIES))
    held_out: list[str] = Field(default_factory=lambda: list(HELD_OUT_FAMILIES))
    level: int | None = Field(None, description="difficulty level for every family (default: each family's)")

    def options(self) -> dict[str, dict[str, Any]]:
        return dict(self.model_extra or {})


class RunConfig(Strict):
    name: str | None = None
    reward_spec: str = "default"
    loop: LoopConfig = Field(default_factory=LoopConfig)
    families: FamiliesSection = Field(default_factory=FamiliesSection)
    gpu_backend: GpuBackendSection = Field(default_factory=GpuBackendSection)
    inner_trainer: InnerTrainerSection = Field(default_factory=InnerTrainerSection)
    outer_trainer: OuterTrainerSection = Field(default_factory=OuterTrainerSection)


SECTION_KINDS = {
    "gpu_backend": "gpu_backends",
    "inner_trainer": "inner_trainers",
    "outer_trainer": "outer_trainers",
    "families": "task_families",
}


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"loop.steps=5"`` -> ``(["loop", "steps"], 5)``; the value is read as TOML, else kept as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([(text, "an override is KEY.PATH=VALUE, e.g. loop.steps=5")], "--set")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


PRESETS_DIR = Path(__file__).parent / "presets"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_config(path: Path | None = None, overrides: Iterable[str] = (), preset: str | None = None) -> RunConfig:
    """Read a preset, then a TOML run config over it (or the defaults), apply overrides, validate the core
    sections."""
    data: dict[str, Any] = {}
    source = str(path) if path else "config"
    if preset is not None:
        if preset not in presets():
            raise ConfigError([("", f"no preset {preset!r} (presets: {', '.join(presets())})")], "--preset")
        data = tomllib.loads((PRESETS_DIR / f"{preset}.toml").read_text())
    if path is not None:
        try:
            _merge(data, tomllib.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError([("", f"no such file: {path}")], source) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([("", f"not valid TOML: {exc}")], source) from None
    for override in overrides:
        keys, value = parse_override(override)
        node = data
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError([(".".join(keys), f"{key!r} is a value, not a table")], "--set")
            node = child
        node[keys[-1]] = value
        source = f"{source} (with --set)" if "--set" not in source else source
    return validate(RunConfig, data, source)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def validate(model: type[BaseModel], data: Any, source: str, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc, prefix), source) from None


def describe(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    problems = []
    for error in exc.errors():
        path = ".".join(str(part) for part in (prefix.split(".") if prefix else []) + list(error["loc"]))
        if error["type"] == "extra_forbidden":
            reason = "unknown key"
        else:
            reason = error["msg"]
            if "input" in error and error["type"] != "missing":
                reason += f" (got {error['input']!r})"
        problems.append((path, reason))
    return problems


def resolve(config: RunConfig, plugins: Any, source: str = "config") -> dict[str, Any]:
    """Validate component choices and options against the loaded plugins; return the full resolved config.

    Every component named in a section must be registered, and its options must pass its ``Config``. The result has
    the selected components' options with defaults filled in, ready to store in the ledger.
    """
    problems: list[tuple[str, str]] = []
    resolved = config.model_dump(exclude={"gpu_backend", "inner_trainer", "outer_trainer", "families"})
    for section_name, kind in SECTION_KINDS.items():
        section = getattr(config, section_name)
        registry = plugins.registries[kind]
        out: dict[str, Any] = {}
        if section_name == "families":
            out.update(train=list(section.train), held_out=list(section.held_out), level=section.level)
            chosen = list(section.train) + list(section.held_out)
            for field in ("train", "held_out"):
                for index, name in enumerate(getattr(section, field)):
                    if name not in registry:
                        problems.append((f"families.{field}[{index}]", _unknown(registry, name)))
            for name in section.train:
                if name in registry and registry.get(name).held_out:
                    problems.append(("families.train", f"{name!r} is a held-out family: it may be evaluated, never "
                                                       "trained on; move it to families.held_out"))
            overlap = set(section.train) & set(section.held_out)
            if overlap:
                problems.append(("families", f"{', '.join(sorted(overlap))} both trained on and held out"))
        else:
            if section.use not in registry:
                problems.append((f"{section_name}.use", _unknown(registry, section.use)))
            out["use"] = section.use
            chosen = [section.use]
        for name, options in section.options().items():
            if name not in registry:
                problems.append((f"{section_name}.{name}", _unknown(registry, name)))
                continue
            try:
                out[name] = registry.get(name).Config.model_validate(options).model_dump(mode="json")
            except ValidationError as exc:
                problems.extend(describe(exc, f"{section_name}.{name}"))
        for name in chosen:
            if name in registry and name not in out:
                out[name] = registry.get(name).Config().model_dump(mode="json")
        resolved[section_name] = out
    if problems:
        raise ConfigError(problems, source)
    return resolved


def _unknown(registry: Any, name: str) -> str:
    return f"no {registry.kind} named {name!r} (available: {', '.join(registry.names()) or 'none installed'})"
