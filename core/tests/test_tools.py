import json
from typing import Literal

import pytest

from aitrainsai.tools import ToolSchemaError, bind, call_tool, tool_schema


def lookup(world: dict, name: str, limit: int = 3, mode: Literal["a", "b"] = "a") -> list:
    """Look a name up in the world.

    Args:
        name: the person's name
        limit: how many results
            at most, counting from the first
        mode: which index to use
    """
    return world["people"][name][:limit]


def test_schema_from_hints_and_docstring():
    schema = tool_schema(lookup)
    fn = schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look a name up in the world."
    props = fn["parameters"]["properties"]
    assert list(props) == ["name", "limit", "mode"]  # world is hidden
    assert props["name"] == {"type": "string", "description": "the person's name"}
    assert props["limit"]["type"] == "integer" and props["limit"]["description"].endswith("counting from the first")
    assert props["mode"] == {"type": "string", "enum": ["a", "b"], "description": "which index to use"}
    assert fn["parameters"]["required"] == ["name"]
    json.dumps(schema)


def test_bound_tool_keeps_its_schema():
    bound = bind(lookup, {"people": {"ann": [1, 2, 3, 4]}})
    assert tool_schema(bound) == tool_schema(lookup)
    assert call_tool({"lookup": bound}, "lookup", '{"name": "ann"}') == "[1, 2, 3]"


@pytest.mark.parametrize("arguments, expected", [
    ('{"name": "bob"}', "error: not found: bob"),
    ('{"name": 5}', "error: not found: 5"),
    ('{"name": "ann", "limit": "two"}', "error: limit must be an integer"),
    ('{"name": "ann", "limit": "2"}', "[1, 2]"),
    ('{"name": "ann", "mode": "c"}', "error: mode must be one of 'a', 'b'"),
    ('{"limit": 1}', "error: missing argument(s) 'name'"),
    ('{"name": "ann", "extra": 1}', "error: unknown argument(s) 'extra'"),
    ("not json", "error: arguments are not valid JSON"),
    ("[1]", "error: arguments must be a JSON object"),
    ('{"name": "' + "x" * 5000 + '"}', "error: arguments are 5012 characters"),
])
def test_bad_input_comes_back_as_an_error_string(arguments, expected):
    tools = {"lookup": bind(lookup, {"people": {"ann": [1, 2, 3, 4]}})}
    assert call_tool(tools, "lookup", arguments).startswith(expected)


def test_unknown_tool_and_huge_results():
    def shout(world: dict, text: str) -> str:
        """Repeat text loudly.

        Args:
            text: what to repeat
        """
        return text.upper() * 10_000

    tools = {"shout": bind(shout, {})}
    assert call_tool(tools, "whisper", "{}").startswith("error: unknown tool 'whisper'; available: shout")
    assert "[truncated" in call_tool(tools, "shout", '{"text": "hey"}')


def test_undescribable_tools_are_refused():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x) -> int:
        """Doc."""

    def varargs(*x: int) -> int:
        """Doc."""

    for fn in (no_doc, no_hint, varargs):
        with pytest.raises(ToolSchemaError):
            tool_schema(fn)
