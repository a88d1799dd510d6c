"""The policy: the base model, optionally a LoRA adapter (``peft``), and the fast forward over both."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aitrainsai_trainer_local.config import MAX_LORA_RANK
from aitrainsai_trainer_local.inner import check_adapter_config
from aitrainsai_trainer_local.llama import PROJECTIONS, FastLlama
from aitrainsai_trainer_local.model import BASE_MODEL, DType, default_device, load_base, resolve_dtype


MAX_ADAPTER_RANK = MAX_LORA_RANK  # a job's trainer.toml allows no more
MAX_ADAPTER_BYTES = 64 * 2**20  # rank 128 on every projection of this model is ~40 MB in fp32


def check_adapter(path: Path | str) -> None:
    """Refuse an adapter folder before loading it if its config sizes anything beyond what a job can produce (rank,
    rank and alpha patterns, alpha, target modules, options that add weights: :func:`check_adapter_config`) or its
    files are larger than such an adapter, so that a bad file cannot make the evaluation allocate without bound."""
    folder = Path(path)
    check_adapter_config(folder)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    if size > MAX_ADAPTER_BYTES:
        raise ValueError(f"the adapter is {size} bytes; at most {MAX_ADAPTER_BYTES} are expected")


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = PROJECTIONS


class LoraModel:
    """SmolLM2-135M-Instruct with an optional LoRA adapter, on the default device.

    Base weights are frozen and held by :attr:`fast` in the compute dtype (``dtype="auto"``: bf16 where the hardware
    is fast at it); LoRA factors stay fp32 ``peft`` parameters, trained through :attr:`fast`.
    """

    base_model = BASE_MODEL

    def __init__(self, model: torch.nn.Module, tokenizer, dtype: torch.dtype):
        self.model: Any = model  # a transformers model, or a peft model wrapping it (reached by attribute)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.fast = FastLlama.from_model(model, dtype)

    @classmethod
    def load(cls, *, adapter: Path | str | None = None, lora: LoraSettings | None = None, trainable: bool = False,
             dtype: DType = "auto", device: torch.device | str | None = None, seed: int = 0,
             cache_dir: Path | None = None) -> LoraModel:
        """The base model; with ``adapter``, the saved adapter on top (trainable if ``trainable``); with ``lora``
        instead, a fresh trainable adapter (A seeded by ``seed``, B zero, so it starts as the base model)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter is not None and lora is not None:
            raise ValueError("give an adapter to load or LoRA settings for a new one, not both")
        if adapter is not None:
            check_adapter(adapter)
        device = torch.device(device) if device is not None else default_device()
        model, tokenizer = load_base(device, cache_dir)
        with warnings.catch_warnings():
            # peft calls a transformers method that transformers 5 deprecates; nothing to act on here
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
            elif lora is not None:
                config = LoraConfig(r=lora.rank,
                                    lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft says int; scaling = alpha / r
                                    target_modules=list(lora.target_modules), lora_dropout=0.0, bias="none")
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seed)
                    model = get_peft_model(model, config)
        return cls(model, tokenizer, resolve_dtype(dtype, device))

    @property
    def device(self) -> torch.device:
        return self.fast.device

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def save_adapter(self, path: Path | str) -> Path:
        """Write the LoRA adapter with ``peft``'s ``save_pretrained``; :meth:`load` with ``adapter=path`` reads it. The
        same adapter is the same bytes: its config is rewritten with sorted keys and lists (peft writes its module
        set in the process's hash order)."""
        import json

        if not hasattr(self.model, "peft_config"):
            raise ValueError("this policy has no adapter to save")
        for config in self.model.peft_config.values():
            config.base_model_name_or_path = BASE_MODEL
        self.model.save_pretrained(str(path), save_embedding_layers=False)
        written = Path(path) / "adapter_config.json"
        config = json.loads(written.read_text())
        config = {key: sorted(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value
                  for key, value in config.items()}
        written.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return Path(path)

    def inference_model(self) -> FastLlama:
        """The forward with LoRA merged into the weights: build it once per policy update, use it for sampling."""
        return self.fast.merged()

    @property
    def stop_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, Sequence):
            ids.update(configured)
        return sorted(i for i in ids if i is not None)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id
