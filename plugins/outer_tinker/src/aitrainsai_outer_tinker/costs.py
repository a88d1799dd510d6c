"""Token counts and dollars of the outer side, per outer step, per episode and for the run; the shipped per-model
rate table; and the reconciliation of the trainer's estimate with what the service bills.

Tinker bills per token, separately for prefill (prompt tokens a sampler reads; prefix-cache hits at a discounted
"cached prefill" rate), sampling (tokens it writes) and training (tokens a forward-backward pass runs over), at
per-model rates. The trainer counts the tokens it sends and receives, takes the cache hits the service reports
(``SampleResponse.prompt_cache_hit_tokens``) and prices them from :data:`RATE_CARD` (or the configured override):
an estimate, exact as far as the rates are. Where the key may read billing, :func:`check_billing` asks the service
(``AdminClient.get_billing_usage``) what it billed the run's sessions and :func:`reconcile` sets that beside the
estimate (:class:`BillingCheck`); the service's usage lags real time by up to a few hours.

``Tokens.prefill`` counts every prompt token a sampler read, cache hits included; ``Tokens.prefill_cached`` is the
part of it billed at the cached rate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MILLION = 1_000_000
KINDS = ("prefill", "prefill_cached", "sampled", "trained")
MAX_EPISODES = 4096  # per-episode accounts kept (the oldest are dropped first)
METADATA_RUN_KEY = "aitrainsai_run_id"  # the session user_metadata key that names the run
LOCAL_MODEL = "SmolLM2-135M-Instruct"  # the local server's model: it bills nothing
HOUR = dt.timedelta(hours=1)
MAX_WINDOW = dt.timedelta(days=14)  # the longest window one get_billing_usage call may ask for


class Prices(BaseModel):
    """USD per million tokens of each kind. ``prefill_cached`` None: cache hits are priced as full prefill (an upper
    bound). The defaults are what Tinker listed for Qwen3-30B-A3B on 2026-01-05 (a model retired on 2026-06-12),
    kept so that a partial override stays valid; :func:`prices_for` prices a base model from :data:`RATE_CARD`."""

    model_config = ConfigDict(extra="forbid")

    prefill: float = Field(0.12, ge=0, description="USD per million prompt tokens read by the sampler (no cache hit)")
    prefill_cached: float | None = Field(None, ge=0, description=(
        "USD per million prompt tokens served from the prefix cache; None: the prefill rate"))
    sampled: float = Field(0.30, ge=0, description="USD per million tokens sampled")
    trained: float = Field(0.36, ge=0, description="USD per million tokens through forward-backward")

    @property
    def cached(self) -> float:
        return self.prefill if self.prefill_cached is None else self.prefill_cached


class Tokens(BaseModel):
    """Token counts; :meth:`usd` prices them. ``prefill`` is every prompt token read, ``prefill_cached`` the part of
    it the service served from its prefix cache."""

    model_config = ConfigDict(extra="forbid")

    prefill: int = 0
    prefill_cached: int = 0
    sampled: int = 0
    trained: int = 0

    @classmethod
    def sampling(cls, prompt: int, sampled: int, *, cache_hits: int = 0, num_samples: int = 1) -> Tokens:
        """One sample request as the service bills it: a prompt of ``prompt`` tokens of which ``cache_hits``
        (``SampleResponse.prompt_cache_hit_tokens``) were prefix-cache hits, ``sampled`` tokens written over all
        samples. With ``num_samples > 1`` the prompt is read once per sample and the repeats are cache hits."""
        hits = max(0, min(cache_hits, prompt))
        return cls(prefill=prompt * num_samples, prefill_cached=hits + prompt * (num_samples - 1), sampled=sampled)

    def usd(self, prices: Prices) -> float:
        uncached = self.prefill - self.prefill_cached
        return (uncached * prices.prefill + self.prefill_cached * prices.cached + self.sampled * prices.sampled
                + self.trained * prices.trained) / MILLION

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(prefill=self.prefill + other.prefill, prefill_cached=self.prefill_cached + other.prefill_cached,
                      sampled=self.sampled + other.sampled, trained=self.trained + other.trained)


class EpisodeCost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: Tokens = Field(default_factory=Tokens)
    usd: float = 0.0


class CostMeter(BaseModel):
    """What the run has spent (``total``, ``usd_total``), what the current outer step has used so far (``step``:
    the samples since the last update, then that update's training), and what each episode has used (``episodes``,
    the last :data:`MAX_EPISODES`; :meth:`episode`, :meth:`pop_episode`)."""

    model_config = ConfigDict(extra="forbid")

    total: Tokens = Field(default_factory=Tokens)
    usd_total: float = 0.0
    step: Tokens = Field(default_factory=Tokens)
    usd_step: float = 0.0
    episodes: dict[str, EpisodeCost] = Field(default_factory=dict)

    def add(self, tokens: Tokens, prices: Prices, *, episode: str | None = None) -> float:
        """Count ``tokens`` at ``prices`` (for ``episode`` too, when given); returns their USD."""
        usd = tokens.usd(prices)
        self.total, self.step = self.total + tokens, self.step + tokens
        self.usd_total += usd
        self.usd_step += usd
        if episode is not None:
            self.charge(episode, tokens, prices)
        return usd

    def charge(self, episode: str, tokens: Tokens, prices: Prices) -> None:
        """Put ``tokens`` on ``episode``'s account only (tokens :meth:`add` counted before the episode was known)."""
        account = self.episodes.pop(episode, None) or EpisodeCost()
        self.episodes[episode] = EpisodeCost(tokens=account.tokens + tokens, usd=account.usd + tokens.usd(prices))
        while len(self.episodes) > MAX_EPISODES:
            del self.episodes[next(iter(self.episodes))]

    def episode(self, episode: str) -> EpisodeCost:
        """The tokens and USD counted for ``episode`` so far (zero when none were)."""
        return self.episodes.get(episode) or EpisodeCost()

    def pop_episode(self, episode: str) -> EpisodeCost:
        """:meth:`episode`, and forget it."""
        return self.episodes.pop(episode, None) or EpisodeCost()

    def close_step(self) -> dict[str, float]:
        """The metrics of the step that ends now (update's exact keys), and a fresh step."""
        metrics = {"cost_usd": self.usd_step, "cost_usd_total": self.usd_total,
                   "tokens_prefill": float(self.step.prefill), "tokens_prefill_cached": float(self.step.prefill_cached),
                   "tokens_sampled": float(self.step.sampled), "tokens_trained": float(self.step.trained)}
        self.step, self.usd_step = Tokens(), 0.0
        return metrics


# -- the rate table ----------------------------------------------------------------------------------------------
class RateCard(BaseModel):
    """Published per-model rates (USD per million tokens) with the date they took effect and where they come from."""

    model_config = ConfigDict(extra="forbid")

    effective: dt.date
    checked: dt.date
    source: str
    note: str
    models: dict[str, Prices]
    retired: dict[str, str] = Field(default_factory=dict)  # model -> retirement date and replacement


def _rates(prefill: float, sampled: float, trained: float) -> Prices:
    # the page lists prefill, sample and train, and gives cached prefill an 80% discount
    return Prices(prefill=prefill, prefill_cached=round(prefill * 0.2, 6), sampled=sampled, trained=trained)


RATE_CARD = RateCard(
    effective=dt.date(2026, 7, 17),
    checked=dt.date(2026, 10, 7),
    source="https://tinker-docs.thinkingmachines.ai/tinker/models/ (Models & Pricing)",
    note=("Tinker's Models & Pricing page as transcribed by two third-party sources: prices effective 2026-07-17 "
          "(sundial-org/skills, tinker-training-cost/SKILL.md) and the Qwen3.6-35B-A3B prefill, cached prefill and "
          "sample rates as of 2026-10-07 (tangled.org/cameron.stream/machine, src/pricing.ts); cached prefill is "
          "the page's 80% discount on prefill. Check the page, or set prices, before relying on a figure."),
    models={
        "Qwen/Qwen3.6-35B-A3B": _rates(0.54, 1.335, 1.177),
        "Qwen/Qwen3.6-27B": _rates(1.86, 5.595, 4.103),
        "Qwen/Qwen3.5-397B-A17B": _rates(3.00, 7.50, 6.60),
        "Qwen/Qwen3.5-397B-A17B:peft:262144": _rates(4.00, 10.00, 12.00),
        "Qwen/Qwen3.5-35B-A3B-Base": _rates(0.54, 1.335, 1.177),
        "Qwen/Qwen3.5-9B": _rates(0.66, 1.995, 1.463),
        "Qwen/Qwen3.5-9B-Base": _rates(0.66, 1.995, 1.463),
        "Qwen/Qwen3.5-4B": _rates(0.33, 1.005, 0.737),
        "Qwen/Qwen3-8B": _rates(0.195, 0.60, 0.44),
    },
    retired={  # tinker-docs.thinkingmachines.ai/tinker/model-deprecations/
        "Qwen/Qwen3.5-35B-A3B": "retired 2026-06-12; replacement Qwen/Qwen3.6-35B-A3B",
        "Qwen/Qwen3.5-27B": "retired 2026-06-12; replacement Qwen/Qwen3.6-27B",
        "Qwen/Qwen3-30B-A3B": "retired 2026-06-12; replacement Qwen/Qwen3.6-35B-A3B",
        "Qwen/Qwen3-30B-A3B-Instruct-2507": "retired 2026-06-12; replacement Qwen/Qwen3.6-35B-A3B (non-thinking mode)",
    },
)


def _lookup(base_model: str, card: RateCard) -> Prices | None:
    if base_model.split("/")[-1] == LOCAL_MODEL:
        return Prices(prefill=0.0, prefill_cached=0.0, sampled=0.0, trained=0.0)
    for name, prices in card.models.items():
        if name.lower() == base_model.lower():
            return prices
    return None


def price_problem(base_model: str, override: Prices | None = None, *, card: RateCard = RATE_CARD,
                  option: str = "outer_trainer.tinker.prices") -> str | None:
    """None when ``base_model`` can be priced (an override, or a row of ``card``); else the one-line reason."""
    if override is not None or _lookup(base_model, card) is not None:
        return None
    retired = next((why for name, why in card.retired.items() if name.lower() == base_model.lower()), None)
    known = f" ({retired})" if retired else ""
    return (f"no published Tinker rates for base model {base_model!r}{known} in the shipped rate table (effective "
            f"{card.effective}, {card.source}): set {option} = {{prefill = ..., prefill_cached = ..., sampled = ..., "
            f"trained = ...}} (USD per million tokens)")


def prices_for(base_model: str, override: Prices | None = None, *, card: RateCard = RATE_CARD) -> Prices:
    """The rates to price ``base_model``'s tokens with: ``override`` when given, else ``card``'s row (the local
    server's model costs nothing). Raises ValueError with :func:`price_problem`'s line for an unknown model."""
    if override is not None:
        return override
    found = _lookup(base_model, card)
    if found is None:
        raise ValueError(price_problem(base_model, card=card))
    return found


def session_metadata(run_id: str, **extra: Any) -> dict[str, str]:
    """``user_metadata`` for the run's ``tinker.ServiceClient``: the run id under :data:`METADATA_RUN_KEY` (what
    :func:`reconcile` matches), and ``extra`` as strings (e.g. ``outer_step=12``)."""
    return {METADATA_RUN_KEY: str(run_id), **{k: str(v) for k, v in extra.items() if v is not None}}


# -- reconciliation with the service's billing -------------------------------------------------------------------
class BillingCheck(BaseModel):
    """The service's billing for the run's sessions beside the trainer's estimate. ``checked`` False: no billing
    could be read (``reason`` says why: no billing role, no answer in time, another failure). ``billed_usd`` sums
    the events' ``estimated_cost_usd`` by kind (prefill, prefill_cached, sampled, trained, and storage/checkpoint
    where billed to a session); ``unpriced_events`` had no cost yet. ``difference_usd`` is billed minus estimated."""

    model_config = ConfigDict(extra="forbid")

    checked: bool
    reason: str | None = None
    starting_on: dt.datetime | None = None
    ending_before: dt.datetime | None = None
    sessions: list[str] = Field(default_factory=list)
    billed_usd: dict[str, float] = Field(default_factory=dict)
    billed_usd_total: float = 0.0
    billed_tokens: Tokens = Field(default_factory=Tokens)
    unpriced_events: int = 0
    estimate_usd: float = 0.0
    estimate_tokens: Tokens = Field(default_factory=Tokens)
    difference_usd: float = 0.0
    tokens_difference: dict[str, int] = Field(default_factory=dict)
    partial: bool = False
    note: str | None = None
    cost_data_through: dt.datetime | None = None

    def line(self) -> str:
        """One line for the report."""
        if not self.checked:
            return f"the service's billing was not read: {self.reason}"
        text = (f"the service billed ${self.billed_usd_total:.4f} for {len(self.sessions)} session(s) "
                f"(estimate ${self.estimate_usd:.4f}, difference ${self.difference_usd:+.4f})")
        return f"{text}; {self.note}" if self.note else text


def reconcile(usage: Any, *, estimate: Tokens, estimate_usd: float, session_ids: Iterable[str] = (),
              run_id: str | None = None, metadata_key: str = METADATA_RUN_KEY,
              starting_on: dt.datetime | None = None, ending_before: dt.datetime | None = None) -> BillingCheck:
    """Set a ``tinker.types.BillingUsageResponse`` beside the estimate. The run's sessions are ``session_ids`` and
    every session whose ``user_metadata[metadata_key]`` is ``run_id``."""
    wanted = set(session_ids)
    if run_id is not None:
        for sid, session in (usage.sessions or {}).items():
            if (session.user_metadata or {}).get(metadata_key) == run_id:
                wanted.add(sid)
    usd: dict[str, float] = {}
    counts = dict.fromkeys(KINDS, 0)  # here "prefill" is the uncached part
    matched: set[str] = set()
    unpriced = 0
    for event in usage.data:
        if event.session_id is None or event.session_id not in wanted:
            continue
        matched.add(event.session_id)
        info = event.event_info
        if info.type == "sampling_prefill":
            kind = "prefill_cached" if info.cached else "prefill"
        else:
            kind = {"training": "trained", "sampling_sample": "sampled"}.get(info.type, info.type)
        if kind in counts:
            counts[kind] += info.token_count
        if event.estimated_cost_usd is not None:
            usd[kind] = usd.get(kind, 0.0) + event.estimated_cost_usd
        elif info.type != "checkpoint":  # checkpoint operations carry no cost by design
            unpriced += 1
    billed = Tokens(prefill=counts["prefill"] + counts["prefill_cached"], prefill_cached=counts["prefill_cached"],
                    sampled=counts["sampled"], trained=counts["trained"])
    total = sum(usd.values())
    difference = {k: getattr(billed, k) - getattr(estimate, k) for k in KINDS}
    notes = []
    if not matched:
        notes.append("no usage of the run's sessions in the window yet (the service's usage lags real time by up to "
                     "a few hours)")
    elif any(v < 0 for v in difference.values()):
        notes.append("the service has counted fewer tokens than the trainer: its usage lags real time by up to a few "
                     "hours, so the last hours may be missing")
    if unpriced:
        notes.append(f"{unpriced} event(s) have no cost yet (a completed day not yet reconciled with the invoice)")
    return BillingCheck(
        checked=True, starting_on=starting_on, ending_before=ending_before, sessions=sorted(matched),
        billed_usd=usd, billed_usd_total=total, billed_tokens=billed, unpriced_events=unpriced,
        estimate_usd=estimate_usd, estimate_tokens=estimate, difference_usd=total - estimate_usd,
        tokens_difference=difference, partial=bool(notes), note="; ".join(notes) or None,
        cost_data_through=getattr(usage, "cost_data_through", None))


def billing_windows(started_at: dt.datetime, now: dt.datetime | None = None) -> list[tuple[dt.datetime, dt.datetime]]:
    """UTC hour-aligned windows of at most 14 days each that cover ``started_at`` to ``now`` (its hour included)."""
    now = now or dt.datetime.now(dt.UTC)
    start = _utc(started_at).replace(minute=0, second=0, microsecond=0)
    end = _utc(now).replace(minute=0, second=0, microsecond=0) + HOUR
    start = min(start, end - HOUR)  # a start in the future asks for the current hour
    windows = []
    while start < end:
        windows.append((start, min(start + MAX_WINDOW, end)))
        start = windows[-1][1]
    return windows


async def check_billing(*, base_url: str | None, api_key: str | None, started_at: dt.datetime,
                        estimate: Tokens, estimate_usd: float, session_ids: Iterable[str] = (),
                        run_id: str | None = None, deadline_s: float = 60.0,
                        now: dt.datetime | None = None) -> BillingCheck:
    """Ask the service (``tinker.AdminClient(...).get_billing_usage``) for the run's usage since ``started_at`` and
    :func:`reconcile` it, all within ``deadline_s``. Never raises: no billing role (401/403), no answer in time or
    any other failure is a :class:`BillingCheck` with ``checked=False`` and the reason."""
    windows = billing_windows(started_at, now)
    session_ids = list(session_ids)
    first, last = (windows[0][0], windows[-1][1]) if windows else (None, None)

    def fetch() -> Any:
        import tinker

        admin = tinker.AdminClient(base_url=base_url, api_key=api_key)
        responses = [admin.get_billing_usage(start, end).result(timeout=deadline_s) for start, end in windows]
        merged = responses[0]
        for extra in responses[1:]:
            merged = merged.model_copy(update={"data": merged.data + extra.data,
                                               "sessions": {**merged.sessions, **extra.sessions}})
        return merged

    try:
        usage = await asyncio.wait_for(asyncio.wrap_future(_on_daemon_thread(fetch)), deadline_s)
    except Exception as error:  # noqa: BLE001 - the report says why, the run goes on
        return BillingCheck(checked=False, reason=_why(error, deadline_s), starting_on=first, ending_before=last,
                            estimate_usd=estimate_usd, estimate_tokens=estimate)
    return reconcile(usage, estimate=estimate, estimate_usd=estimate_usd, session_ids=session_ids, run_id=run_id,
                     starting_on=first, ending_before=last)


def _on_daemon_thread(work) -> concurrent.futures.Future:
    """``work()`` on a daemon thread (the SDK's own retries can outlast the deadline: they never hold the exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # running: a waiter that gives up cannot cancel it under the thread

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            future.set_exception(error)

    threading.Thread(target=run, name="tinker-billing", daemon=True).start()
    return future


def _why(error: BaseException, deadline_s: float) -> str:
    status = getattr(error, "status_code", None)
    if isinstance(error, (TimeoutError, concurrent.futures.TimeoutError)):
        return f"the service did not answer within {deadline_s:g} s"
    detail = " ".join(str(getattr(error, "message", None) or error).split())[:200]
    if status in (401, 403):
        return f"the API key may not read billing (HTTP {status}: it needs the billing or admin role): {detail}"
    if status is not None:
        return f"the service answered HTTP {status}: {detail}"
    return f"{type(error).__name__}: {detail}"


def _utc(moment: dt.datetime) -> dt.datetime:
    return moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment.astimezone(dt.UTC)
