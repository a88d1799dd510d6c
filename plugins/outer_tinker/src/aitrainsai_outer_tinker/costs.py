"""Token counts and dollars of the outer side, per outer step and for the run.

Tinker bills per token, separately for prefill (prompt tokens a sampler reads), sampling (tokens it writes) and
training (tokens a forward-backward pass runs over), at per-model prices. The service has no per-run cost API, so the
trainer counts the tokens it sends and receives and prices them with the configured rates: an estimate, exact only
as far as the configured prices are. Prefix-cache hits are counted as full prefill (an upper bound).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MILLION = 1_000_000


class Prices(BaseModel):
    """USD per million tokens. The defaults are placeholders (what Tinker listed for Qwen3-30B-A3B, unverified): check
    the console's pricing page for your base model and set them."""

    model_config = ConfigDict(extra="forbid")

    prefill: float = Field(0.12, ge=0, description="USD per million prompt tokens read by the sampler")
    sampled: float = Field(0.30, ge=0, description="USD per million tokens sampled")
    trained: float = Field(0.36, ge=0, description="USD per million tokens through forward-backward")


class Tokens(BaseModel):
    """Token counts; :meth:`usd` prices them."""

    model_config = ConfigDict(extra="forbid")

    prefill: int = 0
    sampled: int = 0
    trained: int = 0

    def usd(self, prices: Prices) -> float:
        return (self.prefill * prices.prefill + self.sampled * prices.sampled
                + self.trained * prices.trained) / MILLION

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(prefill=self.prefill + other.prefill, sampled=self.sampled + other.sampled,
                      trained=self.trained + other.trained)


class CostMeter(BaseModel):
    """What the run has spent (``total``, ``usd_total``) and what the current outer step has used so far (``step``:
    the samples since the last update, then that update's training)."""

    model_config = ConfigDict(extra="forbid")

    total: Tokens = Field(default_factory=Tokens)
    usd_total: float = 0.0
    step: Tokens = Field(default_factory=Tokens)
    usd_step: float = 0.0

    def add(self, tokens: Tokens, prices: Prices) -> None:
        usd = tokens.usd(prices)
        self.total, self.step = self.total + tokens, self.step + tokens
        self.usd_total += usd
        self.usd_step += usd

    def close_step(self) -> dict[str, float]:
        """The metrics of the step that ends now (update's exact keys), and a fresh step."""
        metrics = {"cost_usd": self.usd_step, "cost_usd_total": self.usd_total,
                   "tokens_prefill": float(self.step.prefill), "tokens_sampled": float(self.step.sampled),
                   "tokens_trained": float(self.step.trained)}
        self.step, self.usd_step = Tokens(), 0.0
        return metrics
