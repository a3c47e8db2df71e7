"""Grammar compiles in a killable child process: errors, caching, and a runaway compile
that is killed at its deadline without holding up the compiles after it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pagoda.engine_core.model_config import load_model_config, resolve_model_path
from pagoda.engine_core.structured_output.manager import GrammarError, StructuredOutputManager
from pagoda.engine_core.tokenizer_files import tokenizer_dir_for
from pagoda.protocol.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"],
    "additionalProperties": False,
}


def blowup_schema(n: int = 400) -> dict[str, Any]:
    """About a minute of compile on this machine (xgrammar 0.2.9)."""
    props = {
        f"p{i}": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "[a-z]{1,50}"}]}
        for i in range(n)
    }
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.fixture(scope="module")
def manager() -> Iterator[StructuredOutputManager]:
    path = resolve_model_path(None)
    mc = load_model_config(path)
    m = StructuredOutputManager(
        tokenizer_dir_for(path), mc.vocab_size, list(mc.eos_token_ids), TIMEOUT_S
    )
    m.start()
    # Both children take a few seconds to start; wait for the active one and the spare.
    assert m._active is not None and m._spare is not None
    m._active.wait_ready(time.monotonic() + 120)
    m._spare.wait_ready(time.monotonic() + 120)
    yield m
    m.shutdown()


def json_params(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema))


def test_compiles_in_the_child_and_matches(manager: StructuredOutputManager) -> None:
    import xgrammar as xgr

    compiled = manager.compile_async(json_params(SCHEMA)).result(timeout=30)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('{"id": 3, "name": "x"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"name": 3}')
    # Cached: the second Future is done at once.
    assert manager.compile_async(json_params(SCHEMA)).done()


def test_a_bad_constraint_is_a_grammar_error(manager: StructuredOutputManager) -> None:
    future = manager.compile_async(StructuredOutputsParams(regex="(((("))
    with pytest.raises(GrammarError, match="invalid regex"):
        future.result(timeout=30)
    # The child survives an ordinary error.
    assert manager._active is not None and manager._active.proc.poll() is None


def test_runaway_compile_is_killed_and_the_next_is_prompt(
    manager: StructuredOutputManager,
) -> None:
    assert manager._active is not None
    runaway = manager._active.proc
    killed = manager.killed_compiles
    start = time.monotonic()
    with pytest.raises(GrammarError, match=f"did not compile within {TIMEOUT_S:g} s"):
        manager.compile_async(json_params(blowup_schema())).result(timeout=60)
    failed_after = time.monotonic() - start
    assert failed_after < TIMEOUT_S + 2, failed_after
    # Its process is gone (CPU and memory back), not compiling on behind our back.
    assert runaway.poll() is not None
    assert manager.killed_compiles == killed + 1
    # A new schema (not cached) compiles at once on the warm spare.
    start = time.monotonic()
    other = dict(SCHEMA, properties={"a": {"type": "boolean"}}, required=["a"])
    manager.compile_async(json_params(other)).result(timeout=30)
    assert time.monotonic() - start < 2.0


def test_requests_queued_behind_a_runaway_still_compile(
    manager: StructuredOutputManager,
) -> None:
    """One submitted just after a runaway waits at most for the kill, then compiles."""
    # Let the spare started by the previous test become ready.
    assert manager._spare is not None
    manager._spare.wait_ready(time.monotonic() + 120)
    runaway = manager.compile_async(json_params(blowup_schema(401)))
    time.sleep(0.5)
    manager.compile_timeout_s = 10.0  # the queued job gets a longer deadline than the runaway
    try:
        queued = manager.compile_async(json_params(dict(SCHEMA, required=["id"])))
    finally:
        manager.compile_timeout_s = TIMEOUT_S
    with pytest.raises(GrammarError):
        runaway.result(timeout=60)
    queued.result(timeout=10)


def test_shutdown_ends_a_running_compile_and_leaves_no_process() -> None:
    path = resolve_model_path(None)
    mc = load_model_config(path)
    m = StructuredOutputManager(tokenizer_dir_for(path), mc.vocab_size, list(mc.eos_token_ids), 60)
    future = m.compile_async(json_params(blowup_schema()))
    assert m._active is not None and m._spare is not None
    procs = [m._active.proc, m._spare.proc]
    # The dispatcher reads the child's ready frame (reading it here would race it).
    deadline = time.monotonic() + 120
    while not m._active.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the dispatcher has sent the job: the child is compiling
    start = time.monotonic()
    m.shutdown()
    with pytest.raises(GrammarError):
        future.result(timeout=10)
    assert time.monotonic() - start < 5
    assert all(p.poll() is not None for p in procs)
    assert m.workers_started == 2  # no replacement started after shutdown
