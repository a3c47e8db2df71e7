"""Structured output: grammars compiled with xgrammar, off the busy loop.

A request with `structured_outputs` gets a Future for its compiled grammar
when it arrives; the scheduler leaves it waiting until the Future is done, so
the busy loop keeps stepping the other requests. Compiles run one at a time in
a child process (engine_core/grammar_worker.py) fed by one dispatcher thread:
a compile still running at its deadline (--grammar-compile-timeout) is ended
by killing the child, which frees its CPU and memory, and a warm spare child
takes over at once, so a runaway schema cannot starve the requests after it.
Compiled grammars come back serialized and are cached by their spec, so a
schema used by many requests compiles once. The engine core then keeps one
GrammarMatcher per request: before a step that samples the request it fills
the request's row of the plan's token bitmask (the worker masks the logits
with it), after the step it advances the matcher with the sampled token.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from pagoda.engine_core.core.plan import GrammarBitmask
from pagoda.engine_core.structured_output.grammar_compile import GrammarError
from pagoda.engine_core.structured_output.grammar_worker import (
    GrammarWorker,
    WorkerDied,
    WorkerTimeout,
)
from pagoda.protocol.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept; each is a few KB to a few MB.
GRAMMAR_CACHE_SIZE = 256
# How long a fresh compile child may take to start (imports torch and xgrammar).
WORKER_START_TIMEOUT_S = 120.0


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


def timeout_message(timeout_s: float) -> str:
    return f"the structured output constraint did not compile within {timeout_s:g} s"


class _Job:
    __slots__ = ("key", "params", "deadline", "future")

    def __init__(
        self, key: tuple[str, str], params: StructuredOutputsParams, deadline: float
    ) -> None:
        self.key = key
        self.params = params
        self.deadline = deadline
        self.future: Future[Any] = Future()


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout_s: float = 20.0,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer_info: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._active: GrammarWorker | None = None
        self._spare: GrammarWorker | None = None
        self._closed = False
        # Counters for tests and logs: compiles ended by the deadline, children started.
        self.killed_compiles = 0
        self.workers_started = 0
        # When the active child last became ready (monotonic).
        self._ready_at = 0.0

    def start(self) -> None:
        """Start the compile children and the dispatcher now rather than at first use."""
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._active = self._new_worker()
            self._spare = self._new_worker()
            self._thread = threading.Thread(target=self._run, name="grammar", daemon=True)
            self._thread.start()

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
        self.start()
        job = _Job(key, params, time.monotonic() + self.compile_timeout_s)
        self._jobs.put(job)
        return job.future

    def shutdown(self) -> None:
        """Stop the dispatcher and kill the compile children."""
        with self._lock:
            self._closed = True
            workers = [w for w in (self._active, self._spare) if w is not None]
        self._jobs.put(None)
        # Killing first also ends a compile the dispatcher is waiting on.
        for worker in workers:
            worker.kill()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    # ------------------------------------------------------------ internals

    def _new_worker(self) -> GrammarWorker:
        self.workers_started += 1
        return GrammarWorker(self.tokenizer_path, self.vocab_size, self.stop_token_ids)

    def _run(self) -> None:
        try:
            self._get_tokenizer_info()  # now, not on the first request's clock
        except Exception:  # noqa: BLE001 - retried (and reported) by the first compile
            logger.exception("could not build the tokenizer info for grammars")
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.future.cancelled():
                continue
            try:
                job.future.set_result(self._compile(job))
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                if not isinstance(e, GrammarError):
                    logger.exception("grammar compile failed")
                job.future.set_exception(e)

    def _compile(self, job: _Job) -> Any:
        with self._lock:
            cached = self._cache.get(job.key)  # an identical spec queued before this one
        if cached is not None:
            return cached
        worker = self._worker()
        if not worker.ready:
            # The children start at the first constrained request (each imports torch
            # and xgrammar: seconds, ~300 MB), not with every engine.
            try:
                worker.wait_ready(worker.started_at + WORKER_START_TIMEOUT_S)
            except WorkerTimeout:
                self._replace_active()
                raise GrammarError("the grammar compiler did not start in time") from None
            except WorkerDied as e:
                logger.warning("grammar worker died while starting (%s); starting another", e)
                self._replace_active()
                raise GrammarError(f"the grammar compiler could not start: {e}") from None
            self._ready_at = time.monotonic()
        # The time limit bounds compiling, not a child's start: a job that arrived
        # while the child was starting has its full time from when it was ready.
        deadline = job.deadline
        if job.deadline - self.compile_timeout_s < self._ready_at:
            deadline = max(deadline, self._ready_at + self.compile_timeout_s)
        if time.monotonic() >= deadline:
            raise GrammarError(timeout_message(self.compile_timeout_s))
        try:
            ok, text = worker.compile(job.params, deadline)
        except WorkerTimeout:
            # The compile overran: kill it (freeing its CPU and memory), promote the spare.
            self.killed_compiles += 1
            logger.warning(
                "grammar compile of a %s constraint passed %g s: killed its process",
                job.params.kind,
                self.compile_timeout_s,
            )
            self._replace_active()
            raise GrammarError(timeout_message(self.compile_timeout_s)) from None
        except WorkerDied as e:
            logger.warning("grammar worker died (%s); starting another", e)
            self._replace_active()
            raise GrammarError(f"the grammar compiler failed on this constraint: {e}") from None
        if not ok:
            raise GrammarError(text)
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(text, self._get_tokenizer_info())
        with self._lock:
            self._cache[job.key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _worker(self) -> GrammarWorker:
        assert self._active is not None
        return self._active

    def _replace_active(self) -> None:
        """Kill the active child; the spare (already starting or warm) takes its place."""
        assert self._active is not None
        self._active.kill()
        with self._lock:
            if self._closed:  # shutdown() killed the child under us: start no other
                return
            self._active, self._spare = self._spare, self._new_worker()

    def _get_tokenizer_info(self) -> Any:
        """The engine side's TokenizerInfo, to attach compiled grammars to (built once)."""
        if self._tokenizer_info is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(self.tokenizer_path)
            self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
        return self._tokenizer_info


def new_matcher(compiled: Any, output_token_ids: list[int]) -> Any:
    """A matcher at the start of the grammar, advanced over tokens already generated."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token_id in output_token_ids:
        matcher.accept_token(token_id)
    return matcher


def fill_grammar_bitmask(rows: list[tuple[str, Any]], vocab_size: int) -> GrammarBitmask:
    """The next-token bitmask of each (request id, matcher), as the plan carries it."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)  # int32 [rows, ceil(vocab/32)]
    for i, (_, matcher) in enumerate(rows):
        matcher.fill_next_token_bitmask(bitmask, i)
    return GrammarBitmask(
        request_ids=[request_id for request_id, _ in rows],
        words=int(bitmask.shape[1]),
        data=bitmask.numpy().astype("<i4", copy=False).tobytes(),
    )


def advance_matcher(matcher: Any, token_id: int) -> bool:
    """Feed the sampled token; True when the grammar has reached its end."""
    if not matcher.accept_token(token_id):
        # Only reachable if the mask was bypassed; end rather than emit garbage.
        logger.warning("token %d rejected by the grammar; ending the request", token_id)
        return True
    return bool(matcher.is_terminated())
