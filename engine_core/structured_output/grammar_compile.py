"""Compiling one structured-output constraint with xgrammar, and the error
text a request gets back when it cannot be compiled. Runs in the compile
child (engine_core/grammar_worker.py); the engine side
(engine_core/structured_output.py) shares GrammarError."""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.protocol.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled."""


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def compile_with(compiler: Any, params: StructuredOutputsParams) -> Any:
    """Compile one constraint with an xgrammar GrammarCompiler (in the compile child)."""
    kind = params.kind
    if kind == "json":
        assert params.json is not None
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("the JSON schema must be an object")
        return compiler.compile_json_schema(
            params.json, any_whitespace=params.any_whitespace, strict_mode=True
        )
    if kind == "json_object":
        # Any object, in compact JSON: free whitespace lets small models loop on newlines.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return compiler.compile_grammar(choice_grammar(params.choice))
    if kind == "grammar":
        return compiler.compile_grammar(params.grammar)
    raise GrammarError("structured_outputs names no constraint")


def describe_error(kind: str, exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    if isinstance(exc, GrammarError):
        return str(exc)
    text = _CXX_PREFIX.sub("", str(exc).strip(), count=1)
    names = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
    return f"invalid {names.get(kind, kind)}: {text[:400]}"


_CXX_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
