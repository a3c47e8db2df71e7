"""KV transfers between engines (--kv-transfer-config PeerConnector): a
producer prefills and holds the prompt's blocks, a consumer pulls them over
ZeroMQ and computes only the last prompt token, with the same greedy output
as computing the prompt itself; every failure falls back to computing the
prompt, and says so."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.kv_connector import parse_kv_transfer_config
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def peer_engine(
    model: Path, role: str | None, dtype: str = "float32", tp: int = 1, **extra: Any
) -> EngineCore:
    config: dict[str, Any] = {}
    if role is not None:
        connector = {"kv_connector": "PeerConnector", "kv_role": role}
        config["kv_transfer_config"] = json.dumps({**connector, "kv_connector_extra_config": extra})
    return EngineCore(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            kv_cache_memory_bytes=4 << 20,
            num_threads=NUM_THREADS,
            tensor_parallel_size=tp,
            **config,
        )
    )


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    num_cached_tokens: int = 0


def run(engine: EngineCore, adds: list[AddRequest]) -> dict[str, Finished]:
    """Add the requests and step until they are all done."""
    done = {add.request_id: Finished() for add in adds}
    for add in adds:
        refused = engine.add_request(add)
        if refused is not None:
            done[add.request_id].error = refused.error
    while engine.has_work():
        for request, delta in engine.step():
            record = done[request.request_id]
            record.token_ids.extend(delta.new_token_ids)
            record.num_cached_tokens = delta.num_cached_tokens
            if delta.finish_reason is not None:
                record.kv_transfer_params = delta.kv_transfer_params
                record.error = delta.error
        engine.scheduler.block_manager.check_invariants()
    return done


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]):  # type: ignore[no-untyped-def]
    model = tiny_models["llama"]
    producer = peer_engine(model, "kv_producer")
    consumer = peer_engine(model, "kv_consumer", timeout_s=2)
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def prefill(producer: EngineCore, request_id: str, prompt: list[int]) -> dict[str, Any]:
    add = AddRequest(
        request_id, prompt, PREFILL, 0.0, kv_transfer_params={"do_remote_decode": True}
    )
    result = run(producer, [add])[request_id]
    assert result.error is None and len(result.token_ids) == 1
    params = result.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    return params


def test_the_consumer_pulls_the_prompt_and_computes_only_its_last_token(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    producer, consumer = engines
    prompts = random_prompts(7, 3, 1000, 20, 90)
    references = run(
        producer, [AddRequest(f"ref{i}", p, GREEDY, 0.0) for i, p in enumerate(prompts)]
    )
    free_before = producer.scheduler.block_manager.num_free_blocks
    params = [prefill(producer, f"p{i}", p) for i, p in enumerate(prompts)]
    assert producer.peer is not None and producer.peer.num_held == 3
    assert producer.scheduler.block_manager.num_free_blocks < free_before  # held for the consumer
    computed_before = consumer.scheduler.num_prompt_tokens_computed
    decoded = run(
        consumer,
        [
            AddRequest(f"d{i}", p, GREEDY, 0.0, kv_transfer_params=params[i])
            for i, p in enumerate(prompts)
        ],
    )
    for i, prompt in enumerate(prompts):
        result = decoded[f"d{i}"]
        assert result.token_ids == references[f"ref{i}"].token_ids
        out = result.kv_transfer_params
        assert out is not None and out["kv_transfer"] == "transferred", out
        assert out["transferred_tokens"] == len(prompt) - 1 and out["transfer_bytes"] > 0
    # Nothing of the prompts was computed on the consumer but their last tokens.
    assert consumer.scheduler.num_prompt_tokens_computed - computed_before == len(prompts)
    stats = consumer.stats()
    assert stats.kv_transfers >= 3 and stats.kv_transfer_bytes > 0
    # The consumer said it was done: the producer frees the blocks.
    producer.release_kv_holds()
    assert producer.peer.num_held == 0
    assert producer.scheduler.block_manager.num_free_blocks == free_before
    assert producer.stats().kv_served >= 3


def test_a_prefix_the_consumer_has_is_not_pulled_again(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    producer, consumer = engines
    prompt = random_prompts(8, 1, 1000, 70, 70)[0]
    reference = run(producer, [AddRequest("ref", prompt, GREEDY, 0.0)])["ref"].token_ids
    first = run(consumer, [AddRequest("c1", prompt, GREEDY, 0.0)])["c1"]  # cached locally
    assert first.token_ids == reference
    params = prefill(producer, "p", prompt)
    result = run(consumer, [AddRequest("d", prompt, GREEDY, 0.0, kv_transfer_params=params)])["d"]
    assert result.token_ids == reference
    out = result.kv_transfer_params
    assert out is not None and out["kv_transfer"] == "transferred"
    assert out["cached_tokens"] == 64 and out["transferred_tokens"] == 70 - 1 - 64
    assert result.num_cached_tokens == 64


def test_failures_fall_back_to_computing_the_prompt_and_say_why(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    producer, consumer = engines
    prompt, other = random_prompts(9, 2, 1000, 40, 40)
    reference = run(producer, [AddRequest("ref", prompt, GREEDY, 0.0)])["ref"].token_ids
    params = prefill(producer, "p", other)  # the KV of another prompt
    gone = {**params, "remote_port": 1, "remote_request_id": "x"}  # nothing listens there
    taken = dict(params)
    cases = {
        "another prompt": (params, "prompt differs"),
        "no producer": (gone, "did not answer"),
    }
    for name, (p, why) in cases.items():
        add = AddRequest(name, prompt, GREEDY, 0.0, kv_transfer_params=p)
        result = run(consumer, [add])[name]
        assert result.token_ids == reference, name
        out = result.kv_transfer_params
        assert out is not None and out["kv_transfer"] == "recomputed" and why in out["reason"]
    # The first attempt was refused, so the hold is still there: take it properly...
    ok = run(consumer, [AddRequest("ok", other, GREEDY, 0.0, kv_transfer_params=taken)])["ok"]
    assert ok.kv_transfer_params is not None
    assert ok.kv_transfer_params["kv_transfer"] == "transferred"
    # ...and a second pull of the same hold finds nothing.
    again = run(consumer, [AddRequest("again", other, GREEDY, 0.0, kv_transfer_params=taken)])
    out = again["again"].kv_transfer_params
    assert out is not None and "no KV held" in out["reason"]
    assert again["again"].token_ids == ok.token_ids
    assert consumer.stats().kv_recomputed >= 3


def test_unread_blocks_are_freed_after_the_timeout(tiny_models: dict[str, Path]) -> None:
    producer = peer_engine(tiny_models["llama"], "kv_both", timeout_s=0.3)
    try:
        free = producer.scheduler.block_manager.num_free_blocks
        params = prefill(producer, "p", random_prompts(10, 1, 1000, 50, 50)[0])
        assert producer.scheduler.block_manager.num_free_blocks < free
        time.sleep(0.4)
        producer.release_kv_holds()
        assert producer.scheduler.block_manager.num_free_blocks == free
        assert producer.stats().kv_expired == 1
        # A consumer that comes too late computes the prompt itself (kv_both pulls too).
        prompt = random_prompts(10, 1, 1000, 50, 50)[0]
        late = run(producer, [AddRequest("late", prompt, GREEDY, 0.0, kv_transfer_params=params)])
        assert late["late"].kv_transfer_params["reason"].startswith("no KV held")  # type: ignore[index]
    finally:
        producer.shutdown()


def test_another_layout_is_refused_not_copied(
    tiny_models: dict[str, Path], engines: tuple[EngineCore, EngineCore]
) -> None:
    producer, _ = engines
    consumer = peer_engine(tiny_models["llama"], "kv_consumer", dtype="bfloat16")
    try:
        prompt = random_prompts(11, 1, 1000, 30, 30)[0]
        params = prefill(producer, "p", prompt)
        result = run(consumer, [AddRequest("d", prompt, GREEDY, 0.0, kv_transfer_params=params)])
        out = result["d"].kv_transfer_params
        assert out is not None and out["kv_transfer"] == "recomputed" and "layout" in out["reason"]
        assert consumer.scheduler.block_manager.num_free_blocks == (
            consumer.scheduler.block_manager.num_blocks
        )
    finally:
        consumer.shutdown()


def test_params_that_do_not_suit_the_engine_are_refused(
    tiny_models: dict[str, Path], engines: tuple[EngineCore, EngineCore]
) -> None:
    producer, consumer = engines
    prompt = [5, 6, 7]
    params = prefill(producer, "p", prompt)
    cases = [
        (consumer, {"do_remote_decode": True}, "kv_producer"),
        (producer, params, "kv_consumer"),
        (consumer, {"do_remote_prefill": True, "remote_port": 1}, "remote_host"),
        (consumer, {**params, "tp_size": 2}, "must match"),
    ]
    for engine, p, why in cases:
        refused = engine.add_request(AddRequest("bad", prompt, GREEDY, 0.0, kv_transfer_params=p))
        assert refused is not None and refused.error is not None and why in refused.error
    plain = peer_engine(tiny_models["llama"], None)
    try:
        refused = plain.add_request(
            AddRequest("bad", prompt, GREEDY, 0.0, kv_transfer_params={"do_remote_decode": True})
        )
        assert refused is not None and "PeerConnector" in (refused.error or "")
        # Params that ask nothing of a connector are accepted anywhere.
        fine = {"do_remote_decode": False, "do_remote_prefill": False}
        result = run(plain, [AddRequest("ok", prompt, GREEDY, 0.0, kv_transfer_params=fine)])
        assert result["ok"].error is None and len(result["ok"].token_ids) == 8
    finally:
        plain.shutdown()


def test_the_config_is_checked() -> None:
    config = parse_kv_transfer_config(
        '{"kv_connector": "PeerConnector", "kv_role": "kv_producer", "kv_port": 5600}'
    )
    assert config is not None and config.is_producer and not config.is_consumer
    for bad, why in [
        ('{"kv_connector": "PeerConnector", "kv_role": "producer"}', "kv_role"),
        ('{"kv_connector": "PeerConnector", "kv_port": "x"}', "kv_port"),
        ('{"kv_connector": "PeerConnector", "kv_connector_extra_config": []}', "extra"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_kv_transfer_config(bad)


def test_with_curve_keys_only_a_consumer_holding_them_pulls(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from pagoda.protocol.curve import generate_keys

    keys = str(generate_keys(tmp_path / "keys"))
    model = tiny_models["llama"]
    producer = peer_engine(model, "kv_producer", curve_keys=keys)
    keyed = peer_engine(model, "kv_consumer", curve_keys=keys)
    keyless = peer_engine(model, "kv_consumer", timeout_s=1)
    try:
        prompt = random_prompts(12, 1, 1000, 40, 40)[0]
        reference = run(producer, [AddRequest("ref", prompt, GREEDY, 0.0)])["ref"].token_ids
        params = prefill(producer, "p", prompt)
        out = run(keyless, [AddRequest("d", prompt, GREEDY, 0.0, kv_transfer_params=params)])["d"]
        assert out.token_ids == reference
        assert out.kv_transfer_params is not None
        assert out.kv_transfer_params["kv_transfer"] == "recomputed"
        out = run(keyed, [AddRequest("d", prompt, GREEDY, 0.0, kv_transfer_params=params)])["d"]
        assert out.token_ids == reference
        assert out.kv_transfer_params is not None
        assert out.kv_transfer_params["kv_transfer"] == "transferred"
    finally:
        for engine in (producer, keyed, keyless):
            engine.shutdown()


def test_tensor_parallel_ranks_pull_from_the_same_ranks(
    tiny_models: dict[str, Path], engines: tuple[EngineCore, EngineCore]
) -> None:
    """Two ranks on each side (worker processes): each rank pulls its KV heads
    from the producer's rank of the same index; a one-rank consumer is refused."""
    model = tiny_models["llama"]
    producer = peer_engine(model, "kv_producer", tp=2)
    consumer = peer_engine(model, "kv_consumer", tp=2)
    try:
        prompts = random_prompts(13, 2, 1000, 30, 60)
        references = run(
            producer, [AddRequest(f"ref{i}", p, GREEDY, 0.0) for i, p in enumerate(prompts)]
        )
        params = [prefill(producer, f"p{i}", p) for i, p in enumerate(prompts)]
        assert params[0]["tp_size"] == 2
        decoded = run(
            consumer,
            [
                AddRequest(f"d{i}", p, GREEDY, 0.0, kv_transfer_params=params[i])
                for i, p in enumerate(prompts)
            ],
        )
        for i in range(len(prompts)):
            assert decoded[f"d{i}"].token_ids == references[f"ref{i}"].token_ids
            out = decoded[f"d{i}"].kv_transfer_params
            assert out is not None and out["kv_transfer"] == "transferred", out
        _, one_rank = engines
        refused = one_rank.add_request(
            AddRequest("x", prompts[0], GREEDY, 0.0, kv_transfer_params=params[0])
        )
        assert refused is not None and "must match" in (refused.error or "")
    finally:
        producer.shutdown()
        consumer.shutdown()
