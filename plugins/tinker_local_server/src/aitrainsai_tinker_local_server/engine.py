"""The model work behind the local server: training runs (a LoRA adapter, its accumulated gradients and its Adam
state each), sampler versions (frozen adapter copies), checkpoints on disk. Every method runs on the server's one
worker thread; nothing here is thread-safe on its own.

One ``LocalModel`` per adapter shape (rank and projections) holds the base weights; each run's adapter is copied
into it before that run's work (an adapter of rank 8 is ~10 MB, so the copy costs milliseconds).

Numerics (``dtype``, default bfloat16): as in the local GRPO trainer, base weights are held in the compute dtype and
the forward/backward runs in it, while the adapter (the master weights), its gradients and the Adam moments stay
float32. In bf16 a sampler applies its frozen adapter copy unmerged, as training does: folding LoRA into bf16
weights would round small updates away and make the sampler's log-probs differ from training's (about 0.05 nats a
token after one update), so importance ratios would not start at 1; and training runs rows of one length together,
unpadded (padding changes roundings too). In fp32 samplers merge and rows pad (exact enough, faster).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch
from aitrainsai_trainer_local.local_model import PROJECTIONS, LocalModel, LocalSampler

from aitrainsai_tinker_local_server import MODEL_NAME
from aitrainsai_tinker_local_server.wire import (
    KINDS,
    NAME,
    AdamParamsBody,
    BadRequest,
    Datum,
    FwdBwdRequest,
    NotFound,
    SampleBody,
    TinkerPath,
)

LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_TOKENS = 1024  # when a request gives none
TOKENS_PER_MICROBATCH = 4096  # forward/backward memory bound: datums are run in groups of about this many tokens
CHECKPOINT_FILE = "checkpoint.pt"
DTypeName = Literal["bfloat16", "float32"]
DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32")
DEFAULT_DTYPE = "auto"  # bfloat16 on a GPU; float32 on a CPU, where bf16 updates measured 2.3x slower (README)

# loss -> the loss_fn_inputs keys it needs, and the loss_fn_config keys it takes (with defaults)
LOSSES: dict[str, tuple[frozenset[str], dict[str, float]]] = {
    "cross_entropy": (frozenset({"target_tokens", "weights"}), {}),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), {}),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}),
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (frozenset({"target_tokens", "logprobs", "advantages"}),
              {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": (frozenset({"target_tokens", "logprobs", "advantages"}), {}),
    "gspo": (frozenset({"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}), {}),
    # the local stand-in (Tinker has not published its objective): see _loss and the README
    "stable_reinforce": (frozenset({"target_tokens", "advantages"}), {"ratio_cap": 2.0, "kl_coeff": 0.0}),
}
# loss_fn_config keys Tinker documents without a default: the request must give them
REQUIRED_CONFIG: dict[str, frozenset[str]] = {
    "dro": frozenset({"beta"}),
    "gspo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
}
# loss_fn_inputs keys a loss accepts and ignores (stable_reinforce uses the recorded sampler log-probs instead)
OPTIONAL_INPUTS: dict[str, frozenset[str]] = {"stable_reinforce": frozenset({"logprobs"})}


@dataclass(frozen=True)
class Shape:
    """An adapter's shape: what decides which ``LocalModel`` can hold it."""

    rank: int
    targets: tuple[str, ...]


@dataclass
class Run:
    """A training run (a Tinker training client's model): its adapter is authoritative here."""

    model_id: str
    shape: Shape
    adapter: list[torch.Tensor]
    grads: list[torch.Tensor] | None = None
    exp_avg: list[torch.Tensor] | None = None
    exp_avg_sq: list[torch.Tensor] | None = None
    steps: int = 0


@dataclass
class SamplerVersion:
    sampler_id: str
    shape: Shape
    adapter: list[torch.Tensor]
    model_path: str | None = None
    created: float = field(default_factory=time.time)


class Engine:
    def __init__(self, state_dir: Path, *, device: str | None = None, dtype: str = DEFAULT_DTYPE,
                 max_models: int = 2, max_samplers: int = 2):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.state_dir = state_dir
        self.dtype: DTypeName = resolve_dtype(dtype, device)
        self.checkpoints = state_dir / "checkpoints"
        self.device = device
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, SamplerVersion] = {}
        self._models: OrderedDict[Shape, LocalModel] = OrderedDict()
        self._max_models = max_models
        self._merged: OrderedDict[str, LocalSampler] = OrderedDict()  # sampler id -> merged weights
        self._max_samplers = max_samplers
        self.default_shape = Shape(8, PROJECTIONS)
        self.context_length = LocalModel.max_context_length()
        self.tokenizer_dir = str(LocalModel.tokenizer_dir())
        self._decode_model: LocalModel | None = None

    # --- models and adapters ---

    def warm_up(self) -> None:
        """Load the base model now (the server reports ready only after this)."""
        self._model(self.default_shape)

    @property
    def compute_dtype(self) -> str:
        """The dtype the loaded model computes in (``bfloat16`` or ``float32``)."""
        return str(self._any_model().dtype).removeprefix("torch.")

    def _model(self, shape: Shape) -> LocalModel:
        if shape in self._models:
            self._models.move_to_end(shape)
            return self._models[shape]
        while len(self._models) >= self._max_models:
            self._models.popitem(last=False)
        model = LocalModel.create(lora_rank=shape.rank, lora_alpha=LORA_ALPHA, dtype=self.dtype,
                                  target_modules=shape.targets, device=self.device)
        self._models[shape] = model
        return model

    def _bound(self, shape: Shape, adapter: list[torch.Tensor]) -> LocalModel:
        model = self._model(shape)
        model.load_adapter_state(adapter)
        return model

    def _fresh_adapter(self, shape: Shape, seed: int) -> list[torch.Tensor]:
        model = self._model(shape)
        model.reset_adapter(seed)
        return model.adapter_state()

    # --- training runs ---

    def create_run(self, model_id: str, shape: Shape, *, seed: int | None) -> dict:
        seed = seed if seed is not None else random.randrange(2**31)
        self.runs[model_id] = Run(model_id, shape, self._fresh_adapter(shape, seed))
        return {"model_id": model_id, "type": "create_model"}

    def run(self, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"no training model {model_id!r} on this server")
        return run

    def info(self, model_id: str) -> dict:
        run = self.run(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": run.shape.rank,
                "model_name": MODEL_NAME, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "llama", "model_name": MODEL_NAME, "tokenizer_id": self.tokenizer_dir}}

    def forward_backward(self, request: FwdBwdRequest) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        run = self.run(request.model_id)
        check_loss(request, self.context_length)
        _, defaults = LOSSES[request.loss_fn]
        config = {**defaults, **{k: float(v) for k, v in request.config.items()}}
        model = self._bound(run.shape, run.adapter)
        params = model.parameters()
        for param in params:
            param.grad = None
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        for group in _microbatches(request.data):
            rows = [(d.tokens, d.inputs["target_tokens"].astype(np.int64).tolist()) for d in group]
            logprobs = self._token_logprobs(model, rows, grad=not request.forward_only)
            losses = [_loss(request.loss_fn, lp, d.loss_inputs(), config) for lp, d in zip(logprobs, group)]
            loss = torch.stack([item.sum() for item in losses]).sum()
            if not request.forward_only:
                loss.backward()
            total += float(loss.detach())
            for lp, item in zip(logprobs, losses):
                outputs.append({"logprobs": lp.detach().cpu().numpy(),
                                "elementwise_loss": item.detach().cpu().numpy()})
        if not request.forward_only:
            grads = [p.grad.detach().cpu() if p.grad is not None else torch.zeros_like(a)
                     for p, a in zip(params, run.adapter)]
            run.grads = grads if run.grads is None else [g + h for g, h in zip(run.grads, grads)]
            for param in params:
                param.grad = None
        tokens = sum(len(d.tokens) for d in request.data)
        return outputs, {"loss:sum": total, "num_tokens:sum": float(tokens), "num_datums:sum": len(request.data)}

    def _token_logprobs(self, model: LocalModel, rows: list[tuple[list[int], list[int]]],
                        grad: bool) -> list[torch.Tensor]:
        """``model.token_logprobs``; in bf16 without padding: rows of one length go together, so that each row is
        computed as a sampler computes it alone (left padding changes the roundings, and bf16 turns those into
        log-probs up to ~0.1 off the sampler's)."""
        if self.dtype == "float32":
            return model.token_logprobs(rows, grad=grad)
        by_length: dict[int, list[int]] = {}
        for index, (inputs, _) in enumerate(rows):
            by_length.setdefault(len(inputs), []).append(index)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for indices in by_length.values():
            for index, values in zip(indices, model.token_logprobs([rows[i] for i in indices], grad=grad)):
                out[index] = values
        return [values for values in out if values is not None]

    def optim_step(self, model_id: str, adam: AdamParamsBody) -> dict:
        """One AdamW step (as ``torch.optim.AdamW``: decoupled weight decay, bias-corrected moments) on the
        gradients accumulated since the last step; the global gradient norm is clipped first if asked."""
        run = self.run(model_id)
        grads = run.grads if run.grads is not None else [torch.zeros_like(a) for a in run.adapter]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            grads = [g * (adam.grad_clip_norm / (norm + 1e-6)) for g in grads]
        if run.exp_avg is None or run.exp_avg_sq is None:
            run.exp_avg = [torch.zeros_like(a) for a in run.adapter]
            run.exp_avg_sq = [torch.zeros_like(a) for a in run.adapter]
        run.steps += 1
        lr, b1, b2 = adam.learning_rate, adam.beta1, adam.beta2
        correction1, correction2 = 1 - b1 ** run.steps, 1 - b2 ** run.steps
        with torch.no_grad():
            for param, grad, m, v in zip(run.adapter, grads, run.exp_avg, run.exp_avg_sq):
                if adam.weight_decay:
                    param.mul_(1 - lr * adam.weight_decay)
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(correction2)).add_(adam.eps)
                param.addcdiv_(m, denom, value=-lr / correction1)
        run.grads = None
        return {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": lr, "step:max": float(run.steps)}}

    # --- checkpoints ---

    def _find(self, path: TinkerPath) -> Path | None:
        """The folder of checkpoint ``path`` as the state dir lists it, or None: each part an entry of the folder
        above it (a real folder, not a link), so nothing found lies outside ``checkpoints/``."""
        run = _entry(self.checkpoints, path.run_id)
        kind = _entry(run, path.kind) if run is not None else None
        return _entry(kind, path.name) if kind is not None else None

    def exists(self, path: TinkerPath) -> bool:
        return self._find(path) is not None

    def _target(self, path: TinkerPath) -> Path:
        """Where a live run writes checkpoint ``path`` (its run id is the run's model id; every part was checked
        whole by ``TinkerPath``)."""
        folder = self.checkpoints / path.run_id / path.kind / path.name
        for part in (folder.parent.parent, folder.parent):
            if part.is_symlink():
                raise BadRequest(f"{path}: the state dir holds a link where its folder belongs")
        return folder

    def _write(self, path: TinkerPath, payload: dict, overwrite: bool) -> None:
        folder = self._target(path)
        if folder.exists() and not overwrite:
            raise BadRequest(f"{path} exists already (save with overwrite=True to replace it)")
        work = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        torch.save(payload, work / CHECKPOINT_FILE)
        (work / "meta.json").write_text(json.dumps({"created": time.time(), "kind": path.kind}))
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)

    def _read(self, path: TinkerPath) -> dict:
        folder = self._find(path)
        file = folder / CHECKPOINT_FILE if folder is not None else None
        if file is None or file.is_symlink() or not file.is_file():
            raise NotFound(f"no checkpoint {path} in this server's state dir")
        try:
            payload = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - a damaged or foreign file: the request's fault, said in a line
            raise BadRequest(f"checkpoint {path} cannot be read ({type(error).__name__})") from None
        if not (isinstance(payload, dict) and isinstance(payload.get("rank"), int)
                and isinstance(payload.get("targets"), list) and isinstance(payload.get("adapter"), list)):
            raise BadRequest(f"checkpoint {path} is not one this server wrote")
        return payload

    def _payload(self, shape: Shape, adapter: list[torch.Tensor], run: Run | None) -> dict:
        payload: dict = {"format": 1, "base_model": MODEL_NAME, "rank": shape.rank, "targets": list(shape.targets),
                         "lora_alpha": LORA_ALPHA, "adapter": [a.clone() for a in adapter]}
        if run is not None and run.exp_avg is not None and run.exp_avg_sq is not None:
            payload["optimizer"] = {"steps": run.steps, "exp_avg": [m.clone() for m in run.exp_avg],
                                    "exp_avg_sq": [v.clone() for v in run.exp_avg_sq]}
        return payload

    def save_state(self, model_id: str, name: str, overwrite: bool) -> dict:
        run = self.run(model_id)
        path = TinkerPath(model_id, "weights", name)
        self._write(path, self._payload(run.shape, run.adapter, run), overwrite)
        return {"path": str(path), "type": "save_weights"}

    def load_state(self, model_id: str, path: TinkerPath, optimizer: bool) -> dict:
        """Make ``model_id`` a run holding the checkpoint's adapter (and Adam state if ``optimizer``)."""
        if path.kind != "weights":
            raise BadRequest(f"{path} is not a training checkpoint (save_state writes tinker://.../weights/...)")
        payload = self._read(path)
        shape = Shape(int(payload["rank"]), tuple(payload["targets"]))
        run = Run(model_id, shape, _master(payload["adapter"]))
        state = payload.get("optimizer")
        if optimizer and state is not None:
            run.steps = int(state["steps"])
            run.exp_avg = _master(state["exp_avg"])
            run.exp_avg_sq = _master(state["exp_avg_sq"])
        self._model(shape).load_adapter_state(run.adapter)  # refuses an adapter that does not fit
        self.runs[model_id] = run
        return {"path": str(path), "model_id": model_id, "type": "load_weights"}

    def save_for_sampler(self, model_id: str, *, name: str | None, sampler_id: str | None) -> dict:
        run = self.run(model_id)
        adapter = [a.clone() for a in run.adapter]
        if name is not None:
            path = TinkerPath(model_id, "sampler_weights", name)
            self._write(path, self._payload(run.shape, adapter, None), overwrite=True)
            self.samplers[str(path)] = SamplerVersion(str(path), run.shape, adapter, str(path))
            return {"path": str(path), "type": "save_weights_for_sampler"}
        assert sampler_id is not None
        self.samplers[sampler_id] = SamplerVersion(sampler_id, run.shape, adapter)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    def save_external(self, model_id: str, name: str) -> dict:
        """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) of the run's weights."""
        run = self.run(model_id)
        path = TinkerPath(model_id, "external_weights", name)
        folder = self._target(path)
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        self._bound(run.shape, run.adapter).save(folder)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        return {"path": str(path), "size_bytes": size, "type": "save_weights_external"}

    def external_files(self, path: TinkerPath) -> dict[str, str]:
        """``file://`` URLs of an exported folder's files: plain files inside the state dir only (links skipped)."""
        folder = self._find(path) if path.kind == "external_weights" else None
        if folder is None:
            raise NotFound(f"no external weights {path} in this server's state dir")
        return {str(f.relative_to(folder)): f.absolute().as_uri() for f in _files(folder)}

    def has_run(self, run_id: str) -> bool:
        """Whether ``run_id`` is a live training run here or a run folder of the state dir (an earlier server's)."""
        return run_id in self.runs or _entry(self.checkpoints, run_id) is not None

    def list_checkpoints(self, run_id: str) -> list[dict]:
        root = _entry(self.checkpoints, run_id)
        found = []
        labels = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
        for kind in KINDS:
            folder_of_kind = _entry(root, kind) if root is not None else None
            for folder in _folders(folder_of_kind) if folder_of_kind is not None else []:
                if folder.name.endswith((".tmp", ".importing")) or not NAME.fullmatch(folder.name):
                    continue  # a write or a copy under way, or no name this server gives
                size = sum(f.stat().st_size for f in _files(folder))
                found.append({"checkpoint_id": f"{kind}/{folder.name}", "checkpoint_type": labels[kind],
                              "time": folder.stat().st_mtime, "tinker_path": f"tinker://{run_id}/{kind}/{folder.name}",
                              "size_bytes": size})
        return found

    # --- sampling ---

    def create_sampler(self, sampler_id: str, *, model_path: str | None) -> dict:
        if model_path is None:
            self.samplers[sampler_id] = SamplerVersion(sampler_id, self.default_shape, [], None)
        else:
            path = TinkerPath.parse(model_path)
            known = self.samplers.get(str(path))
            if known is not None:
                self.samplers[sampler_id] = SamplerVersion(sampler_id, known.shape, known.adapter, str(path))
            else:
                if path.kind == "external_weights":
                    raise BadRequest(f"{path}: sample from sampler_weights or weights checkpoints")
                payload = self._read(path)
                shape = Shape(int(payload["rank"]), tuple(payload["targets"]))
                self.samplers[sampler_id] = SamplerVersion(sampler_id, shape, _master(payload["adapter"]), str(path))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def sampler_info(self, sampler_id: str) -> dict:
        version = self.samplers.get(sampler_id)
        if version is None:
            raise NotFound(f"no sampler {sampler_id!r} on this server")
        return {"sampler_id": sampler_id, "base_model": MODEL_NAME, "model_path": version.model_path}

    def _sampler(self, sampler_id: str) -> LocalSampler:
        if sampler_id in self._merged:
            self._merged.move_to_end(sampler_id)
            return self._merged[sampler_id]
        version = self.samplers.get(sampler_id)
        if version is None:
            raise NotFound(f"no sampler {sampler_id!r} on this server")
        while len(self._merged) >= self._max_samplers:
            self._merged.popitem(last=False)
        adapter = version.adapter or self._fresh_adapter(version.shape, 0)  # B = 0: the base model
        sampler = self._bound(version.shape, adapter).sampler(merge=self.dtype == "float32")
        self._merged[sampler_id] = sampler
        return sampler

    def sample(self, sampler_id: str, body: SampleBody) -> tuple[list[tuple[list[int], list[float], bool]],
                                                                 list[float] | None]:
        prompt = body.prompt.tokens()
        params = body.sampling_params
        max_tokens = params.max_tokens or min(DEFAULT_MAX_TOKENS, self.context_length - len(prompt))
        if not prompt:
            raise BadRequest("the prompt is empty")
        vocabulary = len(self._any_model().tokenizer)
        if min(prompt) < 0 or max(prompt) >= vocabulary:  # another model's ids (a --serve-as name)
            raise BadRequest(f"the prompt has token ids outside this server's vocabulary of {vocabulary} "
                             f"({MODEL_NAME}'s)")
        if len(prompt) + max_tokens > self.context_length:
            raise BadRequest(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the context length "
                             f"{self.context_length}")
        sampler = self._sampler(sampler_id)
        stop_ids, stop_strings = sampler.stop_ids, []
        if params.stop is not None:
            stop = [params.stop] if isinstance(params.stop, str) else list(params.stop)
            stop_ids = [s for s in stop if isinstance(s, int)]
            stop_strings = [s for s in stop if isinstance(s, str)]
        check = None
        if stop_strings:
            tokenizer = self._any_model().tokenizer

            def check(tokens: list[int]) -> bool:
                text = tokenizer.decode(tokens[-64:], skip_special_tokens=False)
                return any(s in text for s in stop_strings)

        seed = params.seed if params.seed is not None else random.randrange(2**63)
        generator = torch.Generator().manual_seed(seed)
        sequences = sampler.generate(prompt, num_samples=body.num_samples, max_new_tokens=max_tokens,
                                     temperature=params.temperature, stop_ids=stop_ids, generator=generator,
                                     stop_check=check)
        prompt_logprobs = None
        if body.prompt_logprobs:
            prompt_logprobs = [math.nan] + sampler.prompt_logprobs(prompt)
            if body.prompt_logprobs_last_n is not None:
                keep = body.prompt_logprobs_last_n
                prompt_logprobs = [math.nan] * (len(prompt) - keep) + prompt_logprobs[len(prompt) - keep:]
        return sequences, prompt_logprobs

    def _any_model(self) -> LocalModel:
        return next(iter(self._models.values())) if self._models else self._model(self.default_shape)


def resolve_dtype(dtype: str, device: str | None) -> DTypeName:
    """``auto``: bfloat16 where the model runs on CUDA, else float32."""
    if dtype != "auto":
        return dtype  # type: ignore[return-value]
    on_gpu = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    return "bfloat16" if on_gpu else "float32"


def lora_shape(rank: int, *, train_attn: bool, train_mlp: bool, train_unembed: bool) -> Shape:
    """The adapter a LoRA config asks for, or the reason the local server cannot train it."""
    if train_unembed:
        raise BadRequest("train_unembed=True is not supported by the local server (no LoRA on the tied "
                         "unembedding of this model): create the client with train_unembed=False")
    targets = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    if not targets:
        raise BadRequest("nothing to train: set train_attn or train_mlp")
    return Shape(rank, tuple(t for t in PROJECTIONS if t in targets))


def check_loss(request: FwdBwdRequest, context_length: int) -> None:
    """Refuse what the server cannot compute: an unknown loss, wrong or missing keys, lengths that differ."""
    if request.loss_fn not in LOSSES:
        raise BadRequest(f"loss_fn {request.loss_fn!r} is not supported by the local server; it has "
                         + ", ".join(sorted(LOSSES)))
    needed, defaults = LOSSES[request.loss_fn]
    required = REQUIRED_CONFIG.get(request.loss_fn, frozenset())
    takes = sorted(set(defaults) | required)
    unknown = set(request.config) - set(takes)
    if unknown:
        raise BadRequest(f"loss_fn_config keys {sorted(unknown)} are not taken by {request.loss_fn!r}"
                         + (f" (it takes {takes})" if takes else " (it takes none)"))
    missing_config = required - set(request.config)
    if missing_config:
        raise BadRequest(f"{request.loss_fn!r} needs loss_fn_config {sorted(missing_config)} (Tinker documents "
                         "no default for them)")
    for key, value in request.config.items():
        if isinstance(value, str) or not math.isfinite(value):
            raise BadRequest(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}")
    if request.loss_fn == "stable_reinforce":
        config = {**defaults, **cast("dict[str, float]", request.config)}  # numbers: checked above
        if not (config["ratio_cap"] > 0 and config["kl_coeff"] >= 0):
            raise BadRequest("stable_reinforce needs ratio_cap > 0 and kl_coeff >= 0")
    if not request.data:
        raise BadRequest("no data")
    optional = OPTIONAL_INPUTS.get(request.loss_fn, frozenset())
    for index, datum in enumerate(request.data):
        keys = set(datum.inputs)
        if not needed <= keys <= needed | optional:
            missing, extra = sorted(needed - keys), sorted(keys - needed - optional)
            raise BadRequest(f"datum {index}: {request.loss_fn!r} takes loss_fn_inputs {sorted(needed)}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        n = len(datum.tokens)
        if n == 0:
            raise BadRequest(f"datum {index}: empty model_input")
        if n > context_length:
            raise BadRequest(f"datum {index}: {n} tokens exceed the context length {context_length}")
        for key, values in datum.inputs.items():
            if len(values) != n:
                raise BadRequest(f"datum {index}: loss_fn_inputs[{key!r}] has {len(values)} values for {n} tokens")
        if request.loss_fn == "gspo" and not np.any(datum.inputs["sequence_ratio_mask"] != 0):
            raise BadRequest(f"datum {index}: sequence_ratio_mask marks no token (the sequence ratio is a mean over "
                             "the marked tokens)")


def _entry(folder: Path, name: str) -> Path | None:
    """``folder``'s entry ``name`` if it is a real folder (not a link): found by listing, never by joining."""
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name == name and entry.is_dir(follow_symlinks=False):
                    return Path(entry.path)
    except OSError:
        return None
    return None


def _folders(folder: Path) -> list[Path]:
    """The real folders (not links) in ``folder``, by name."""
    try:
        with os.scandir(folder) as entries:
            return sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _files(folder: Path) -> list[Path]:
    """The plain files under ``folder`` (links to files or folders are not followed), by path."""
    found = []
    for root, _, names in os.walk(folder, followlinks=False):
        found += [Path(root, n) for n in names if not os.path.islink(os.path.join(root, n))
                  and os.path.isfile(os.path.join(root, n))]
    return sorted(found)


def _master(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies: adapters and Adam moments are kept in fp32 whatever the compute dtype (checkpoints hold fp32,
    so one written by a server of either dtype loads into the other)."""
    return [t.to(torch.float32, copy=True) for t in tensors]


def _microbatches(data: list[Datum]) -> list[list[Datum]]:
    groups: list[list[Datum]] = [[]]
    tokens = 0
    for datum in data:
        if groups[-1] and tokens + len(datum.tokens) > TOKENS_PER_MICROBATCH:
            groups.append([])
            tokens = 0
        groups[-1].append(datum)
        tokens += len(datum.tokens)
    return groups


def _loss(name: str, logprobs: torch.Tensor, inputs: dict[str, np.ndarray], config: dict[str, float]) -> torch.Tensor:
    """Per-token loss terms of one datum (the request's loss is their sum over tokens and datums)."""
    device = logprobs.device

    def tensor(key: str) -> torch.Tensor:
        return torch.as_tensor(inputs[key].astype(np.float32), device=device)

    if name == "cross_entropy":
        return -logprobs * tensor("weights")
    advantages = tensor("advantages")
    if name == "stable_reinforce":
        # the local stand-in: REINFORCE with a truncated importance weight against the RECORDED sampler log-probs
        # q, plus a k3 estimate of KL(sampler || trainer), on targets a SampledProvenanceSpan covers (mask m):
        #   loss_t = m_t * (-sg(min(r_t, ratio_cap)) * A_t * logp_t + kl_coeff * ((r_t - 1) - log r_t)),
        #   r_t = exp(logp_t - q_t)
        if "sampled_mask" not in inputs:
            raise BadRequest("stable_reinforce needs the server's recorded stability info (StabilityStore.attach)")
        mask = torch.as_tensor(inputs["sampled_mask"].astype(np.float32), device=device)
        log_ratio = logprobs - tensor("recorded_logprobs")
        ratio = torch.exp(log_ratio)
        weight = ratio.detach().clamp(max=config["ratio_cap"])
        return mask * (-weight * logprobs * advantages + config["kl_coeff"] * ((ratio - 1) - log_ratio))
    sampler = tensor("logprobs")
    if name == "dro":
        # DRO: the policy gradient with a quadratic penalty on the log-ratio (Tinker docs, losses/dro)
        return -(logprobs * advantages - 0.5 * config["beta"] * (logprobs - sampler) ** 2)
    if name == "importance_sampling":
        return -torch.exp(logprobs - sampler) * advantages
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if name == "gspo":
        # GSPO-token (Tinker docs, losses/gspo): every token carries the sequence ratio's value (the geometric mean
        # of the ratios over the masked tokens) with the gradient of its own log-prob
        marked = tensor("sequence_ratio_mask") != 0
        sequence_log_ratio = (logprobs.detach() - sampler)[marked].mean()
        ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())
        return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    ratio = torch.exp(logprobs - sampler)
    if name == "ppo":
        return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    # cispo: a clipped, stopped-gradient ratio weighting the policy gradient
    return -ratio.detach().clamp(low, high) * logprobs * advantages
