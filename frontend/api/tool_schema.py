"""The JSON schema that forces a reply to be a list of tool calls.

For `tool_choice` "required" (Anthropic: "any") the reply must be
`[{"name": ..., "parameters": ...}, ...]`, where each call's `parameters`
match its own tool's schema. Each tool's schema is moved, whole and
unchanged but for its local `$ref`s, to `#/$defs/<tool name>` of the
combined schema, and each call alternative points there. A local reference
inside it ("#", "#/$defs/X", "#/definitions/X", "#/properties/a/...") is a
JSON pointer from the tool schema's root; it now needs the prefix
`/$defs/<tool name>`. Because every tool keeps its own `$defs` under its own
key, two tools that both define "$defs/node" do not clash, and `$ref: "#"`
self-recursion points at the tool's root rather than the combined schema's.

Tool names are 1-64 of `[A-Za-z0-9_.-]`, so they need no JSON-pointer or
URI escaping as a key.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema
# map. Only these are walked: a "$ref" key inside `const`, `enum`, `default`
# or `examples` is data, and a property *named* "$ref" is a name.
_ONE = frozenset(
    {
        "additionalItems",
        "additionalProperties",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset(
    {"$defs", "definitions", "dependentSchemas", "dependencies", "patternProperties", "properties"}
)


def relocate_refs(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of `schema` to be placed at JSON pointer `pointer` of a larger document.

    Every local `$ref` ("#" or "#/...") gets `pointer` inserted after the "#";
    other references (remote URLs, "#anchor") are left as they are.
    """
    out: dict[str, Any] = {}
    # Iterative copy: a schema nested nearly as deep as the JSON parser allows
    # must not hit the recursion limit here (copy.deepcopy would).
    stack: list[tuple[Any, Any, int]] = [(schema, out, _SCHEMA)]
    while stack:
        src, dst, kind = stack.pop()
        pairs = src.items() if isinstance(src, dict) else enumerate(src)
        for key, value in pairs:
            child = _SCHEMA if kind in (_SCHEMAS, _NAMED) else _DATA
            if kind == _SCHEMA:
                if key == "$ref" and isinstance(value, str) and _is_local(value):
                    value = "#" + pointer + value[1:]
                child = _child_kind(key, value)
            copied: Any = value
            if isinstance(value, dict | list):
                copied = {} if isinstance(value, dict) else []
                stack.append((value, copied, child))
            if isinstance(dst, dict):
                dst[key] = copied
            else:
                dst.append(copied)
    return out


# What a JSON value inside a schema is: a subschema, a list of them, a name ->
# subschema map, or data that is never rewritten.
_SCHEMA, _SCHEMAS, _NAMED, _DATA = range(4)


def _child_kind(key: object, value: Any) -> int:
    if key in _ONE and isinstance(value, dict):
        return _SCHEMA
    if key in _LIST and isinstance(value, list):
        return _SCHEMAS
    if key in _MAP and isinstance(value, dict):
        # `dependencies` values may also be lists of names: no "$ref" key in those.
        return _NAMED
    return _DATA


def _is_local(ref: str) -> bool:
    return ref == "#" or ref.startswith("#/")


def required_calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a reply of one or more calls (one if not `parallel`) to `functions`."""
    defs = {name: relocate_refs(params, f"/$defs/{name}") for name, params in functions.items()}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": calls},
        "minItems": 1,
        "$defs": defs,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema
