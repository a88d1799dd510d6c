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

import copy

import tomllib
from pathlib import Path
from typing import Any, Literal
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, model_validator

from aitrainsai.components import ComponentConfig
from aitrainsai.jobs.format import JobFormat
from aitrainsai.errors import AitrainsaiError

class ConfigError(AitrainsaiError):
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
    max_steps_off_policy: int = Field(2, ge=0, description="oldest policy lag still trained on (0: on-policy, a "
                                                            "step's groups start only after the previous update)")
    eval_every: int = Field(0, ge=0, description="outer steps between evaluations with no update (0: only at the end)")
    final_eval: bool = Field(True, description="evaluate the held-out and training families when the run ends")
    eval_episodes: int = Field(1, ge=1, description="episodes per family in an evaluation")
    eval_initial: bool = Field(False, description="evaluate the untrained policy too (step 0): the report compares "
                                                  "it with the final one, episode by episode on the same eval seeds")
    eval_families: Literal["all", "held_out"] = Field("all", description="the families an evaluation plays")
    max_agent_turns: int = Field(16, ge=1, description="agent turns per episode")
    task_view: Literal["full", "compact"] = Field(
        "full", description="the task view the agent opens with: full (the whole spec, template and schema) or compact "
                            "(a few hundred tokens, for a small agent; read_file gives the files)")
    train_jobs: bool = Field(
        True, description="train and score each accepted job; false: a validation-only run (a cheap demonstration "
                          "set: the episode ends at the accepted job, status validated, its reward the validation "
                          "part)")
    share_identical_jobs: bool = Field(
        True, description="train an accepted job once when another job of this run has the same files, trainer "
                          "settings, base model and seed: its episode takes that job's outcome, recorded as shared; "
                          "only where the inner trainer declares its training deterministic on the backend (the "
                          "local trainer on CPU with fixed threads; never on a GPU); false: every job trains")
    share_identical_probes: bool = Field(
        True, description="probe a job once two probes of it (the same files, spec, family, trainer settings) accepted "
                          "it and froze the same job, byte for byte: later identical submissions take that verdict "
                          "and frozen job, recorded as shared; false: every submission is probed")
    max_group_factor: int = Field(3, ge=1, description="stop after steps x groups_per_step x this many groups")
    seed: int = 0


class ComponentSection(BaseModel):
    """``use`` names the component; other keys are component names holding that component's options."""

    model_config = ConfigDict(extra="allow")

    use: str | None = Field(None, description="the component (default: the only one installed, else the preset's)")

    def options(self) -> dict[str, dict[str, Any]]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _options_are_tables(self) -> ComponentSection:
        for key, value in self.options().items():
            if not isinstance(value, dict):
                raise ValueError(f"{key!r} must be a table of options for the component named {key!r}")
        return self


class GpuBackendSection(ComponentSection):
    use: str | None = None


class InnerTrainerSection(ComponentSection):
    use: str | None = None


class OuterTrainerSection(ComponentSection):
    use: str | None = None


class FamiliesSection(BaseModel):
    """Which families train the agent and which are held out; sub-tables hold per-family options."""

    model_config = ConfigDict(extra="allow")

    train: list[str] | None = Field(None, description="default: every installed family that is not held out")
    held_out: list[str] | None = Field(None, description="default: every installed held-out family")
    level: int | None = Field(None, description="difficulty level for every family (default: each family's)")
    job_format: JobFormat = Field("verifiers", description=(
        "the job format the agent writes: verifiers (classic, environment.py) or verifiers-v1 (taskset.py)"))
    job_formats: dict[str, JobFormat] = Field(default_factory=dict,
                                              description="per family, where its format is not job_format")

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
    trackers: list[str] = Field(default_factory=list, description="experiment trackers fed as the run goes, by name")
    tracker: dict[str, dict[str, Any]] = Field(default_factory=dict, description="a tracker's options, by its name")


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


DEFAULT_PRESET = "default"


def load_config(path: Path | None = None, overrides: Iterable[str] = (), preset: str | None = None, *,
                presets: Mapping[str, Path] | None = None) -> RunConfig:
    """The run config: the ``default`` preset (when an installed distribution ships one), then ``preset`` over it,
    then a TOML file, then ``KEY.PATH=VALUE`` overrides; the core sections validated. ``presets`` maps preset names
    to the files the installed distributions ship (:attr:`aitrainsai.plugins.Plugins.presets`)."""
    presets = dict(presets or {})
    data: dict[str, Any] = {}
    source = str(path) if path else "config"
    if preset is not None and preset not in presets:
        raise ConfigError([("", f"no preset {preset!r} (presets: {', '.join(sorted(presets)) or 'none installed'})")],
                          "--preset")
    for name in dict.fromkeys([DEFAULT_PRESET, preset]):
        if name is not None and name in presets:
            try:
                _merge(data, tomllib.loads(Path(presets[name]).read_text()))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError([("", f"preset {name!r} ({presets[name]}) cannot be read: {exc}")], "--preset") \
                    from None
    data.pop("about", None)  # a preset's own description
    if path is not None:
        try:
            _merge(data, tomllib.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError([("", f"no such file: {path}")], source) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([("", f"not valid TOML: {exc}")], source) from None
    for override in overrides:
        keys, value = parse_override(override)
        problem = _put(data, keys, value)
        if problem:
            raise ConfigError([(".".join(keys), problem)], "--set")
        source = f"{source} (with --set)" if "--set" not in source else source
    return validate(RunConfig, data, source)


def _put(data: dict[str, Any], keys: list[str], value: Any) -> str | None:
    """``data`` with ``value`` at the key path ``keys`` (tables made on the way); what stops it, if anything."""
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            return f"{key!r} is a value, not a table"
        node = child
    node[keys[-1]] = value
    return None


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


class ChosenComponent(BaseModel):
    """A section's component and its validated options; ``others`` holds options given for components not used."""

    model_config = ConfigDict(extra="forbid")

    use: str
    config: SerializeAsAny[ComponentConfig]
    others: dict[str, SerializeAsAny[ComponentConfig]] = Field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        return {"use": self.use, self.use: self.config.model_dump(mode="json"),
                **{name: options.model_dump(mode="json") for name, options in self.others.items()}}


class ChosenFamilies(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: list[str]
    held_out: list[str]
    level: int | None = None
    job_format: JobFormat = "verifiers"
    job_formats: dict[str, JobFormat] = Field(default_factory=dict)
    options: dict[str, SerializeAsAny[ComponentConfig]] = Field(default_factory=dict)

    def format_of(self, family: str) -> JobFormat:
        """The job format the agent writes for ``family``."""
        return self.job_formats.get(family, self.job_format)

    def snapshot(self) -> dict[str, Any]:
        formats = {"job_format": self.job_format, "job_formats": dict(self.job_formats)} if (
            self.job_format != "verifiers" or self.job_formats) else {}  # a classic run records what it always did
        return {"train": list(self.train), "held_out": list(self.held_out), "level": self.level, **formats,
                **{name: options.model_dump(mode="json") for name, options in self.options.items()}}


class ResolvedConfig(BaseModel):
    """A run config checked against the loaded plugins: every choice made, every option validated by its
    component's ``Config``. ``outer_trainer`` is None where nothing trains an agent (``aitrainsai job run``).
    :meth:`snapshot` is what the ledger stores; resolving the snapshot again gives the same config."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    reward_spec: str
    loop: LoopConfig
    families: ChosenFamilies
    gpu_backend: ChosenComponent
    inner_trainer: ChosenComponent
    outer_trainer: ChosenComponent | None = None
    trackers: dict[str, SerializeAsAny[ComponentConfig]] = Field(default_factory=dict,
                                                                 description="the chosen trackers and their options")

    def snapshot(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "reward_spec": self.reward_spec,
                                "loop": self.loop.model_dump(mode="json"), "families": self.families.snapshot(),
                                "gpu_backend": self.gpu_backend.snapshot(),
                                "inner_trainer": self.inner_trainer.snapshot()}
        if self.outer_trainer is not None:
            data["outer_trainer"] = self.outer_trainer.snapshot()
        if self.trackers:  # a run with none records what it always did
            data["trackers"] = list(self.trackers)
            data["tracker"] = {name: options.model_dump(mode="json") for name, options in self.trackers.items()}
        return data


def resolve(config: RunConfig, plugins: Any, source: str = "config", *, outer: bool = True) -> ResolvedConfig:
    """Check component choices and options against the loaded plugins and make every choice.

    A section without ``use`` takes the only installed component of its kind, else it is an error that lists them;
    families default to every installed family, split by ``held_out``. ``outer=False`` leaves the outer trainer out
    (nothing is checked there). Every problem is reported at once, with its key path."""
    problems: list[tuple[str, str]] = []
    chosen: dict[str, ChosenComponent | None] = {}
    sections = ["gpu_backend", "inner_trainer"] + (["outer_trainer"] if outer else [])
    for section_name in sections:
        section = getattr(config, section_name)
        registry = plugins.registries[SECTION_KINDS[section_name]]
        use = section.use
        if use is None:
            if len(registry) == 1:
                use = registry.names()[0]
            else:
                problems.append((f"{section_name}.use", (
                    f"choose a {registry.kind}: {', '.join(registry.names())}" if len(registry)
                    else f"no {registry.kind} is installed")))
        elif use not in registry:
            problems.append((f"{section_name}.use", _unknown(registry, use, plugins)))
            use = None
        options = _options(registry, section.options(), section_name, problems, plugins)
        if use is not None and use not in options:
            options[use] = registry.get(use).Config()
        chosen[section_name] = None if use is None else ChosenComponent(
            use=use, config=options.pop(use), others=options)
    families = _families(config.families, plugins, problems)
    trackers = _trackers(config, plugins, problems)
    if problems:
        raise ConfigError(problems, source)
    return ResolvedConfig(name=config.name, reward_spec=config.reward_spec, loop=config.loop, families=families,
                          trackers=trackers, **chosen)


def resolve_snapshot(snapshot: dict[str, Any], plugins: Any,
                     source: str = "the run's recorded config") -> ResolvedConfig:
    """A config the ledger stored (:meth:`ResolvedConfig.snapshot`), resolved again against the loaded plugins."""
    config = validate(RunConfig, snapshot, source)
    return resolve(config, plugins, source, outer="outer_trainer" in snapshot)


ON_RESUME = "on_resume"
"""A component option whose ``Field(json_schema_extra={"on_resume": True})`` may change with ``--resume``: a budget
or a deadline, which a user raises to continue a run that stopped on it. Nothing else in a recorded run changes."""


def resume_overrides(record: dict[str, Any], overrides: Iterable[str], plugins: Any) -> dict[str, Any]:
    """``record`` (a run's recorded config) with ``overrides`` applied, each one an option of a chosen component
    marked adjustable on resume (:data:`ON_RESUME`), or the trackers (``trackers``, ``tracker.NAME.*``: they watch a
    run, never change it); anything else is refused, naming what may change."""
    record = copy.deepcopy(record)
    problems: list[tuple[str, str]] = []
    for text in overrides:
        path, value = parse_override(text)
        key = ".".join(path)
        if path[0] in ("trackers", "tracker"):  # what watches a run never changes it
            problem = _put(record, path, value)
            if problem:
                problems.append((key, problem))
            continue
        section = record.get(path[0]) if len(path) == 3 and path[0] in SECTION_KINDS else None
        allowed: list[str] = []
        if isinstance(section, dict) and section.get("use") == path[1]:
            fields = getattr(plugins, SECTION_KINDS[path[0]]).get(path[1]).Config.model_fields
            allowed = [f"{path[0]}.{path[1]}.{name}" for name, info in fields.items()
                       if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(ON_RESUME)]
        if key not in allowed:
            problems.append((key, "cannot change when a run resumes (it continues with its recorded config); "
                                  + (f"what may: {', '.join(allowed)}" if allowed
                                     else "no option of this component may")))
            continue
        assert isinstance(section, dict)  # only an option of a chosen component is allowed
        section.setdefault(path[1], {})[path[2]] = value
    if problems:
        raise ConfigError(problems, "--set")
    return record


def _options(registry: Any, given: dict[str, dict[str, Any]], section: str, problems: list[tuple[str, str]],
             plugins: Any) -> dict[str, ComponentConfig]:
    options: dict[str, ComponentConfig] = {}
    for name, values in given.items():
        if name not in registry:
            problems.append((f"{section}.{name}", _unknown(registry, name, plugins)))
            continue
        try:
            options[name] = registry.get(name).Config.model_validate(values)
        except ValidationError as exc:
            problems.extend(describe(exc, f"{section}.{name}"))
    return options


def _families(section: FamiliesSection, plugins: Any, problems: list[tuple[str, str]]) -> ChosenFamilies:
    registry = plugins.task_families
    installed = {name: registry.get(name) for name in registry.names()}
    train = section.train if section.train is not None else [n for n, f in installed.items() if not f.held_out]
    held_out = section.held_out if section.held_out is not None else [n for n, f in installed.items() if f.held_out]
    for field, names in (("train", train), ("held_out", held_out)):
        for index, name in enumerate(names):
            if name not in registry:
                problems.append((f"families.{field}[{index}]", _unknown(registry, name, plugins)))
    for name in train:
        if name in installed and installed[name].held_out:
            problems.append(("families.train", f"{name!r} is a held-out family: it may be evaluated, never "
                                               "trained on; move it to families.held_out"))
    overlap = set(train) & set(held_out)
    if overlap:
        problems.append(("families", f"{', '.join(sorted(overlap))} both trained on and held out"))
    for name in section.job_formats:
        if name not in (*train, *held_out):
            problems.append((f"families.job_formats.{name}", f"{name!r} is not a family this run trains or holds out"))
    options = _options(registry, section.options(), "families", problems, plugins)
    return ChosenFamilies(train=list(train), held_out=list(held_out), level=section.level, options=options,
                          job_format=section.job_format, job_formats=dict(section.job_formats))


def _trackers(config: RunConfig, plugins: Any, problems: list[tuple[str, str]]) -> dict[str, ComponentConfig]:
    """The chosen trackers with their options (``[tracker.NAME]``; options of a tracker not chosen are errors)."""
    registry = plugins.trackers
    chosen: dict[str, ComponentConfig] = {}
    for index, name in enumerate(config.trackers):
        if name in chosen:
            problems.append((f"trackers[{index}]", f"{name!r} is listed twice"))
        elif name not in registry:
            problems.append((f"trackers[{index}]", _unknown(registry, name, plugins)))
        else:
            chosen[name] = registry.get(name).Config()
    for name in config.tracker:
        if name not in chosen:
            problems.append((f"tracker.{name}", f"options for a tracker this run does not use (trackers = "
                                                f"{list(config.trackers)!r})"))
    given = {name: values for name, values in config.tracker.items() if name in chosen}
    return chosen | _options(registry, given, "tracker", problems, plugins)


def _unknown(registry: Any, name: str, plugins: Any = None) -> str:
    explain = getattr(plugins, "explain_missing", None)
    if explain is not None:
        hint = explain(registry, name)
        if hint:
            return hint
    return f"no {registry.kind} named {name!r} (available: {', '.join(registry.names()) or 'none installed'})"
