"""The one renderer of the tinker trainer: the core's ChatML with Hermes tool calls (:mod:`aitrainsai.chat`).

That is Qwen3's instruct format (``Qwen/Qwen3-*-Instruct-2507``: tool schemas as JSON lines in ``<tools>`` in the
system turn, calls as ``<tool_call>`` JSON, results as ``<tool_response>`` blocks in a user turn, no default system
message) and SmolLM2's, which the local server serves (the same format with SmolLM2's default system message). Base
models with another chat format (Qwen3.5's XML calls, Llama, the thinking Qwen3 models whose history drops
``<think>`` blocks) are refused at start rather than rendered wrongly.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from aitrainsai.chat import ChatML, ChatTokens

LOCAL_BASE_MODEL = "SmolLM2-135M-Instruct"
"""The local server's model (``aitrainsai_trainer_local.runtime.BASE_MODEL``)."""

QWEN3_INSTRUCT = ChatML()
"""Qwen3 instruct's template as the core renders it: ChatML, no default system message."""


def chat_format(base_model: str) -> ChatML | None:
    """The chat format of ``base_model`` for remote models (the local model's comes with its tokenizer); None where
    it is not the core's ChatML/Hermes format."""
    name = base_model.rsplit("/", 1)[-1]
    if name.startswith("Qwen3-") and "Instruct" in name:
        return QWEN3_INSTRUCT
    return None


SUPPORTED = "Qwen3 instruct models (Qwen/Qwen3-*-Instruct-*) and the local server's " + LOCAL_BASE_MODEL


@lru_cache(maxsize=1)
def local_chat() -> ChatTokens:
    """The local model's tokenizer and chat format, from the local trainer's public runtime (no weights loaded)."""
    try:
        from aitrainsai_trainer_local.runtime import load_chat
    except ImportError as exc:
        raise RuntimeError(f"the local model needs aitrainsai-trainer-local (pip install "
                           f"'aitrainsai-outer-tinker[local]'): {exc}") from None
    return load_chat()


def chat_tokens(base_model: str, tokenizer: Any) -> ChatTokens:
    """``base_model``'s chat format with ``tokenizer`` (a Hugging Face tokenizer from the training client)."""
    template = chat_format(base_model)
    if template is None:
        raise ValueError(f"no chat format known for base model {base_model!r}; supported: {SUPPORTED}")
    return ChatTokens(tokenizer, template)


def stop_tokens(chat: ChatTokens) -> list[int]:
    """The tokens that end a reply: the end of turn (and the tokenizer's end of sequence, where it differs)."""
    stops = [chat.end_of_turn_id] if chat.end_of_turn_id is not None else []
    eos = getattr(chat.tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in stops:
        stops.append(eos)
    if not stops:
        raise ValueError("the tokenizer has no single end-of-turn token to stop sampling on")
    return stops
