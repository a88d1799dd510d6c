"""What the local server reads and writes: pydantic models of the JSON request bodies it parses (the fields tinker
0.38 sends; others are ignored), and the protobuf messages (``tinker.proto.tinker_public_pb2``) for forward/backward
requests and for the ``ForwardBackwardOutput`` and ``SampleResponse`` results, which 0.38 accepts only as proto."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tinker.proto import tinker_public_pb2 as pb


class BadRequest(ValueError):
    """A request the server refuses: HTTP 400 with this message (or, inside a future, a user error)."""


class NotFound(BadRequest):
    """A name that is not this server's, or not the caller's: HTTP 404 (the same answer either way)."""


# Every id the server takes, in full: it mints session and request ids (random: one cannot be guessed from another),
# and the SDK builds model and sampler ids from a session id and a counter. Ids name entries of the server's tables
# (and the folders it made for them), never a path.
_SESSION = r"session-[A-Za-z0-9_-]{1,64}"
SESSION_ID = re.compile(_SESSION)
MODEL_ID = re.compile(rf"({_SESSION}):train:[0-9]{{1,10}}")  # a training run's id, and its checkpoints' run id
SAMPLER_ID = re.compile(rf"({_SESSION}):sample:[0-9]{{1,10}}")
REQUEST_ID = re.compile(r"req-[A-Za-z0-9_-]{1,64}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a checkpoint's name: one path segment, no leading dot
KINDS = ("weights", "sampler_weights", "external_weights")
SEQ_MAX = 10**9  # seq ids the SDK counts from 0


def shown(text: str, limit: int = 80) -> str:
    """Client text as an error message repeats it: quoted, at most ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def check_id(pattern: re.Pattern[str], text: str, what: str) -> str:
    """``text`` if it is a whole id of ``pattern``, else :class:`NotFound` (no id of this server looks like it)."""
    if not pattern.fullmatch(text):
        raise NotFound(f"no {what} {shown(text)} on this server")
    return text


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class LoraConfigBody(Body):
    rank: int = Field(ge=1, le=128)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(Body):
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str
    model_seq_id: int = Field(ge=0, lt=SEQ_MAX)
    base_model: str
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = OptimizerConfigBody()


class LoadWeightsBody(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0, lt=SEQ_MAX)
    base_model: str | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfigBody | None = None


class AdamParamsBody(Body):
    # tinker.AdamParams, with its defaults
    learning_rate: float = Field(default=1e-4, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStepBody(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    overwrite: bool = False


class SaveForSamplerBody(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = Field(default=None, ge=0, lt=SEQ_MAX)
    kind: str = "snapshot"
    seq_id: int | None = None


class SaveExternalBody(Body):
    model_id: str
    path: str
    seq_id: int | None = None
    age_encryption_recipients: list[str] | None = None


class SessionBody(Body):
    session_id: str


class CreateSamplingSessionBody(Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, lt=SEQ_MAX)
    base_model: str | None = None
    model_path: str | None = None


class ChunkBody(Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInputBody(Body):
    chunks: list[ChunkBody]

    def tokens(self) -> list[int]:
        if any(chunk.type != "encoded_text" for chunk in self.chunks):
            raise BadRequest("the local server takes token chunks only (no images or audio)")
        return [t for chunk in self.chunks for t in chunk.tokens]


class SamplingParamsBody(Body):
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(Body):
    num_samples: int = Field(default=1, ge=1, le=256)
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None  # keep each sequence's stability info (stable_reinforce)


class RetrieveBody(Body):
    request_id: str


class ModelIdBody(Body):
    model_id: str


class FaultBody(Body):
    model_config = ConfigDict(extra="forbid")
    op: str = "*"
    status: int | None = Field(default=None, ge=400, le=599)
    count: int | None = Field(default=None, ge=1)
    hang: bool = False
    clear: bool = False

    @field_validator("op")
    @classmethod
    def _op(cls, value: str) -> str:
        return value.strip("/")


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise BadRequest(f"checkpoint name {shown(name)}: use letters, digits, '.', '_' and '-' (at most 128, "
                         "starting with a letter or digit)")
    return name


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<run id>/<kind>/<name>``, each part checked whole: the run id is a training model's id."""

    run_id: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    name: str

    def __post_init__(self) -> None:
        if not MODEL_ID.fullmatch(self.run_id) or self.kind not in KINDS or not NAME.fullmatch(self.name):
            raise BadRequest(f"not a tinker path of this server: {shown(str(self), 200)} "
                             "(tinker://<model_id>/weights/<name>)")

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3:
            raise BadRequest(f"not a tinker path of this server: {shown(path, 200)} (tinker://<model_id>/weights/<name>)")
        return cls(parts[0], parts[1], parts[2])  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


# --- forward/backward (protobuf) ---

@dataclass(frozen=True)
class Span:
    """One provenance run (a proto ``ProvenanceSpan``): ``length`` datum positions that are positions
    ``[offset, offset + length)`` of sequence ``sequence_id``'s request prompt (``kind="prompt"``) or of its sampled
    tokens (``kind="sampled"``)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]
    model_input_spans: list[Span] | None = None  # None: the datum carries no provenance
    loss_fn_input_spans: list[Span] | None = None
    # stable_reinforce, set by the stability store from its records: the sampler's own log-prob of each target
    # (0 where no SampledProvenanceSpan covers it) and which targets a SampledProvenanceSpan covers
    recorded_logprobs: np.ndarray | None = None
    sampled_mask: np.ndarray | None = None

    def loss_inputs(self) -> dict[str, np.ndarray]:
        """``inputs``, plus the recorded sampler log-probs and sampled mask once the stability store set them."""
        if self.recorded_logprobs is None or self.sampled_mask is None:
            return self.inputs
        return {**self.inputs, "recorded_logprobs": self.recorded_logprobs, "sampled_mask": self.sampled_mask}


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def parse_forward_backward(body: bytes) -> FwdBwdRequest:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # noqa: BLE001 - the protobuf runtime raises its own DecodeError
        raise BadRequest(f"forward_backward body is not a ForwardBackwardRequest: {error}") from None
    data = []
    for index, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") not in (None, "encoded_text"):
                raise BadRequest("the local server takes token chunks only (no images or audio)")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {}
        for key, tensor in datum.loss_fn_inputs.items():
            if tensor.HasField("sparse_csr"):
                raise BadRequest(f"datum {index}: sparse loss_fn_inputs[{key!r}] is not supported here")
            dtype = _DTYPES.get(tensor.dtype)
            if dtype is None:
                raise BadRequest(f"datum {index}: loss_fn_inputs[{key!r}] has an unsupported dtype")
            inputs[key] = np.frombuffer(tensor.dense, dtype=dtype)
        data.append(Datum(tokens, inputs,
                          model_input_spans=_spans(index, "model_input_spans", datum.model_input_spans),
                          loss_fn_input_spans=_spans(index, "loss_fn_input_spans", datum.loss_fn_input_spans)))
    config: dict[str, float | str] = dict(message.loss_fn_config.items())
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    return FwdBwdRequest(message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data)


def _spans(index: int, field: str, spans) -> list[Span] | None:
    """A datum's provenance runs; an empty list (what proto3 sends for none) is no provenance."""
    out = []
    for span in spans:
        arm = span.WhichOneof("span")
        if arm is None:
            raise BadRequest(f"datum {index}: a {field} entry has neither prompt_tokens nor sampled_tokens")
        run = getattr(span, arm)
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise BadRequest(f"datum {index}: a {field} entry needs a sequence_id, offset >= 0 and length >= 0")
        out.append(Span("prompt" if arm == "prompt_tokens" else "sampled", run.sequence_id, run.offset, run.length))
    return out or None


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput`` with one ArrayRecord: each field's per-datum float32 arrays, concatenated."""
    record = pb.ArrayRecord(num_datums=len(per_datum))
    for name in per_datum[0] if per_datum else []:
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        output.metrics[key] = float(value)
    return output.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], bool]],
                    prompt_logprobs: list[float] | None, *, cache_hit_tokens: int = 0) -> bytes:
    response = pb.SampleResponse(prompt_cache_hit_tokens=cache_hit_tokens)
    for tokens, logprobs, stopped in sequences:
        response.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes()))
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return response.SerializeToString()
