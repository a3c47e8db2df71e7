"""Request fields that constrain the output → one StructuredOutputsParams.

Three spellings reach the same constraint: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` object (json, regex,
choice, grammar, json_object) and vLLM's older `guided_*` fields. Only shape
errors are caught here; whether a schema, regex or grammar compiles is
decided by the engine core (xgrammar), whose error becomes a 400 as well.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagoda.frontend.api.errors import APIError
from pagoda.protocol.sampling_params import StructuredOutputsParams

_LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: a named schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format."""

    model_config = ConfigDict(extra="allow")

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="allow")

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def schema_text(schema: dict[str, Any] | bool | str, param: str) -> str:
    """A JSON schema as canonical text (dict keys sorted, so equal schemas cache once)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise APIError(400, "a JSON schema must be an object", param)
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(
                400, "response_format json_schema needs json_schema.schema", "response_format"
            )
        return StructuredOutputsParams(
            json=schema_text(fmt.json_schema.json_schema, "response_format")
        )
    raise APIError(
        400,
        f"response_format type {fmt.type!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


def from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=None if so.json_ is None else schema_text(so.json_, "structured_outputs"),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=bool(so.json_object),
    )


def constraint_from(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    extra: dict[str, Any] | None,
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None; 400 when it asks for two."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = from_response_format(response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if structured_outputs is not None:
        found.append(("structured_outputs", from_structured_outputs(structured_outputs)))
    for field, kind in _LEGACY_FIELDS.items():
        value = (extra or {}).get(field)
        if value is not None:
            found.append((field, _legacy(field, kind, value)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"only one output constraint is allowed, got {names}", found[1][0])
    name, params = found[0]
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), name) from None
    return params


def _legacy(field: str, kind: str, value: object) -> StructuredOutputsParams:
    if kind == "json":
        if not isinstance(value, dict | str | bool):
            raise APIError(400, f"{field} must be a JSON schema", field)
        return StructuredOutputsParams(json=schema_text(value, field))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{field} must be a list of strings", field)
        return StructuredOutputsParams(choice=value)
    if not isinstance(value, str):
        raise APIError(400, f"{field} must be a string", field)
    if kind == "regex":
        return StructuredOutputsParams(regex=value)
    return StructuredOutputsParams(grammar=value)
