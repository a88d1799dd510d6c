"""What the Tinker policy leaves on disk: its saved state (``tinker.json``, which the trainer writes and a run's
``init_state`` points at) and a warm start's record (``sft.json``), with the line a run's report gives it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai_outer_tinker.agent_check import AgentCheck, table
from aitrainsai_outer_tinker.costs import CostMeter, Tokens

STATE_FILE = "tinker.json"
PROGRESS_FILE = "sft.json"


class SavedState(BaseModel):
    """What ``save_state`` writes: a pointer to the service's checkpoint (weights and Adam state), no secret."""

    model_config = ConfigDict(extra="forbid")

    tinker_path: str
    policy_version: int
    base_model: str
    costs: CostMeter
    sessions: list[str] = Field(default_factory=list, description="the service sessions of the run so far")
    started_at: float | None = Field(None, description="when the run's first session started (Unix seconds)")
    server_dir: str | None = Field(None, description="the local server's state dir that holds the checkpoint "
                                                     "(None: the hosted service)")


class SftSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(3, ge=1, le=1000)
    learning_rate: float = Field(1e-4, gt=0, le=1)
    batch_size: int = Field(8, ge=1, le=4096, description="datums (an episode's turns, one sequence) per optimizer "
                                                          "step")
    held_out: float = Field(0.2, ge=0, lt=1, description="the share of episodes kept out of training")
    min_reward: float | None = Field(None, description="only episodes at or above this reward")
    include_dead: bool = Field(False, description="also episodes whose accepted job died in training")
    seed: int = 0


class EpochRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: int
    steps: int
    train_loss: float = Field(description="nats per reply token, averaged over the epoch's batches as trained")
    held_out_loss: float | None = Field(None, description="nats per reply token after the epoch; None: no split")
    train_tokens: int
    seconds: float
    tinker_path: str
    optimizer_steps: int | None = Field(None, description="the service's count of Adam steps after the epoch "
                                                          "(optim_step's step:max; None where it gives none)")


class EpochPartial(BaseModel):
    """The first ``steps`` steps of epoch ``epoch``, saved mid-way: a resume trains its remaining batches."""

    model_config = ConfigDict(extra="forbid")

    epoch: int
    steps: int = 0
    nll: float = 0.0  # summed over the reply tokens trained so far
    tokens: int = 0
    seconds: float = 0.0


class SftProgress(BaseModel):
    """``sft.json``: what the warm start is (a resume must ask for the same) and what it has done."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str]
    base_model: str
    chat_format: str
    settings: SftSettings
    train: list[str]
    held_out: list[str]
    before_held_out_loss: float | None = None
    epochs: list[EpochRecord] = Field(default_factory=list)
    partial: EpochPartial | None = Field(None, description="the epoch in progress at the last save")
    state: SavedState | None = Field(None, description="the policy state (weights, Adam) at the last save: what a "
                                                       "resume loads")
    tokens: Tokens = Field(default_factory=Tokens)
    usd: float = 0.0
    checks: list[AgentCheck] = Field(default_factory=list, description="cold and warm on fresh draws (--check)")

    def same_start(self, other: SftProgress) -> bool:
        """The same data, model and settings (the number of epochs may grow: a finished warm start trains on)."""
        keys = ("sources", "base_model", "chat_format", "train", "held_out")
        return (all(getattr(self, k) == getattr(other, k) for k in keys)
                and self.settings.model_copy(update={"epochs": 0}) == other.settings.model_copy(update={"epochs": 0}))


def warm_start_summary(where: Path) -> str:
    """One line on the warm start in ``where`` (for the run's report): its data, epochs and held-out losses."""
    try:
        progress = SftProgress.model_validate_json((Path(where) / PROGRESS_FILE).read_bytes()[:10_000_000])
    except (OSError, ValueError):
        return f"from {where} (no sft.json: a saved policy state)"
    losses = [progress.before_held_out_loss] + [e.held_out_loss for e in progress.epochs]
    shown = " -> ".join("-" if x is None else f"{x:.3f}" for x in losses)
    line = (f"from {where}: {len(progress.train)} datums of {', '.join(progress.sources)}, {len(progress.epochs)} "
            f"epochs at lr {progress.settings.learning_rate:g}; held-out loss {shown} nats per reply token")
    if not progress.checks:
        return line
    return (f"{line}\n\nBefore and after the warm start, on fresh draws (the agent side alone, no job trained; "
            f"temperature {progress.checks[0].temperature:g}):\n\n{table(progress.checks)}")
