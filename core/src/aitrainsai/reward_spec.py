"""Reward specs: which reward components, with which weights and options, make an episode's reward.

A spec is a TOML file (``reward_specs/default.toml``). The text that tells the agent how it is rewarded is generated
from the same spec, so the agent's view cannot drift from the reward actually computed.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aitrainsai.rewards import EpisodeOutcome, RewardComponent
from aitrainsai.errors import AitrainsaiError

SPECS_VARIABLE = "AITRAINSAI_REWARD_SPECS"


class RewardSpecError(ValueError, AitrainsaiError):
    """A spec that cannot be used; the message says which file, which key and why."""


class Term(BaseModel):
    model_config = ConfigDict(extra="forbid")

    component: str
    weight: float = Field(allow_inf_nan=False)
    options: dict[str, Any] = Field(default_factory=dict)


class RewardSpecFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    no_submission: float = Field(-0.1, allow_inf_nan=False, description="reward with no parseable submission")
    max_attempts: int = Field(3, ge=1, le=20, description="submit_job attempts before the episode ends")
    terms: list[Term] = Field(min_length=1)


class RewardSpec:
    """A loaded spec with its components built: call :meth:`reward` on a finished episode."""

    def __init__(self, name: str, source: str, data: RewardSpecFile, components: list[tuple[Term, RewardComponent]]):
        self.name = name
        self.source = source
        self.data = data
        self.components = components

    @property
    def max_attempts(self) -> int:
        return self.data.max_attempts

    def reward(self, episode: EpisodeOutcome) -> tuple[float, dict[str, float]]:
        """The total and each component's value. No parseable submission scores ``no_submission`` alone."""
        if not episode.parsed_submission:
            return self.data.no_submission, {}
        values = {term.component: float(component.score(episode)) for term, component in self.components}
        for name, value in values.items():
            if not math.isfinite(value):
                raise ValueError(f"reward component {name} returned {value}")
        total = sum(term.weight * values[term.component] for term, _ in self.components)
        return total, values

    def formula(self) -> str:
        terms = " + ".join(f"{term.weight:g}·{term.component}" for term, _ in self.components)
        return f"reward = {terms}"

    def agent_text(self) -> str:
        """Exactly what the agent is told about its reward."""
        lines = [
            "How you are rewarded:",
            f"  {self.formula()}",
            *[f"  - {component.explain()}" for _, component in self.components],
            f"  - If you never make a submit_job call that parses, the reward is {self.data.no_submission:g}.",
            f"  - You have at most {self.data.max_attempts} submit_job attempts; the episode ends at the first "
            "accepted one.",
        ]
        return "\n".join(lines)


def spec_search_path() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(SPECS_VARIABLE, "").split(os.pathsep) if p]
    here = Path(__file__).resolve()
    return [*extra, Path.cwd() / "reward_specs", here.parent / "reward_specs", here.parents[3] / "reward_specs"]


def find_spec(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return path
    for directory in spec_search_path():
        candidate = directory / f"{name_or_path}.toml"
        if candidate.exists():
            return candidate
    searched = ", ".join(str(d) for d in spec_search_path())
    raise RewardSpecError(f"no reward spec {name_or_path!r} (looked for a .toml path, then in {searched})")


def available_specs() -> list[str]:
    return sorted({p.stem for d in spec_search_path() if d.is_dir() for p in d.glob("*.toml")})


def load_reward_spec(name_or_path: str, plugins: Any) -> RewardSpec:
    """Load and check a spec: unknown components, bad weights and bad options are refused, naming the key."""
    path = find_spec(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RewardSpecError(f"{path}: not valid TOML: {exc}") from None
    try:
        data = RewardSpecFile.model_validate(raw)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise RewardSpecError(f"{path}: {details}") from None
    registry = plugins.reward_components
    components = []
    for index, term in enumerate(data.terms):
        if term.component not in registry:
            raise RewardSpecError(f"{path}: terms[{index}].component: no reward component named {term.component!r} "
                                  f"(available: {', '.join(registry.names())})")
        cls = registry.get(term.component)
        try:
            options = cls.Config.model_validate(term.options)
        except ValidationError as exc:
            details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise RewardSpecError(f"{path}: terms[{index}].options: {details}") from None
        components.append((term, cls(options)))
    names = [term.component for term in data.terms]
    if len(set(names)) != len(names):
        raise RewardSpecError(f"{path}: a component appears twice in terms")
    return RewardSpec(path.stem, str(path), data, components)
