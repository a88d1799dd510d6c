"""The local server's usage accounting: each session's ``user_metadata``, the tokens it prefilled (cache hits
apart), sampled and trained, hour by hour, priced from the rate card the server was started with (default: zero),
and answered as ``GET /api/v1/billing/usage/events`` in the shape of ``tinker.types.BillingUsageResponse``.

Prefix-cache hits are an accounting stand-in: the local server keeps no KV cache, so a prompt's
``prompt_cache_hit_tokens`` is the longest token prefix it shares with an earlier prompt plus completion of the same
session (the last :data:`KEPT_SEQUENCES` of the last :data:`KEPT_SESSIONS` sessions; the final prompt token is
always prefilled). As the SDK documents, with ``num_samples > 1`` the repeats of the prompt are billed as cache hits.
Usage lives in memory: a restarted server starts from zero.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from aitrainsai_tinker_local_server import MODEL_NAME
from aitrainsai_tinker_local_server.wire import BadRequest

MILLION = 1_000_000
KEPT_SEQUENCES = 64  # per session, for the prefix-cache stand-in
KEPT_SESSIONS = 32
MAX_WINDOW = dt.timedelta(days=14)
HOUR_S = 3600


class Rates(BaseModel):
    """The server's rate card: USD per million tokens of each kind (default: all zero)."""

    model_config = ConfigDict(extra="forbid")

    prefill: float = Field(0.0, ge=0)
    prefill_cached: float = Field(0.0, ge=0)
    sampled: float = Field(0.0, ge=0)
    trained: float = Field(0.0, ge=0)

    @classmethod
    def parse(cls, text: str | None) -> Rates:
        """``--rates``: a JSON object such as ``{"prefill": 0.54, "sampled": 1.335}``."""
        return cls() if not text else cls.model_validate(json.loads(text))


class CreateSessionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_metadata: dict[str, Any] | None = None


# (hour bucket start in epoch seconds, session id or None, event type, cached) -> tokens
Key = tuple[int, str | None, str, bool]


class Billing:
    """Thread-safe: samples and training are counted on the model thread, usage is read on the event loop."""

    def __init__(self, rates: Rates | None = None, *, billing_key: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.rates = rates or Rates()
        self.billing_key = billing_key
        self._clock = clock
        self._lock = threading.Lock()
        self._metadata: dict[str, dict[str, str]] = {}
        self._usage: dict[Key, int] = {}
        self._seen: OrderedDict[str, deque[np.ndarray]] = OrderedDict()

    # --- counting ---

    def session(self, session_id: str, user_metadata: dict[str, Any] | None) -> None:
        values = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (user_metadata or {}).items()}
        with self._lock:
            self._metadata[session_id] = values

    def sampled(self, session_id: str | None, prompt: list[int], completions: list[list[int]]) -> int:
        """Count one sample request (its prompt, one completion per sample); returns its prompt's cache hits."""
        prompt_array = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            seen = self._seen.pop(session_id, None) if session_id is not None else None
            hits = _longest_prefix(prompt_array, seen or ()) if len(prompt) > 1 else 0
            if session_id is not None:
                seen = seen if seen is not None else deque(maxlen=KEPT_SEQUENCES)
                for completion in completions or [[]]:
                    seen.append(np.asarray(prompt + list(completion), dtype=np.int64))
                self._seen[session_id] = seen
                while len(self._seen) > KEPT_SESSIONS:
                    self._seen.popitem(last=False)
            repeats = len(prompt) * (max(len(completions), 1) - 1)
            self._count(session_id, "sampling_prefill", len(prompt) - hits, cached=False)
            self._count(session_id, "sampling_prefill", hits + repeats, cached=True)
            self._count(session_id, "sampling_sample", sum(len(c) for c in completions))
        return hits

    def trained(self, session_id: str | None, tokens: int) -> None:
        with self._lock:
            self._count(session_id, "training", tokens)

    def _count(self, session_id: str | None, kind: str, tokens: int, *, cached: bool = False) -> None:
        if tokens > 0:
            hour = int(self._clock()) // HOUR_S * HOUR_S
            key = (hour, session_id, kind, cached)
            self._usage[key] = self._usage.get(key, 0) + tokens

    # --- reading ---

    def usage(self, starting_on: str | None, ending_before: str | None) -> dict:
        """``BillingUsageResponse`` as JSON for ``[starting_on, ending_before)`` (RFC 3339, on UTC hours)."""
        start, end = _moment("starting_on", starting_on), _moment("ending_before", ending_before)
        if start > dt.datetime.fromtimestamp(self._clock(), dt.UTC):
            raise BadRequest("starting_on must not be in the future")
        if not start < end <= start + MAX_WINDOW:
            raise BadRequest("ending_before must be after starting_on and at most 14 days after it")
        low, high = int(start.timestamp()), int(end.timestamp())
        with self._lock:
            rows = [(key, tokens) for key, tokens in self._usage.items() if low <= key[0] < high]
            metadata = dict(self._metadata)
        rows.sort(key=lambda row: (row[0][0], -row[1]))
        data = [self._event(key, tokens) for key, tokens in rows]
        sessions = {row[0][1]: {"user_metadata": metadata.get(row[0][1]) or None} for row in rows
                    if row[0][1] is not None}
        return {"data": data, "sessions": sessions, "cost_data_through": None}

    def _event(self, key: Key, tokens: int) -> dict:
        hour, session_id, kind, cached = key
        rate = {"training": self.rates.trained, "sampling_sample": self.rates.sampled}.get(
            kind, self.rates.prefill_cached if cached else self.rates.prefill)
        info: dict[str, Any] = {"type": kind, "token_count": tokens}
        if kind == "sampling_prefill":
            info["cached"] = cached
        return {"bucket_start": _iso(hour), "bucket_end": _iso(hour + HOUR_S), "base_model": MODEL_NAME,
                "user_id": None, "user_name": None, "session_id": session_id, "project_id": None,
                "estimated_cost_usd": rate * tokens / MILLION, "effective_rate_usd_per_million_tokens": rate,
                "effective_rate_usd_per_gigabyte_month": None, "event_info": info}


def _longest_prefix(prompt: np.ndarray, seen) -> int:
    """The longest prefix ``prompt`` shares with any of ``seen``, short of its last token."""
    best = 0
    for earlier in seen:
        n = min(len(earlier), len(prompt) - 1)
        if n <= best:
            continue
        same = earlier[:n] == prompt[:n]
        best = max(best, n if same.all() else int(np.argmin(same)))
    return best


def session_of(model_or_sampler_id: str | None) -> str | None:
    """The session a ``<session>:train:<n>`` model or ``<session>:sample:<n>`` sampler belongs to (None: one-off)."""
    for marker in (":train:", ":sample:"):
        if model_or_sampler_id and marker in model_or_sampler_id:
            return model_or_sampler_id.split(marker)[0]
    return None


def _moment(name: str, text: str | None) -> dt.datetime:
    if not text:
        raise BadRequest(f"{name} is required (RFC 3339, on a UTC hour)")
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name} {text!r} is not an RFC 3339 time") from None
    moment = moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment.astimezone(dt.UTC)
    if moment.minute or moment.second or moment.microsecond:
        raise BadRequest(f"{name} {text!r} is not aligned to a UTC hour")
    return moment


def _iso(epoch: int) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat().replace("+00:00", "Z")
