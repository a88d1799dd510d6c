"""Reading what crosses the trust boundary: capped, linear, never recursive, one typed error.

Trusted code reads what workers send (transcripts, scores, training files, adapters), what the agent sends (tool-call
arguments) and what a job wrote with these helpers. Each caps its input before it reads it, takes time linear in it
(no regular expression that backtracks, no recursion on the input's structure, so never a ``RecursionError``), and
refuses bad input with :class:`UntrustedInputError`: a ``ValueError`` whose message is one line naming the input and
saying what is wrong with it, for the caller to show (to the agent as ``error: ...``) or record (a dead job's reason).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Collection
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from aitrainsai.errors import AitrainsaiError

MAX_DEPTH = 32
"""How deep JSON from outside may nest (a transcript file needs 6 levels, tool arguments 3)."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # in JSON text: a "\udXXX" escape may decode to a lone one
# A JSON string; an unterminated one runs to the end, so that a match never fails (and never backtracks).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?(?:"|\Z)', re.S)
_ONE_KIND = bytes.maketrans(b"{}", b"[]")  # depth is all the check needs: json.loads finds a mismatch
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NONFINITE = "a number that is not finite (NaN, Infinity, or beyond a double's range)"


class UntrustedInputError(ValueError, AitrainsaiError):
    """Input from beyond the trust boundary that trusted code refuses. ``what`` names the input; ``reason`` says what
    is wrong, worded to follow "are" ("not valid JSON (...)"); the message is ``"{what}: {reason}"``."""

    def __init__(self, what: str, reason: str):
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.what, self.reason)


def load_json(data: str | bytes, *, what: str, max_bytes: int, max_depth: int = MAX_DEPTH,
              finite: bool = True) -> Any:
    """``data`` parsed as JSON. Refused unless it is at most ``max_bytes`` long (characters, for text), UTF-8 with no
    lone surrogate (raw or escaped), nested at most ``max_depth`` deep (checked before parsing, without recursion),
    and, with ``finite``, free of NaN, Infinity and numbers beyond a double's range."""
    if isinstance(data, (bytes, bytearray)):
        if len(data) > max_bytes:
            raise UntrustedInputError(what, f"larger than {max_bytes} bytes")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UntrustedInputError(what, f"not UTF-8 text (byte {exc.start} is not)") from None
    elif isinstance(data, str):
        if len(data) > max_bytes:
            raise UntrustedInputError(what, f"longer than {max_bytes} characters")
        text = data
        _refuse_surrogates(text, what)
    else:
        raise UntrustedInputError(what, f"a {type(data).__name__}, not JSON text")
    _check_depth(text, what, max_depth)
    try:
        value = json.loads(text, parse_float=_finite_float(what) if finite else float,
                           parse_constant=_refuse_constant(what) if finite else None)
    except UntrustedInputError:
        raise
    except RecursionError:  # unreachable below MAX_DEPTH; kept so that no caller ever sees one
        raise UntrustedInputError(what, "nested too deeply to parse") from None
    except ValueError as exc:
        where = f", line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise UntrustedInputError(what, f"not valid JSON ({getattr(exc, 'msg', exc)}{where})") from None
    if _ESCAPED_SURROGATE.search(text):
        check_value(value, what=what, max_depth=max_depth, finite=finite)
    return value


def read_json(path: Path | str, *, max_bytes: int, what: str | None = None, max_depth: int = MAX_DEPTH,
              finite: bool = True) -> Any:
    """The JSON file at ``path``, read as :func:`load_json`: a regular file (a link is refused, never followed) of at
    most ``max_bytes`` bytes, of which no more than that is read."""
    path = Path(path)
    what = what or path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UntrustedInputError(what, "a link" if os.path.islink(path) else f"unreadable ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UntrustedInputError(what, "not a regular file")
        data = handle.read(max_bytes + 1)
    return load_json(data, what=what, max_bytes=max_bytes, max_depth=max_depth, finite=finite)


M = TypeVar("M", bound=BaseModel)


class SpecError(ValueError, AitrainsaiError):
    """A file one side wrote for another (a worker's ``job.json``) cannot be read as its model; the message is one
    line: the file, what it should be, and the first problem with where it is."""


def read_spec(path: Path | str, model: type[M], what: str) -> M:
    """``path`` validated as ``model`` (``what`` names it in the message), or a :class:`SpecError`."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path.name} cannot be read: {exc.strerror or exc}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        message = " ".join(error["msg"].split())
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise SpecError(f"{path.name} is not {what}: {where + ': ' if where else ''}{message}{more}") from None


def check_value(value: Any, *, what: str, max_depth: int = MAX_DEPTH, finite: bool = True) -> None:
    """Refuse a decoded JSON value (dicts with string keys, lists, strings, numbers, booleans, None) nested more than
    ``max_depth`` deep, holding a string or key with a lone surrogate, a non-finite float (with ``finite``), or
    anything else. Iterative: a value of any depth (or a cycle) is refused, never recursed into."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _refuse_surrogates(item, what)
        elif isinstance(item, (dict, list, tuple)):
            if depth > max_depth:
                raise UntrustedInputError(what, f"nested more than {max_depth} deep")
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise UntrustedInputError(what, f"an object with a {type(key).__name__} key")
                    _refuse_surrogates(key, what)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, float):
            if finite and not math.isfinite(item):
                raise UntrustedInputError(what, _NONFINITE)
        elif not (item is None or isinstance(item, (bool, int))):
            raise UntrustedInputError(what, f"holding a {type(item).__name__}, which JSON has not")


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate: text that cannot be encoded as UTF-8 (a file name of bytes that are
    not UTF-8 reads back as one), so that it cannot be sent to an API or hashed as UTF-8."""
    return _SURROGATE.search(text) is not None


def printable(text: str) -> str:
    """``text`` with each lone surrogate written as a ``\\udXXX`` escape: safe to show, store and send."""
    return _SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", text) if has_lone_surrogate(text) else text


# -- LoRA adapters ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraAdapterConfig:
    """What an accepted ``adapter_config.json`` says about the adapter's shapes."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


_MODULE_PATTERN = re.compile(r"[A-Za-z0-9_.]{1,200}")  # peft reads pattern keys as regexes: plain names only
_INFORMATIONAL = {  # keys that say where the adapter came from and change no shape: checked for type only
    "task_type": str, "base_model_name_or_path": str, "revision": str, "peft_version": str, "inference_mode": bool,
    "use_rslora": bool,  # alpha / sqrt(r) instead of alpha / r: a scale, not a shape
}
_FIXED = {  # keys whose only accepted value is the one that adds nothing (None is accepted for each as well)
    "bias": "none", "init_lora_weights": True, "fan_in_fan_out": False, "megatron_core": "megatron.core",
}
_MAX_PATTERN_KEYS = 1_024


def lora_adapter_config(data: Any, *, ranks: Collection[int], modules: Collection[str], max_alpha: float,
                        what: str = "adapter_config.json") -> LoraAdapterConfig:
    """``data`` (a parsed ``adapter_config.json``) checked as a LoRA adapter (``peft_type`` "LORA" or absent) whose
    every shape-sizing field is one a job can produce: ``r`` and each ``rank_pattern`` value in ``ranks``;
    ``lora_alpha`` and each ``alpha_pattern`` value a finite number in (0, ``max_alpha``]; ``target_modules`` absent or
    a list of names from ``modules``; pattern keys plain module names; ``lora_dropout`` in [0, 1]. Every other key
    must add nothing: ``modules_to_save``, ``use_dora``, ``layer_replication``, ``trainable_token_indices`` and any
    key this check does not know must be absent, null, false or empty (a later peft's new option is accepted only
    while it is off)."""
    if not isinstance(data, dict):
        raise UntrustedInputError(what, "not a JSON object")
    config = dict(data)
    if config.pop("peft_type", "LORA") != "LORA":
        raise UntrustedInputError(what, f"not a LoRA adapter (peft_type {_short(data.get('peft_type'))})")
    rank = config.pop("r", None)
    if not _allowed_rank(rank, ranks):
        raise UntrustedInputError(what, f"rank {_short(rank)} is not one a job can train ({_describe(ranks)})")
    alpha = _alpha(config.pop("lora_alpha", 8), max_alpha, what, "lora_alpha")
    targets = config.pop("target_modules", None)  # None: peft's and vLLM's default for the model, a subset
    if targets is not None and (not isinstance(targets, list) or not targets or len(targets) > len(modules)
                                or not all(isinstance(t, str) and t in modules for t in targets)):
        raise UntrustedInputError(what, f"target_modules {_short(targets)} is not a list of "
                                        f"{', '.join(sorted(modules))}")
    rank_pattern = _pattern(config.pop("rank_pattern", None), what, "rank_pattern")
    for key, value in rank_pattern.items():
        if not _allowed_rank(value, ranks):
            raise UntrustedInputError(what, f"rank_pattern[{key!r}] = {_short(value)} is not a rank a job can train "
                                            f"({_describe(ranks)})")
    alpha_pattern = {key: _alpha(value, max_alpha, what, f"alpha_pattern[{key!r}]")
                     for key, value in _pattern(config.pop("alpha_pattern", None), what, "alpha_pattern").items()}
    dropout = config.pop("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise UntrustedInputError(what, f"lora_dropout {_short(dropout)} is not a number in [0, 1]")
    mapping = config.pop("auto_mapping", None)  # names the base model's class: read by AutoPeftModel, never here
    if mapping is not None and (not isinstance(mapping, dict) or not set(mapping) <= {"base_model_class",
                                                                                        "parent_library"}
                                or not all(isinstance(v, str) and len(v) <= 200 for v in mapping.values())):
        raise UntrustedInputError(what, f"auto_mapping {_short(mapping)} is not a base model's class and module")
    qalora_group = config.pop("qalora_group_size", None)  # read only with use_qalora, which must be off
    if qalora_group is not None and (isinstance(qalora_group, bool) or not isinstance(qalora_group, int)
                                     or not 0 < qalora_group <= 2**20):
        raise UntrustedInputError(what, f"qalora_group_size {_short(qalora_group)} is not a small positive integer")
    for key, value in config.items():
        if value is None:
            continue
        if key in _INFORMATIONAL:
            if not isinstance(value, _INFORMATIONAL[key]) or (isinstance(value, str) and len(value) > 1_000):
                raise UntrustedInputError(what, f"{key} {_short(value)} is not a {_INFORMATIONAL[key].__name__}")
        elif key in _FIXED:
            if value != _FIXED[key] or type(value) is not type(_FIXED[key]):
                raise UntrustedInputError(what, f"{key} is {_short(value)}; only {_FIXED[key]!r} is accepted")
        elif not (value is False or (isinstance(value, (dict, list, str)) and not value)):
            raise UntrustedInputError(what, f"{key} is {_short(value)}: only an adapter with plain LoRA factors is "
                                            "accepted (that setting may add weights or change their shapes)")
    return LoraAdapterConfig(rank=rank, alpha=alpha, target_modules=tuple(targets or ()), rank_pattern=rank_pattern,
                             alpha_pattern=alpha_pattern)


def _allowed_rank(value: Any, ranks: Collection[int]) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in ranks


def _alpha(value: Any, max_alpha: float, what: str, key: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= max_alpha):
        raise UntrustedInputError(what, f"{key} {_short(value)} is not a finite number in (0, {max_alpha:g}]")
    return float(value)


def _pattern(value: Any, what: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > _MAX_PATTERN_KEYS:
        raise UntrustedInputError(what, f"{key} is not an object of at most {_MAX_PATTERN_KEYS} module names")
    for name in value:
        if not _MODULE_PATTERN.fullmatch(name):
            raise UntrustedInputError(what, f"{key} key {_short(name)} is not a plain module name")
    return dict(value)


def _describe(ranks: Collection[int]) -> str:
    ordered = sorted(ranks)
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered))


def _short(value: Any) -> str:
    text = printable(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


# -- the JSON checks --------------------------------------------------------------------------------------------------
def _refuse_surrogates(text: str, what: str) -> None:
    found = _SURROGATE.search(text)
    if found:
        raise UntrustedInputError(what, f"text with a lone surrogate (U+{ord(found.group()):04X}) at character "
                                        f"{found.start()}, which is not UTF-8: send text as UTF-8")


def _check_depth(text: str, what: str, max_depth: int) -> None:
    """Refuse ``text`` if its brackets outside strings nest more than ``max_depth`` deep, in at most ``max_depth``
    linear passes over them: each pass deletes the innermost (empty) pairs, so that brackets nested ``d`` deep are
    gone after exactly ``d`` passes (``bytes.replace`` does not rescan what it joined)."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    brackets = _STRING.sub("", text).encode().translate(_ONE_KIND, _NOT_BRACKETS)
    for passes in range(max_depth + 1):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):  # left: "]]...[[" (no pair), of which the openers were nested too
            if passes + len(brackets) - len(brackets.rstrip(b"[")) <= max_depth:
                raise UntrustedInputError(what, "not valid JSON (its brackets do not match)")
            break
        brackets = shorter
    raise UntrustedInputError(what, f"nested more than {max_depth} deep")


def _finite_float(what: str):
    def parse(text: str) -> float:
        number = float(text)
        if not math.isfinite(number):
            raise UntrustedInputError(what, _NONFINITE)
        return number
    return parse


def _refuse_constant(what: str):
    def parse(name: str) -> Any:
        raise UntrustedInputError(what, _NONFINITE)
    return parse
