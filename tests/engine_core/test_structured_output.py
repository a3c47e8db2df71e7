"""Structured output inside the engine core: masks per request, preemption, failures.

The default model (it has a real tokenizer for xgrammar), float32, one thread.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import load_model_config, resolve_model_path
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine_core.helpers import NUM_THREADS, kv_bytes_for_blocks, run_to_completion

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6}-\d{2}"),
    "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
}


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[A-Z][a-z]{2,6}-\d{2}", text), text
    else:
        assert text in ("alpha", "beta", "gamma delta"), text


def make_engine(num_blocks: int | None = None, max_model_len: int = 128) -> EngineCore:
    budget = None
    if num_blocks is not None:
        mc = load_model_config(resolve_model_path(None))
        budget = kv_bytes_for_blocks(mc, num_blocks, 16)
    return EngineCore(
        EngineConfig(
            model=None,
            dtype="float32",
            kv_cache_memory_bytes=budget or (64 << 20),
            max_model_len=max_model_len,
            max_num_batched_tokens=64,
            num_threads=NUM_THREADS,
        )
    )


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    return make_engine()


def prompts(engine: EngineCore) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(engine.info.tokenizer_path)
    texts = ["Write a record:", "Tell me a story about"]
    return [tok.encode(t) for t in texts]


def requests(engine: EngineCore, temperature: float = 0.0) -> list[AddRequest]:
    out = []
    for i, ids in enumerate(prompts(engine)):
        for kind, constraint in [*CONSTRAINTS.items(), ("free", None)]:
            params = SamplingParams(
                temperature=temperature,
                seed=i if temperature else None,
                # The schema's longest object is ~35 tokens: room to close it.
                max_tokens=48,
                structured_outputs=constraint,
            )
            out.append(AddRequest(f"{kind}-{i}", ids, params, 0.0))
    return out


def decode(engine: EngineCore, ids: list[int]) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(engine.info.tokenizer_path)
    return tok.decode(ids, skip_special_tokens=True)


def test_mixed_batch_each_request_keeps_its_own_constraint(engine: EngineCore) -> None:
    batch = requests(engine, temperature=0.9)
    together = run_to_completion(engine, batch).records
    for rid, record in together.items():
        kind = rid.split("-")[0]
        if kind != "free":
            assert record.finish_reason == "stop", rid
            check(kind, decode(engine, record.token_ids))
    # A constrained neighbour changes nothing for an unconstrained request.
    free = next(add for add in batch if add.request_id.startswith("free"))
    alone = run_to_completion(engine, [free]).records[free.request_id]
    assert alone.token_ids == together[free.request_id].token_ids


def test_preemption_replays_the_grammar(engine: EngineCore) -> None:
    batch = requests(engine)
    roomy = run_to_completion(engine, batch).records
    tight_engine = make_engine(num_blocks=6, max_model_len=64)
    # Compile first (the compile children start on first use, in seconds): with the
    # grammars cached every request is schedulable at once and they contend for blocks.
    for add in batch:
        if add.sampling_params.structured_outputs is not None:
            tight_engine.structured_output.compile_async(
                add.sampling_params.structured_outputs
            ).result(timeout=120)
    run = run_to_completion(tight_engine, batch)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid, record in run.records.items():
        assert record.token_ids == roomy[rid].token_ids, rid


def test_a_grammar_that_fails_fails_only_its_request(engine: EngineCore) -> None:
    ids = prompts(engine)[0]
    bad = AddRequest(
        "bad",
        ids,
        SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(a")),
        0.0,
    )
    good = AddRequest("good", ids, SamplingParams(temperature=0, max_tokens=8), 0.0)
    assert engine.add_request(bad) is None  # compiled off the loop; fails later
    assert engine.add_request(good) is None
    errors: dict[str, str | None] = {}
    tokens: dict[str, list[int]] = {"good": [], "bad": []}
    while engine.has_work():
        for request, delta in engine.step():
            tokens[request.request_id] += delta.new_token_ids
            if delta.finish_reason:
                errors[request.request_id] = delta.error
    assert errors["bad"] is not None and "invalid regex" in errors["bad"]
    assert tokens["bad"] == []
    assert errors["good"] is None and len(tokens["good"]) == 8
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
