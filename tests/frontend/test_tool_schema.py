"""The combined tool-call schema of tool_choice "required": local $refs follow each tool.

jsonschema (an outside implementation of JSON pointers and $ref) says which replies the
combined schema accepts; xgrammar, with the default model's tokenizer, must compile it and
accept / refuse the same replies.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagoda.frontend.api.tool_calls import ToolRequest
from pagoda.frontend.api.tool_schema import relocate_refs, required_calls_schema

# Two tools that both define $defs/node, differently: a clash if they were merged by name.
TREE = {
    "type": "object",
    "properties": {"node": {"$ref": "#/$defs/node"}},
    "required": ["node"],
    "additionalProperties": False,
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
}
PATH = {
    "type": "object",
    "properties": {"node": {"$ref": "#/definitions/node"}},
    "required": ["node"],
    "additionalProperties": False,
    "definitions": {
        "node": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "next": {"$ref": "#/definitions/node"}},
            "required": ["name"],
            "additionalProperties": False,
        }
    },
}
# `$ref: "#"`: the tool's own root, not the combined schema's.
SELF = {
    "type": "object",
    "properties": {"x": {"type": "boolean"}, "sub": {"$ref": "#"}},
    "required": ["x"],
    "additionalProperties": False,
}
FUNCTIONS = {"tree": TREE, "path": PATH, "self": SELF}

GOOD = [
    [{"name": "tree", "parameters": {"node": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}}}],
    [{"name": "path", "parameters": {"node": {"name": "a", "next": {"name": "b"}}}}],
    [{"name": "self", "parameters": {"x": True, "sub": {"x": False, "sub": {"x": True}}}}],
    [
        {"name": "tree", "parameters": {"node": {"v": 0}}},
        {"name": "self", "parameters": {"x": False}},
    ],
]
BAD = [
    # tree's node read as path's node (and the other way round): the clash, if any.
    [{"name": "tree", "parameters": {"node": {"name": "a"}}}],
    [{"name": "path", "parameters": {"node": {"v": 1}}}],
    # Deep inside the recursion, the wrong shape.
    [{"name": "tree", "parameters": {"node": {"v": 1, "kids": [{"v": "two"}]}}}],
    [{"name": "path", "parameters": {"node": {"name": "a", "next": {"next": {"name": "c"}}}}}],
    # "#" is the tool's root: `sub` must be the tool's object, not a list of calls.
    [{"name": "self", "parameters": {"x": True, "sub": [{"name": "self"}]}}],
    [{"name": "self", "parameters": {"x": True, "sub": {"sub": {"x": True}}}}],
    [{"name": "nope", "parameters": {}}],
    [],
]


def test_relocate_refs_prefixes_local_refs_only() -> None:
    schema = {
        "properties": {
            "$ref": {"type": "string"},  # a property named "$ref"
            "a": {"$ref": "#"},
            "b": {"$ref": "#/$defs/x"},
            "c": {"$ref": "https://example.com/s.json#/x"},
            "d": {"$ref": "#anchor"},
            "e": {"const": {"$ref": "#/data"}, "default": {"$ref": "#"}},
            "f": {"items": [{"$ref": "#/definitions/y"}], "anyOf": [{"$ref": "#/properties/a"}]},
        },
        "$defs": {"x": {"not": {"$ref": "#/$defs/x"}}},
    }
    before = json.dumps(schema)
    out = relocate_refs(schema, "/$defs/t")
    assert json.dumps(schema) == before  # the caller's schema is not touched
    props = out["properties"]
    assert props["$ref"] == {"type": "string"}
    assert props["a"]["$ref"] == "#/$defs/t"
    assert props["b"]["$ref"] == "#/$defs/t/$defs/x"
    assert props["c"]["$ref"] == "https://example.com/s.json#/x"
    assert props["d"]["$ref"] == "#anchor"
    assert props["e"] == {"const": {"$ref": "#/data"}, "default": {"$ref": "#"}}
    assert props["f"]["items"][0]["$ref"] == "#/$defs/t/definitions/y"
    assert props["f"]["anyOf"][0]["$ref"] == "#/$defs/t/properties/a"
    assert out["$defs"]["x"]["not"]["$ref"] == "#/$defs/t/$defs/x"


def test_relocate_refs_deep_schema_has_no_recursion_limit() -> None:
    root: dict[str, Any] = {"type": "object"}
    node = root
    for _ in range(3000):
        child: dict[str, Any] = {"type": "object"}
        node["properties"] = {"a": child, "r": {"$ref": "#"}}
        node = child
    out = relocate_refs(root, "/$defs/t")
    assert out["properties"]["a"]["properties"]["r"]["$ref"] == "#/$defs/t"


@pytest.mark.parametrize("reply", GOOD, ids=range(len(GOOD)))
def test_combined_schema_accepts_valid_calls(reply: list[dict[str, Any]]) -> None:
    jsonschema.validate(reply, required_calls_schema(FUNCTIONS, parallel=True))
    for call in reply:  # ...which are also valid against each tool's own schema
        jsonschema.validate(call["parameters"], FUNCTIONS[call["name"]])


@pytest.mark.parametrize("reply", BAD, ids=range(len(BAD)))
def test_combined_schema_refuses_invalid_calls(reply: list[dict[str, Any]]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(reply, required_calls_schema(FUNCTIONS, parallel=True))


def test_parallel_false_allows_one_call() -> None:
    schema = required_calls_schema(FUNCTIONS, parallel=False)
    jsonschema.validate(GOOD[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(GOOD[3], schema)


def test_tool_request_uses_the_combined_schema() -> None:
    constraint = ToolRequest("required", FUNCTIONS).constraint()
    assert constraint is not None and constraint.json is not None
    assert json.loads(constraint.json) == required_calls_schema(FUNCTIONS, parallel=True)


@pytest.fixture(scope="module")
def compiler() -> Any:
    """An xgrammar compiler for the default model, as the engine's compile child makes it."""
    from pagoda.engine_core.model_config import load_model_config, resolve_model_path
    from pagoda.engine_core.structured_output.manager import StructuredOutputManager
    from pagoda.engine_core.tokenizer_files import tokenizer_dir_for

    path = resolve_model_path(None)
    mc = load_model_config(path)
    manager = StructuredOutputManager(
        tokenizer_dir_for(path), mc.vocab_size, list(mc.eos_token_ids)
    )
    import xgrammar as xgr

    # The compile child builds the same compiler from the same TokenizerInfo.
    return xgr.GrammarCompiler(manager._get_tokenizer_info(), max_threads=1, cache_enabled=False)


def _accepts(compiled: Any, reply: Any) -> bool:
    """The whole reply, then end of sequence, is accepted by the grammar."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    # The engine compiles with any_whitespace=False: xgrammar's ", " / ": " separators.
    if not matcher.accept_string(json.dumps(reply, separators=(", ", ": "))):
        return False
    return bool(matcher.accept_token(compiled.tokenizer_info.stop_token_ids[0]))


def test_xgrammar_compiles_and_agrees_with_jsonschema(compiler: Any) -> None:
    text = json.dumps(required_calls_schema(FUNCTIONS, parallel=True))
    compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    for reply in GOOD:
        assert _accepts(compiled, reply), reply
    for reply in BAD:
        assert not _accepts(compiled, reply), reply
