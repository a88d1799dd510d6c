"""The reward components of the reference design: validation, job quality and train speed."""

from __future__ import annotations

from pydantic import Field

from aitrainsai import hookimpl
from aitrainsai.components import ComponentConfig
from aitrainsai.rewards import EpisodeOutcome, RewardComponent


class ValidationConfig(ComponentConfig):
    decay: float = Field(0.5, ge=0, le=1, description="factor applied per retry before the first valid submission")


class Validation(RewardComponent):
    """1.0 for a first-try valid submission, times ``decay`` per retry; 0 if no submission was ever valid."""

    name = "validation"
    Config = ValidationConfig
    config: ValidationConfig

    def score(self, episode: EpisodeOutcome) -> float:
        first = episode.first_valid_attempt
        return 0.0 if first is None else self.config.decay ** (first - 1)

    def explain(self) -> str:
        return (f"validation: 1.0 if your first submit_job is accepted, multiplied by {self.config.decay:g} for each "
                "rejected attempt before it; 0 if no attempt is accepted.")


class JobQualityConfig(ComponentConfig):
    post_weight: float = Field(0.25, ge=0, le=1)
    uplift_weight: float = Field(0.75, ge=0, le=1)
    uplift_scale: float = Field(0.25, gt=0, le=1, description="uplift that maps to 1.0 (and its negative to 0.0)")


class JobQuality(RewardComponent):
    """``post_weight * post + uplift_weight * uplift_term`` for a job that trained; 0 for one that died or never ran.

    ``uplift = post - best_pre`` (best untrained baseline over the allowed bases), mapped into [0, 1] by
    ``uplift_term = clip(0.5 + 0.5 * uplift / uplift_scale, 0, 1)``: no change is 0.5, ``+uplift_scale`` or more is 1.
    """

    name = "job_quality"
    Config = JobQualityConfig
    config: JobQualityConfig

    def uplift_term(self, uplift: float) -> float:
        return min(1.0, max(0.0, 0.5 + 0.5 * uplift / self.config.uplift_scale))

    def score(self, episode: EpisodeOutcome) -> float:
        if episode.job_status != "done" or episode.post is None:
            return 0.0
        best_pre = episode.best_pre if episode.best_pre is not None else 0.0
        c = self.config
        return c.post_weight * episode.post + c.uplift_weight * self.uplift_term(episode.post - best_pre)

    def explain(self) -> str:
        c = self.config
        return (f"job_quality: {c.post_weight:g} * post + {c.uplift_weight:g} * uplift_term, where post is the trained "
                "model's hidden-eval score, uplift = post - best untrained baseline among the allowed base models, and "
                f"uplift_term = clip(0.5 + 0.5 * uplift / {c.uplift_scale:g}, 0, 1). A job that dies in training or "
                "never runs scores 0.")


class TrainSpeed(RewardComponent):
    """For a job that trained, ``1 - work / work budget`` where the trainer counts its work (tokens sampled, against
    the task's ``max_train_tokens``), else ``1 - train_seconds / wall budget``; clipped to [0, 1]; 0 otherwise. A
    tie-breaker. Work is what the job asked for, the same for the same job on a fast or a loaded machine, so load
    cannot reorder a group by this term; seconds (a trainer that does not count its work) can."""

    name = "train_speed"

    def score(self, episode: EpisodeOutcome) -> float:
        if episode.job_status != "done":
            return 0.0
        if episode.train_work is not None and episode.train_work_budget:
            return min(1.0, max(0.0, 1.0 - episode.train_work / episode.train_work_budget))
        if episode.train_seconds is None:
            return 0.0
        return min(1.0, max(0.0, 1.0 - episode.train_seconds / episode.train_budget_seconds))

    def explain(self) -> str:
        return ("train_speed: for a job that trained, 1 - tokens it sampled in training / the task's budget of "
                "sampled tokens (where the trainer has one; else 1 - training seconds / the wall-time budget), clipped "
                "to [0, 1]; 0 otherwise.")


@hookimpl
def register_reward_components(register):
    register(Validation)
    register(JobQuality)
    register(TrainSpeed)
