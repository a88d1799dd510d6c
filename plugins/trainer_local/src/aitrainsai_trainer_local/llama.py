"""A lean forward pass of a Llama-architecture model with LoRA, for fast generation and training on CPU.

On CPU, generation pays for every small operation and every pass over the weights, and training for matmul FLOPs,
so this forward differs from ``transformers`` + ``peft`` in ways that cut both: the q/k/v and gate/up projections
are fused into one matmul each (and so are their LoRA factors), base weights are held once in the compute dtype
(bf16 where the hardware is fast at it) instead of being cast on every call, attention is plain batched matmuls (the
CPU flash-attention backward is slow in bf16), and the vocabulary projection runs only where a caller needs logits.
Generation uses a copy of the weights with LoRA merged in. The weights stay those of the ``transformers`` model and
the LoRA factors those of the ``peft`` modules (shared tensors), so ``peft`` saves and loads the adapter as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import torch
import torch.nn.functional as F

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


MAX_CACHE_BYTES = 4 * 2**30  # the most a step's key/value cache may hold (SmolLM2 in bfloat16: 23 KB a token and row)
# the most a step's forward passes may hold beside the cache: a training forward's activations kept for the backward
# pass, an inference forward's attention scores (the default job's training: about 6 GB)
MAX_ACTIVATION_BYTES = 10 * 2**30
# a decode step's pairs past a row's first FAR_SLOTS cache slots are counted again (work.Rates.decode_far): bfloat16's
# decodes over a 4,700-slot cache took twice a short cache's time a pair (review fourteen's many-turn rollouts)
FAR_SLOTS = 2_048
# Bytes kept for the backward pass, measured (peak resident memory, SmolLM2 on CPU, shapes from 700 to 3,400 positions
# and 0.2 to 5.8 million pairs; these bound every measure, within 20% of the largest): per position, layer and unit of
# hidden + intermediate width, in elements of the compute dtype; per attention pair, layer and head, in bytes (scores
# materialised: float32 probabilities and their cast; the fused kernel keeps about none, the mask a little)
KEPT_ELEMENTS_PER_POSITION = 11
KEPT_BYTES_PER_PAIR = {True: 1, False: 7}  # by whether the attention kernel is fused
# an inference forward's transients, one layer at a time: float32 scores, masked, softmaxed, cast (bytes a pair and
# head), beside the float32 mask every forward but a fused first chunk builds (bytes a pair), and the layer's norms and
# MLP (elements of the compute dtype a position and unit of hidden + intermediate width: review twelve measured about
# 2.7 on 1,024 rows of 100 tokens)
SCORE_BYTES_PER_PAIR = {True: 0, False: 14}
MASK_BYTES_PER_PAIR = 4
TRANSIENT_ELEMENTS_PER_POSITION = 5


class TooLarge(RuntimeError):
    """A step would need more of the trainer's memory than its bound: the job's rows and settings decide it, and it
    is refused before the memory is taken."""


class CacheTooLarge(TooLarge):
    """A step's rollouts would need a key/value cache over :data:`MAX_CACHE_BYTES`."""


class ActivationsTooLarge(TooLarge):
    """A step's forward passes would hold activations over :data:`MAX_ACTIVATION_BYTES`."""


def _gb(size: int) -> str:
    return f"{size / 2**30:.{1 if size >= 2**30 else 2}f} GB"


@dataclass
class FusedLinear:
    """Several linear maps of the same input, stacked along the output: one matmul, and one pair for their LoRA."""

    weight: torch.Tensor  # [sum(parts), in], frozen, compute dtype
    parts: tuple[int, ...]  # output size of each stacked projection
    lora_a: list[torch.Tensor | None] = field(default_factory=list)  # per part: [r, in] or None
    lora_b: list[torch.Tensor | None] = field(default_factory=list)  # per part: [out, r] or None
    scaling: float = 1.0
    fixed: tuple[torch.Tensor, torch.Tensor] | None = None  # frozen copies: the stacked factors, built once

    @property
    def has_lora(self) -> bool:
        return any(a is not None for a in self.lora_a)

    def lora_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A stacked ``[k·r, in]`` and block-diagonal B ``[sum(parts), k·r]`` (zero rows where a part has no LoRA)."""
        a = torch.cat([t for t in self.lora_a if t is not None]).to(dtype)
        blocks = []
        for size, b in zip(self.parts, self.lora_b):
            blocks.append(b if b is not None else torch.zeros(size, 0, dtype=a.dtype, device=a.device))
        return a, torch.block_diag(*[block.to(dtype) for block in blocks])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.has_lora:
            a, b = self.fixed if self.fixed is not None else self.lora_factors(x.dtype)
            y = y + F.linear(F.linear(x, a), b) * self.scaling
        return y

    def merged(self) -> FusedLinear:
        """The same map with LoRA folded into a new weight (one ``addmm`` in the weight's dtype)."""
        if not self.has_lora:
            return self
        with torch.no_grad():
            a, b = self.lora_factors(self.weight.dtype)
            weight = torch.addmm(self.weight, b, a, alpha=self.scaling)
        return FusedLinear(weight, self.parts, [None] * len(self.parts), [None] * len(self.parts))

    def frozen(self, dtype: torch.dtype) -> FusedLinear:
        """The same map with LoRA kept apart, its factors copied, stacked and cast to ``dtype`` once: the numerics
        of the training forward (in bf16, folding LoRA into the weight rounds it away), fixed at this version."""
        if not self.has_lora:
            return self
        with torch.no_grad():
            a, b = (t.clone() for t in self.lora_factors(dtype))
        return FusedLinear(self.weight, (sum(self.parts),), [a], [b], self.scaling, fixed=(a, b))


@dataclass
class Block:
    input_norm: torch.Tensor
    qkv: FusedLinear
    o: FusedLinear
    post_norm: torch.Tensor
    gate_up: FusedLinear
    down: FusedLinear


class KVCache:
    """Keys and values of every layer for a batch of rows, with a validity mask over cache slots.

    Slots are shared by all rows; a row's padding occupies slots marked invalid, so rows of different lengths (and
    padding in the middle, when new chunks are left-padded) attend only to their own real tokens. Each row keeps its
    own next position for RoPE. With ``inplace`` (inference) new slots are written into preallocated buffers; without
    it (training) they are concatenated, which autograd can differentiate through.
    """

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, inplace: bool, counts: Any = None):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device, self.inplace = dtype, device, inplace
        self.counts = counts  # whose ``copied`` counts the bytes this cache copies (its model's), if any
        self.keys: list[torch.Tensor] = [self._empty(batch, 0) for _ in range(n_layers)]
        self.values: list[torch.Tensor] = [self._empty(batch, 0) for _ in range(n_layers)]
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0  # slots in use
        self.kept = 0  # bytes the forwards through this cache keep for a backward pass (estimated: see forward)

    def _empty(self, batch: int, slots: int) -> torch.Tensor:
        return torch.empty(batch, self.kv_heads, slots, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def size(self, batch: int, slots: int) -> int:
        """Bytes of keys and values, every layer, for ``batch`` rows of ``slots`` slots."""
        return 2 * self.n_layers * batch * slots * self.kv_heads * self.head_dim * self.keys[0].element_size()

    def _copying(self, batch: int, slots: int) -> int:
        """A copy into a cache of ``batch`` rows and ``slots`` slots is about to be made: counted, and refused over
        :data:`MAX_CACHE_BYTES` (a job's rows and prompts decide the size; the trainer's memory is not theirs)."""
        size = self.size(batch, slots)
        if size > MAX_CACHE_BYTES:
            raise CacheTooLarge(f"its rollouts need a cache of {_gb(size)} ({batch} rows of {slots} tokens), over "
                                f"the trainer's {_gb(MAX_CACHE_BYTES)}")
        if self.counts is not None:
            self.counts.copied += size
        return size

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` more slots without reallocating (inference only)."""
        spare = self.keys[0].shape[2] - self.length
        if self.inplace and spare < slots:
            self._copying(self.batch, self.keys[0].shape[2] + slots - spare)
            extra = self._empty(self.batch, slots - spare)
            self.keys = [torch.cat([k, extra], 2) for k in self.keys]
            self.values = [torch.cat([v, extra], 2) for v in self.values]

    def begin_chunk(self, chunk_valid: torch.Tensor, *, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Open ``T`` new slots for a chunk; returns the RoPE positions ``[N, T]``, the additive float32 attention
        mask ``[N, 1, T, S+T]`` (a slot is visible if it is valid and not after the query's slot) and whether the
        mask is plain causal. For a ``fused`` attention kernel no mask is built where every slot is valid: ``None``
        with ``causal`` for a first chunk, ``None`` alone for one token after the cache (it sees every slot)."""
        width = chunk_valid.shape[1]
        if self.inplace:
            self.reserve(width)
        else:  # each layer's keys and values concatenated with the chunk's: the cache copied once
            self._copying(self.batch, self.length + width)
        positions = self.next_position[:, None] + chunk_valid.long().cumsum(1) - 1
        positions = positions.clamp_min(0)
        self.next_position = self.next_position + chunk_valid.long().sum(1)
        self.valid = torch.cat([self.valid, chunk_valid], 1)
        if fused and (width == 1 or self.length == 0) and bool(self.valid.all()):
            return positions, None, width > 1
        total = self.length + width
        causal = torch.ones(width, total, dtype=torch.bool, device=self.device).tril(self.length)
        visible = self.valid[:, None, :] & causal[None]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(torch.float32).min)
        return positions, mask[:, None], False

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a chunk's keys/values ``[N, KV, T, D]`` for ``layer``; returns all of them up to the chunk's end."""
        width = key.shape[2]
        if self.inplace:
            self.keys[layer][:, :, self.length:self.length + width] = key
            self.values[layer][:, :, self.length:self.length + width] = value
            end = self.length + width
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        self.keys[layer] = torch.cat([self.keys[layer], key], 2)
        self.values[layer] = torch.cat([self.values[layer], value], 2)
        return self.keys[layer], self.values[layer]

    def end_chunk(self, width: int) -> None:
        self.length += width

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) rows: ``rows`` indexes the current batch."""
        size = self._copying(len(rows), self.keys[0].shape[2])
        if not self.inplace and torch.is_grad_enabled():  # held until each layer's next concatenation replaces it
            self.kept += size
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)


class FastLlama:
    """The forward pass over fused weights taken from a ``transformers`` Llama model (``peft``-wrapped or not)."""

    # None: the fused kernel in float32 only (see forward); a benchmark may force it
    fused_attention: bool | None = None

    def __init__(self, embed: torch.Tensor, blocks: list[Block], norm: torch.Tensor, lm_head: torch.Tensor,
                 rotary: torch.nn.Module, *, heads: int, kv_heads: int, head_dim: int, eps: float):
        self.embed, self.blocks, self.norm, self.lm_head, self.rotary = embed, blocks, norm, lm_head, rotary
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.positions = 0  # token positions run through the blocks so far (padding included), for FLOP counts
        self.logit_rows = 0  # hidden states projected to the vocabulary by logits()
        self.attended = 0  # (query position, cache slot) pairs through attention (padding included), per layer
        self.forwards = 0  # calls of forward(): each pays the blocks' fixed cost (a decode step's ~1,200 operations)
        self.decode_attended = 0  # the pairs of one-token chunks (decode steps): read from the cache, not computed
        self.decode_far = 0  # of those, the pairs past a row's first FAR_SLOTS slots (a long cache reads slower)
        self.copied = 0  # bytes its caches copied (rows repeated for a group, room made for a turn)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> FastLlama:
        """Fuse the weights of a ``LlamaForCausalLM`` (optionally wrapped by ``peft``); LoRA factors are shared, not
        copied, so training them through this forward trains the ``peft`` adapter."""
        # transformers' and peft's submodules are reached by name: typed Any (``nn.Module.__getattr__`` says
        # ``Tensor | Module``)
        causal_lm: Any = _unwrap_peft(model)
        config = causal_lm.config
        _check_supported(config)
        inner = causal_lm.model

        def weight(module: Any) -> torch.Tensor:
            base = getattr(module, "base_layer", module)
            return base.weight.detach()

        def lora(module: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None]:
            if not hasattr(module, "lora_A") or not module.active_adapters:
                return None, None, None
            name = module.active_adapters[0]
            if name not in module.lora_A:
                return None, None, None
            return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]

        def fuse(modules: list[torch.nn.Module]) -> FusedLinear:
            stacked = torch.cat([weight(m) for m in modules]).to(dtype).contiguous()
            factors = [lora(m) for m in modules]
            scalings = {s for _, _, s in factors if s is not None}
            if len(scalings) > 1:
                raise ValueError("fused projections need one LoRA scaling")
            return FusedLinear(stacked, tuple(weight(m).shape[0] for m in modules), [a for a, _, _ in factors],
                               [b for _, b, _ in factors], scalings.pop() if scalings else 1.0)

        blocks = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            blocks.append(Block(
                input_norm=layer.input_layernorm.weight.detach().to(dtype),
                qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                o=fuse([attn.o_proj]),
                post_norm=layer.post_attention_layernorm.weight.detach().to(dtype),
                gate_up=fuse([mlp.gate_proj, mlp.up_proj]),
                down=fuse([mlp.down_proj]),
            ))
        embed = inner.embed_tokens.weight.detach().to(dtype)
        head = weight(causal_lm.lm_head)
        lm_head = embed if head.data_ptr() == inner.embed_tokens.weight.data_ptr() else head.to(dtype)
        return cls(embed, blocks, inner.norm.weight.detach().to(dtype), lm_head, inner.rotary_emb,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   eps=config.rms_norm_eps)

    def merged(self) -> FastLlama:
        """A copy for inference with every LoRA folded into its weight (embeddings and norms shared)."""
        blocks = [Block(b.input_norm, b.qkv.merged(), b.o.merged(), b.post_norm, b.gate_up.merged(), b.down.merged())
                  for b in self.blocks]
        return FastLlama(self.embed, blocks, self.norm, self.lm_head, self.rotary, heads=self.heads,
                         kv_heads=self.kv_heads, head_dim=self.head_dim, eps=self.eps)

    def frozen(self) -> FastLlama:
        """A copy for inference with every LoRA copied and kept unmerged (:meth:`FusedLinear.frozen`)."""
        blocks = [Block(b.input_norm, b.qkv.frozen(self.dtype), b.o.frozen(self.dtype), b.post_norm,
                        b.gate_up.frozen(self.dtype), b.down.frozen(self.dtype)) for b in self.blocks]
        return FastLlama(self.embed, blocks, self.norm, self.lm_head, self.rotary, heads=self.heads,
                         kv_heads=self.kv_heads, head_dim=self.head_dim, eps=self.eps)

    def new_cache(self, batch: int, inplace: bool) -> KVCache:
        return KVCache(len(self.blocks), batch, self.kv_heads, self.head_dim, self.dtype, self.device, inplace,
                       counts=self)

    def prefill(self, sequences: Sequence[Sequence[int]], pad_id: int, inplace: bool,
                min_shared: int = 8) -> tuple[KVCache, torch.Tensor]:
        """Run distinct token sequences from an empty cache; returns the cache (one row per sequence) and the hidden
        state at each sequence's last token ``[N, hidden]``. A prefix common to all of them (a shared system prompt)
        runs once, when it is at least ``min_shared`` tokens long."""
        shared = _common_prefix(sequences) if len(sequences) > 1 else 0
        shared = min(shared, min(len(s) for s in sequences) - 1)
        if shared >= min_shared:
            cache = self.new_cache(1, inplace)
            prefix = torch.tensor([list(sequences[0][:shared])], dtype=torch.long, device=self.device)
            self.forward(prefix, torch.ones_like(prefix, dtype=torch.bool), cache)
            cache.select(torch.zeros(len(sequences), dtype=torch.long, device=self.device))
            sequences = [s[shared:] for s in sequences]
        else:
            cache = self.new_cache(len(sequences), inplace)
        ids, valid = left_pad(sequences, pad_id, self.device)
        return cache, self.forward(ids, valid, cache)[:, -1]

    def forward(self, input_ids: torch.Tensor, chunk_valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run a chunk ``[N, T]`` of tokens after what ``cache`` holds; returns final-normed hidden states
        ``[N, T, hidden]``. ``chunk_valid`` marks real tokens; the others are padding that nothing attends to."""
        # float32: the fused attention kernel (4.6x faster on a 3,500-token prefill on 2 CPUs); bfloat16: scores
        # materialised, so that a one-token decode rounds as the training forward does (the fused kernel's
        # blocking differs with the query length: log-probs ~0.05 apart)
        fused = self.dtype == torch.float32 if self.fused_attention is None else self.fused_attention
        n, width = input_ids.shape
        self._check_activations(cache, n, width, fused)
        positions, mask, causal = cache.begin_chunk(chunk_valid, fused=fused)
        self.forwards += 1
        self.positions += n * width
        self.attended += n * width * (cache.length + width)
        if width == 1:
            self.decode_attended += n * (cache.length + 1)
            self.decode_far += n * max(0, cache.length + 1 - FAR_SLOTS)
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, positions)  # [N, T, D]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, block in enumerate(self.blocks):
            h = _rms_norm(x, block.input_norm, self.eps)
            qkv = block.qkv(h)
            qk = qkv[..., :q_size + kv_size].view(n, width, heads + kv_heads, head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :, :heads].transpose(1, 2)
            k = qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., q_size + kv_size:].view(n, width, kv_heads, head_dim).transpose(1, 2)
            keys, values = cache.update(index, k, v)
            if fused:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=True).transpose(1, 2).reshape(n, width, q_size)
            else:
                assert mask is not None  # built whenever the kernel is not fused
                attn = _attention(q, keys, values, mask, kv_heads, group)
            x = x + block.o(attn)
            h = _rms_norm(x, block.post_norm, self.eps)
            gate, up = block.gate_up(h).chunk(2, -1)
            x = x + block.down(F.silu(gate) * up)
        cache.end_chunk(width)
        return _rms_norm(x, self.norm, self.eps)

    @property
    def position_width(self) -> int:
        """Hidden plus intermediate width: what a token position's activations scale with, in a layer."""
        return self.embed.shape[1] + self.blocks[0].down.weight.shape[1]

    def _check_activations(self, cache: KVCache, rows: int, width: int, fused: bool) -> None:
        """Refuse a forward of ``rows`` × ``width`` positions after ``cache`` whose activations would pass
        :data:`MAX_ACTIVATION_BYTES`: with a graph, what it and the earlier forwards through the cache keep for the
        backward pass (every layer's); without, one layer's attention scores. Sizes from the shapes alone, before
        anything is allocated (a job's prompts and groups decide them; the trainer's memory is not theirs)."""
        pairs = rows * width * (cache.length + width)
        width_units = self.position_width * self.embed.element_size()
        training = torch.is_grad_enabled()
        if training:  # the keys and values concatenated for the chunk are kept too
            size = cache.kept + cache.size(rows, cache.length + width) + len(self.blocks) * (
                rows * width * KEPT_ELEMENTS_PER_POSITION * width_units
                + pairs * self.heads * KEPT_BYTES_PER_PAIR[fused])
            cache.kept = size
        else:
            size = (pairs * (self.heads * SCORE_BYTES_PER_PAIR[fused] + MASK_BYTES_PER_PAIR)
                    + rows * width * TRANSIENT_ELEMENTS_PER_POSITION * width_units)
        if size > MAX_ACTIVATION_BYTES:
            kind = "training keeps" if training else "its attention scores need"
            raise ActivationsTooLarge(
                f"{kind} {_gb(size)} of activations ({rows} rows of {width} tokens after {cache.length}), over the "
                f"trainer's {_gb(MAX_ACTIVATION_BYTES)}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for hidden states ``[..., hidden]``."""
        self.logit_rows += hidden.numel() // hidden.shape[-1]
        return linear(hidden, self.lm_head).float()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weightᵀ`` for a frozen weight. On the CPU in bf16 it goes through oneDNN with the weight packed once into
    its blocked layout (kept on the tensor; its transpose too, for the input's gradient): bit-identical to
    ``F.linear`` and its backward (checked in the tests), and faster, most where few rows meet a large weight (a
    decode step: the unpacked call reorders the weight every time)."""
    if not _packs(x, weight):
        return F.linear(x, weight)
    if x.requires_grad:
        return _PackedLinear.apply(x, weight)
    return _packed_linear(x, weight, "_packed")


def _packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` packs: this torch has oneDNN's packed linear, the CPU, bf16 on both sides, a frozen 2-D
    weight."""
    return (_REORDER is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16 and weight.dim() == 2 and not weight.requires_grad)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """``x @ weightᵀ`` (``name`` ``_packed``) or ``x @ weight`` (``_packed_t``) through oneDNN, with ``weight`` in its
    layout, packed on first use and kept on the tensor (it lives as long as the weight; a merged copy gets its own)."""
    x = x.contiguous()
    packed = getattr(weight, name, None)
    if packed is None:
        plain = weight if name == "_packed" else weight.t()
        rows = max(1, x.numel() // x.shape[-1])  # a size hint only: the result does not depend on it
        packed = _REORDER(plain.contiguous(), rows)
        setattr(weight, name, packed)
    return _LINEAR(x, packed, None, "none", [], "")


def _input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ weight``: the input's gradient of ``linear(x, weight)`` (packed where :func:`linear` packs)."""
    return _packed_linear(grad, weight, "_packed_t") if _packs(grad, weight) else grad @ weight


class _PackedLinear(torch.autograd.Function):
    """:func:`linear` with a gradient for the input (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return _packed_linear(x, weight, "_packed")

    @staticmethod
    def backward(ctx, grad_out):
        return _input_grad(grad_out, ctx.weight), None


def _packed_linear_ops():
    try:
        reorder, apply = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        probe = torch.ones(2, 2, dtype=torch.bfloat16)
        apply(probe, reorder(probe, 2), None, "none", [], "")
        return reorder, apply
    except (AttributeError, RuntimeError):  # a torch built without oneDNN, or a CPU it does not support in bf16
        return None, None


_REORDER, _LINEAR = _packed_linear_ops()


def selected_logprobs(hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      chunk: int = 256) -> torch.Tensor:
    """``log softmax(hidden @ lm_headᵀ / temperature)[target]`` for rows of ``hidden`` ``[M, H]``, in chunks, without
    keeping ``[M, vocab]`` logits for the backward pass (it recomputes them); ``lm_head`` gets no gradient."""
    if temperature != 1.0:
        hidden = hidden / temperature
    return _SelectedLogprobs.apply(hidden, lm_head, targets, int(chunk))


KEPT_LOGITS_BYTES = 256 * 2**20  # fp32 logits up to this size are kept for the backward instead of recomputed


def logit_passes(rows: int, vocab: int) -> int:
    """How often :func:`selected_logprobs` projects ``rows`` hidden states to the vocabulary in a forward and backward
    pass: once where their logits are kept, twice where the backward recomputes them (work counts it)."""
    return 1 if rows * vocab * 4 <= KEPT_LOGITS_BYTES else 2


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        keep = logit_passes(hidden.shape[0], weight.shape[0]) == 1
        kept = []
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            logits = linear(hidden[start:end], weight).float()
            lse[start:end] = torch.logsumexp(logits, -1)
            out[start:end] = logits.gather(1, targets[start:end, None])[:, 0] - lse[start:end]
            if keep:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.kept = kept or None  # the same numbers a recomputation gives; used once (the backward works in place)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        grad_hidden = torch.empty_like(hidden)
        for index, start in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            end = start + ctx.chunk
            # d logp[target] / d logits = onehot(target) - softmax
            logits = kept[index] if kept is not None else linear(hidden[start:end], weight).float()
            grad_logits = logits.sub_(lse[start:end, None]).exp_().neg_()
            grad_logits.scatter_add_(1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_(grad_out[start:end, None])
            grad_hidden[start:end] = _input_grad(grad_logits.to(weight.dtype), weight)
        return grad_hidden, None, None, None


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[N, T]`` padded on the left, and the mask of real tokens."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, tokens in enumerate(sequences):
        if tokens:
            ids[i, width - len(tokens):] = torch.as_tensor(list(tokens), dtype=torch.long)
            valid[i, width - len(tokens):] = True
    return ids.to(device), valid.to(device)


def _common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    length = min(len(s) for s in sequences)
    for s in sequences[1:]:
        n = 0
        while n < length and s[n] == first[n]:
            n += 1
        length = n
    return length


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale.
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, kv_heads: int,
               group: int) -> torch.Tensor:
    """Grouped-query attention with the scores materialised and softmaxed in float32: ``q`` ``[N, H, T, D]``, keys
    and values ``[N, KV, S, D]``, ``mask`` ``[N, 1, T, S]``; returns ``[N, T, H * D]``."""
    n, _, width, head_dim = q.shape
    q = q.reshape(n, kv_heads, group * width, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * head_dim ** -0.5
    scores = scores.view(n, kv_heads, group, width, -1) + mask[:, :, None]
    probs = torch.softmax(scores, -1).to(values.dtype).view(n, kv_heads, group * width, -1)
    attn = torch.matmul(probs, values).view(n, kv_heads, group, width, head_dim)
    return attn.permute(0, 3, 1, 2, 4).reshape(n, width, kv_heads * group * head_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def _check_supported(config) -> None:
    problems = []
    if getattr(config, "model_type", None) not in ("llama",):
        problems.append(f"model_type {getattr(config, 'model_type', None)!r} (only 'llama')")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases in attention or MLP")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r}")
    if problems:
        raise NotImplementedError("the fast forward supports plain Llama models; this one has " + ", ".join(problems))
