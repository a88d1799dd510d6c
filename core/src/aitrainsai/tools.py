"""Tools as plain Python functions: their OpenAI function schema, and calling them so that bad input never raises.

A tool is a function with type hints and a Google-style docstring. A tool that reads the item's generated state takes
it as its first parameter, named ``world`` (:func:`takes_world`, the one rule: the core and the job template both use
it); that parameter is bound by :func:`bind` and left out of the schema. Tools that need no state omit it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin
from collections.abc import Callable

from aitrainsai.parsing import UntrustedInputError, check_value, load_json, printable
from aitrainsai.errors import AitrainsaiError

MAX_ARGUMENT_CHARS = 2_000
MAX_RESULT_CHARS = 4_000
WORLD = "world"

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolSchemaError(TypeError, AitrainsaiError):
    """A tool function cannot be described as an OpenAI function."""


def takes_world(fn: Callable) -> bool:
    """Whether tool ``fn`` takes the item's world: its first parameter is named ``world``. A ``world`` parameter
    anywhere else is a :class:`ToolSchemaError` (the world is always passed first)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == WORLD and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                                  params[0].POSITIONAL_OR_KEYWORD):
        return True
    if any(param.name == WORLD for param in params):
        raise ToolSchemaError(f"tool {getattr(fn, '__name__', fn)!r}: 'world' must be its first parameter "
                              "(positional), since the item's world is passed first")
    return False


def tool_schema(fn: Callable) -> dict:
    """The OpenAI ``{"type": "function", "function": {...}}`` schema of a tool function."""
    return copy.deepcopy(_schema(inspect.unwrap(fn)))


@functools.lru_cache(maxsize=1024)
def _schema(fn: Callable) -> dict:
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolSchemaError(f"tool {fn.__name__} has no docstring")
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    params = list(inspect.signature(fn).parameters.items())
    for pname, param in params[1:] if takes_world(fn) else params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {fn.__name__}: *args and **kwargs cannot be described")
        if pname not in hints:
            raise ToolSchemaError(f"tool {fn.__name__}: parameter {pname!r} has no type hint")
        prop = _json_type(hints[pname], f"{fn.__name__}.{pname}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def bind(fn: Callable, world: Any) -> Callable:
    """``fn`` with its ``world`` parameter bound (:func:`takes_world`), keeping its name, docstring and schema."""
    if not takes_world(fn):
        return fn
    bound = functools.partial(fn, world)
    functools.update_wrapper(bound, fn)
    return bound


def call_tool(tools: dict[str, Callable], name: str, arguments: str | dict | None,
              max_argument_chars: int = MAX_ARGUMENT_CHARS, max_result_chars: int = MAX_RESULT_CHARS) -> str:
    """Run tool ``name`` on JSON ``arguments``; every failure comes back as an ``error: ...`` string, never raised.
    Arguments are read with :func:`aitrainsai.parsing.load_json` (capped, nested at most ``MAX_DEPTH`` deep, finite
    numbers, no lone surrogate, so no path the agent names can be one); the result is always UTF-8-encodable text."""
    call = _prepare(tools, name, arguments, max_argument_chars)
    if isinstance(call, str):
        return call
    try:
        return _result_text(call[0](**call[1]), max_result_chars)
    except Exception as exc:  # noqa: BLE001 - tools run on model output: report, never raise
        return _failed(exc)


async def call_tool_async(tools: dict[str, Callable], name: str, arguments: str | dict | None,
                          max_argument_chars: int = MAX_ARGUMENT_CHARS,
                          max_result_chars: int = MAX_RESULT_CHARS) -> str:
    """:func:`call_tool` where a tool may be a coroutine function (the agent's ``submit_job``, which waits on a
    probe): the same argument checks and the same ``error: ...`` answers; a plain function is called as there."""
    answer = _prepare(tools, name, arguments, max_argument_chars)
    if not isinstance(answer, str):
        tool, kwargs = answer
        try:  # a failing probe or baseline is the agent's to read, not raised
            result = tool(**kwargs)
            answer = _result_text(await result if inspect.isawaitable(result) else result, max_result_chars)
        except Exception as exc:  # noqa: BLE001
            answer = _failed(exc)
    return answer


def _prepare(tools: dict[str, Callable], name: Any, arguments: str | dict | None,
             max_argument_chars: int) -> tuple[Callable, dict[str, Any]] | str:
    """The tool and its checked keyword arguments, or the ``error: ...`` answer."""
    fn = tools.get(name) if isinstance(name, str) else None
    if fn is None:
        return f"error: unknown tool {str(name)[:80]!r}; available: {', '.join(sorted(tools))}"
    if arguments is None or arguments == "":
        arguments = {}
    try:
        if isinstance(arguments, str):
            if len(arguments) > max_argument_chars:
                return f"error: arguments are {len(arguments)} characters; the limit is {max_argument_chars}"
            arguments = load_json(arguments, what="arguments", max_bytes=max_argument_chars)
        else:
            check_value(arguments, what="arguments")
    except UntrustedInputError as exc:  # deep, non-finite, not UTF-8: one line, never a RecursionError
        return f"error: arguments are {exc.reason}"
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object"
    try:
        return fn, _check_arguments(fn, arguments)
    except Exception as exc:  # noqa: BLE001 - a bad argument is an answer to the model, never raised
        return _failed(exc)


def _failed(exc: Exception) -> str:
    return printable(f"error: {_exception_text(exc)}")


def _result_text(result: Any, max_result_chars: int) -> str:
    text = result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True)
    if len(text) > max_result_chars:
        text = text[:max_result_chars] + f"... [truncated, {len(text)} characters]"
    return printable(text)  # a file name that is not UTF-8 (say) reaches the model escaped, never unsendable


def _check_arguments(fn: Callable, arguments: dict) -> dict:
    schema = _schema(inspect.unwrap(fn))["function"]["parameters"]
    props = schema["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(map(repr, unknown))}; expected {', '.join(props) or 'none'}")
    missing = [p for p in schema["required"] if p not in arguments]
    if missing:
        raise ValueError(f"missing argument(s) {', '.join(map(repr, missing))}; expected {', '.join(props)}")
    hints = typing.get_type_hints(inspect.unwrap(fn))
    out = {}
    for key, value in arguments.items():
        out[key] = _coerce(value, hints[key], key)
    return out


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in get_args(hint):
            try:
                return _coerce(value, option, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: bad value")
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{key} must be null")
    if origin is Literal:
        if value in get_args(hint):
            return value
        raise ValueError(f"{key} must be one of {', '.join(map(repr, get_args(hint)))}, not {_short(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false, not {_short(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
            return int(value)
        raise ValueError(f"{key} must be an integer, not {_short(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{key} must be a number, not {_short(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key} must be a string, not {_short(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, not {_short(value)}")
        (inner,) = get_args(hint) or (Any,)
        return [_coerce(v, inner, key) if inner is not Any else v for v in value]
    return value


def _json_type(hint: Any, where: str) -> dict:
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin = get_origin(hint)
    if origin is Literal:
        values = list(get_args(hint))
        return {"type": _JSON_TYPES[type(values[0])], "enum": values}
    if origin is list:
        (inner,) = get_args(hint) or (str,)
        return {"type": "array", "items": _json_type(inner, where)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
    raise ToolSchemaError(f"tool parameter {where}: type {hint!r} has no JSON schema "
                          "(use str, int, float, bool, list, Literal)")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, re.M)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= 8):
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return summary, args


def _exception_text(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return f"not found: {str(exc.args[0])[:200]}"
    text = str(exc) or type(exc).__name__
    return text[:500]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def openai_tool(name: str, description: str, parameters: dict) -> dict:
    """``{"type": "function", "function": {...}}`` for a tool verifiers describes: its JSON Schema without pydantic's
    titles, keys in the order given."""
    params = json.loads(json.dumps(parameters))
    params.pop("title", None)
    for prop in params.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}
