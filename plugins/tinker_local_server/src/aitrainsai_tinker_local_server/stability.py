"""Stability info for ``stable_reinforce``: what a sampler made with ``record_stability_info=True`` saw and drew,
kept per ``sequence_id``, and the checks that tie a training datum's provenance spans to it.

For each sequence the store keeps the request's prompt tokens, the sampled tokens and the sampler's own log-probs
of them, for the session that sampled it (the sampler id's session). A record lives one day from its last use
(sampling it, or a training request naming it) and the store holds at most ``max_sequences`` records and
``max_tokens`` counted tokens (prompt + sampled, per record), dropping the least recently used first.

``attach`` checks a ``stable_reinforce`` request against the records and, when every datum passes, gives each datum
the recorded log-probs of its targets; anything else is a ``BadRequest`` (HTTP 400). Used from the event loop
(checks) and the model thread (records), hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aitrainsai_tinker_local_server.wire import BadRequest, Datum, FwdBwdRequest, Span

TTL_S = 86400.0  # one day from the last use, as Tinker documents
MAX_SEQUENCES = 100_000
MAX_TOKENS = 20_000_000  # counted tokens (prompt + sampled per record): at most ~160 MB of int32/float32 arrays


@dataclass
class Record:
    session: str
    prompt: np.ndarray  # int32, the request's prompt (one array shared by the request's samples)
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's log-prob of each sampled token
    used: float

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


def sampler_session(sampler_id: str) -> str | None:
    """The session a sampler belongs to (``<session>:sample:<n>``), or None for a one-off sampler."""
    return sampler_id.split(":sample:")[0] if ":sample:" in sampler_id else None


def training_session(model_id: str) -> str:
    return model_id.split(":train:")[0]


class StabilityStore:
    def __init__(self, *, ttl_s: float = TTL_S, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_TOKENS,
                 clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self.clock = clock
        self._records: OrderedDict[str, Record] = OrderedDict()  # least recently used first
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._records

    def record(self, sequence_ids: Sequence[str], session: str, prompt: Sequence[int],
               sequences: Sequence[tuple[Sequence[int], Sequence[float], bool]]) -> None:
        """Keep what one sample request saw and drew: ``sequences`` as ``Engine.sample`` returns them."""
        if len(sequence_ids) != len(sequences):
            raise ValueError(f"{len(sequence_ids)} sequence ids for {len(sequences)} sequences")
        shared = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            now = self.clock()
            for sequence_id, (tokens, logprobs, _stopped) in zip(sequence_ids, sequences):
                self._drop(sequence_id)
                record = Record(session, shared, np.asarray(tokens, dtype=np.int32),
                                np.asarray(logprobs, dtype=np.float32), now)
                self._records[sequence_id] = record
                self._tokens += record.size
            self._evict(now)

    def attach(self, request: FwdBwdRequest, session: str) -> None:
        """Check every datum's provenance against the records of ``session``, then set each datum's
        ``recorded_logprobs`` and ``sampled_mask`` and restart the day of every record it names."""
        with self._lock:
            now = self.clock()
            self._evict(now)
            used: set[str] = set()
            resolved = [self._resolve(index, datum, session, used) for index, datum in enumerate(request.data)]
            for datum, (recorded, mask) in zip(request.data, resolved):
                datum.recorded_logprobs, datum.sampled_mask = recorded, mask
            for sequence_id in used:
                self._records[sequence_id].used = now
                self._records.move_to_end(sequence_id)

    # --- internals (under the lock) ---

    def _drop(self, sequence_id: str) -> None:
        old = self._records.pop(sequence_id, None)
        if old is not None:
            self._tokens -= old.size

    def _evict(self, now: float) -> None:
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
            if (now - oldest.used <= self.ttl_s and len(self._records) <= self.max_sequences
                    and self._tokens <= self.max_tokens):
                break
            self._drop(oldest_id)

    def _get(self, index: int, span: Span, session: str, used: set[str]) -> Record:
        record = self._records.get(span.sequence_id)
        if record is None:
            raise BadRequest(f"datum {index}: no stability info for sequence {span.sequence_id!r}: unknown, expired "
                             f"(kept {self.ttl_s / 3600:g} h from last use), evicted, or sampled without "
                             "record_stability_info=True")
        if record.session != session:
            raise BadRequest(f"datum {index}: sequence {span.sequence_id!r} was sampled in another session; "
                             "stability info belongs to the session that sampled it")
        used.add(span.sequence_id)
        return record

    def _resolve(self, index: int, datum: Datum, session: str, used: set[str]) -> tuple[np.ndarray, np.ndarray]:
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            raise BadRequest(f"datum {index}: stable_reinforce needs provenance: sample with "
                             "record_stability_info=True and send Datum.with_provenance(model_input=[...], "
                             "loss_fn_inputs=[...]) naming the sequence_ids")
        tokens = np.asarray(datum.tokens, dtype=np.int64)
        targets = datum.inputs["target_tokens"].astype(np.int64)
        for field, spans, length in (("model_input", datum.model_input_spans, len(tokens)),
                                     ("loss_fn_inputs", datum.loss_fn_input_spans, len(targets))):
            covered = sum(span.length for span in spans)
            if covered != length:
                raise BadRequest(f"datum {index}: {field} provenance spans cover {covered} positions of {length}; "
                                 "they must tile it exactly")
        position = 0
        for span in datum.model_input_spans:
            record = self._get(index, span, session, used)
            _same(index, "model_input", position, span, tokens[position:position + span.length], record)
            position += span.length
        recorded = np.zeros(len(targets), dtype=np.float32)
        mask = np.zeros(len(targets), dtype=bool)
        position = 0
        for span in datum.loss_fn_input_spans:
            record = self._get(index, span, session, used)
            end = position + span.length
            _same(index, "loss_fn_inputs", position, span, targets[position:end], record)
            if span.kind == "sampled" and span.length:
                # the recorded log-probs are conditional on the recorded prompt and the tokens sampled before:
                # the datum's context of these targets must be exactly that
                context = np.concatenate([record.prompt, record.tokens[:span.offset + span.length - 1]])
                if not np.array_equal(tokens[:end], context):
                    raise BadRequest(f"datum {index}: the model_input before the targets at {position}..{end - 1} "
                                     f"is not the prompt of sequence {span.sequence_id!r} followed by its sampled "
                                     f"tokens before offset {span.offset} (its recorded log-probs hold in that "
                                     "context only)")
                recorded[position:end] = record.logprobs[span.offset:span.offset + span.length]
                mask[position:end] = True
            position = end
        advantages = datum.inputs["advantages"]
        stray = np.flatnonzero((advantages != 0) & ~mask)
        if stray.size:
            at = int(stray[0])
            raise BadRequest(f"datum {index}: advantage {float(advantages[at]):g} at target position {at}, which no "
                             "SampledProvenanceSpan covers (stable_reinforce trains sampled tokens only)")
        return recorded, mask


def _same(index: int, field: str, position: int, span: Span, got: np.ndarray, record: Record) -> None:
    source = record.prompt if span.kind == "prompt" else record.tokens
    what = "prompt" if span.kind == "prompt" else "sampled"
    if span.offset + span.length > len(source):
        raise BadRequest(f"datum {index}: {field} span at {position} claims {what} tokens {span.offset}.."
                         f"{span.offset + span.length - 1} of sequence {span.sequence_id!r}, which has "
                         f"{len(source)}")
    expected = source[span.offset:span.offset + span.length]
    if not np.array_equal(got, expected):
        at = int(np.flatnonzero(got != expected)[0])
        raise BadRequest(f"datum {index}: {field} position {position + at} is token {int(got[at])}, but sequence "
                         f"{span.sequence_id!r} recorded token {int(expected[at])} at {what} position "
                         f"{span.offset + at}")
