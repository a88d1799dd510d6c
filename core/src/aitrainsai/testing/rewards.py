"""Conformance checks for reward components."""

from __future__ import annotations

import math
from typing import ClassVar

from aitrainsai.rewards import EpisodeOutcome, ProbeAttempt, RewardComponent
from aitrainsai.testing.plugins import PluginConformance


def sample_episodes() -> list[EpisodeOutcome]:
    """Episodes covering the outcomes a reward component must handle."""
    ok = ProbeAttempt(attempt=1, ok=True)
    bad = ProbeAttempt(attempt=1, ok=False, problems=["x"])
    return [
        EpisodeOutcome(family="f", level=1, parsed_submission=False),
        EpisodeOutcome(family="f", level=1, parsed_submission=True,
                       attempts=[bad, bad.model_copy(update={"attempt": 2}), bad.model_copy(update={"attempt": 3})]),
        EpisodeOutcome(family="f", level=1, parsed_submission=True, attempts=[ok], job_status="dead",
                       baseline_scores={"b": 0.3}),
        EpisodeOutcome(family="f", level=1, parsed_submission=True, attempts=[ok], job_status="done", base_model="b",
                       baseline_scores={"b": 0.3}, pre=0.3, post=0.6, train_seconds=100),
        EpisodeOutcome(family="f", level=1, parsed_submission=True,
                       attempts=[bad, ok.model_copy(update={"attempt": 2})], job_status="done", base_model="b",
                       baseline_scores={"b": 0.5, "c": 0.7}, pre=0.5, post=0.4, train_seconds=2_000),
    ]


class RewardComponentConformance(PluginConformance):
    """Set ``component`` to the component class."""

    component: ClassVar[type[RewardComponent]]
    kind = "reward_components"

    def component_names(self) -> list[str]:
        return [self.component.name]

    def test_scores_are_finite_and_pure(self):
        component = self.component()
        for episode in sample_episodes():
            first = component.score(episode)
            assert isinstance(first, float) and math.isfinite(first)
            assert component.score(episode.model_copy(deep=True)) == first

    def test_explains_itself(self):
        text = self.component().explain()
        assert self.component.name in text and len(text) > 20
