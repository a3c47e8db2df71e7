"""Structured output: grammars compiled with xgrammar, off the busy loop.

A request with `structured_outputs` gets a Future for its compiled grammar
when it arrives; the scheduler leaves it waiting until the Future is done
(compilation runs in one worker thread, so the busy loop keeps stepping the
other requests). Compiled grammars are cached by their spec, so a schema
used by many requests compiles once. The model runner then keeps one
GrammarMatcher per request: before sampling it fills the request's row of a
token bitmask, after sampling it advances the matcher with the chosen token.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from protocol.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept; each is a few KB to a few MB.
GRAMMAR_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled."""


def spec_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """The cache key of one constraint: its kind and its text."""
    kind = params.kind
    if kind == "choice":
        return kind, json.dumps(params.choice)
    if kind == "json_object":
        return kind, ""
    if kind == "json":
        return kind + ("_ws" if params.any_whitespace else ""), params.json or ""
    return kind, getattr(params, kind) or ""


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # One thread: compiling is CPU-bound and must not starve the model.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compile_async(self, params: StructuredOutputsParams) -> Future[Any]:
        """A Future of the compiled grammar; raises GrammarError when it fails."""
        key = spec_key(params)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                done: Future[Any] = Future()
                done.set_result(cached)
                return done
        return self._pool.submit(self._compile, key, params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ internals

    def _compile(self, key: tuple[str, str], params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        try:
            compiled = _compile_with(compiler, params)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with C++ context
            raise GrammarError(_describe(params.kind, e)) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # Caching is ours (bounded, keyed by spec); xgrammar's own is off.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def new_matcher(compiled: Any, output_token_ids: list[int]) -> Any:
    """A matcher at the start of the grammar, advanced over tokens already generated."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token_id in output_token_ids:
        matcher.accept_token(token_id)
    return matcher


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
    """Mask, in place, every token the grammar forbids next on the given rows.

    logits: float32 [batch, vocab]; rows: (row index, matcher) of constrained rows.
    """
    import xgrammar as xgr

    batch, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(batch, vocab)  # int32 [batch, ceil(vocab / 32)]
    for i, matcher in rows:
        matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[i for i, _ in rows])


def advance_matcher(matcher: Any, token_id: int) -> bool:
    """Feed the sampled token; True when the grammar has reached its end."""
    if not matcher.accept_token(token_id):
        # Only reachable if the mask was bypassed; end rather than emit garbage.
        logger.warning("token %d rejected by the grammar; ending the request", token_id)
        return True
    return bool(matcher.is_terminated())


def _compile_with(compiler: Any, params: StructuredOutputsParams) -> Any:
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


def _describe(kind: str, exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    if isinstance(exc, GrammarError):
        return str(exc)
    text = _CXX_PREFIX.sub("", str(exc).strip(), count=1)
    names = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
    return f"invalid {names.get(kind, kind)}: {text[:400]}"


_CXX_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
