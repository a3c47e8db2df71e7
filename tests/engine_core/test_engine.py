"""EngineCore behaviour around the model: stops, aborts, limits, request errors.

A tiny random-weight Llama; greedy outputs of the same engine serve as the
baseline (their parity with HF is test_parity's job).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, greedy_params, random_prompts, run_to_completion


def tiny_engine(tiny_models: dict[str, Path]) -> EngineCore:
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        num_threads=NUM_THREADS,
    )
    return EngineCore(config)


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> EngineCore:
    return tiny_engine(tiny_models)


@pytest.fixture(scope="module")
def prompt(engine: EngineCore) -> list[int]:
    return random_prompts(21, 1, engine.info.vocab_size, 12, 12)[0]


@pytest.fixture(scope="module")
def baseline(engine: EngineCore, prompt: list[int]) -> list[int]:
    run = run_to_completion(engine, [AddRequest("base", prompt, greedy_params(20), 0.0)])
    return run.records["base"].token_ids


def test_stop_token_ends_the_request(
    engine: EngineCore, prompt: list[int], baseline: list[int]
) -> None:
    stop = baseline[5]
    first = baseline.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    run = run_to_completion(engine, [AddRequest("s", prompt, params, 0.0)])
    record = run.records["s"]
    assert record.token_ids == baseline[: first + 1]  # the stop token is included
    assert record.finish_reason == "stop"


def test_min_tokens_holds_back_stop_tokens(
    engine: EngineCore, prompt: list[int], baseline: list[int]
) -> None:
    stop = baseline[1]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop], min_tokens=8)
    run = run_to_completion(engine, [AddRequest("m", prompt, params, 0.0)])
    tokens = run.records["m"].token_ids
    assert len(tokens) >= 8
    assert stop not in tokens[:8]
    assert tokens[:1] == baseline[:1]  # nothing changes before the stop token is due


def test_max_model_len_caps_the_output(engine: EngineCore) -> None:
    prompt = random_prompts(22, 1, engine.info.vocab_size, 60, 60)[0]
    run = run_to_completion(engine, [AddRequest("long", prompt, greedy_params(100), 0.0)])
    assert len(run.records["long"].token_ids) == 64 - 60
    assert run.records["long"].finish_reason == "length"


def test_abort_mid_run_frees_blocks_and_spares_the_others(
    engine: EngineCore, prompt: list[int], baseline: list[int]
) -> None:
    other = random_prompts(23, 1, engine.info.vocab_size, 30, 30)[0]
    engine.add_request(AddRequest("keep", prompt, greedy_params(20), 0.0))
    engine.add_request(AddRequest("drop", other, greedy_params(20), 0.0))
    kept: list[int] = []
    for _ in range(3):
        kept += [t for r, d in engine.step() if r.request_id == "keep" for t in d.new_token_ids]
    bm = engine.scheduler.block_manager
    held = len(bm.get_block_ids("drop"))
    free_before = bm.num_free_blocks
    engine.abort_requests(["drop"])
    assert held > 0 and bm.num_free_blocks == free_before + held
    bm.check_invariants()
    while engine.has_work():
        for request, delta in engine.step():
            assert request.request_id == "keep"
            kept += delta.new_token_ids
        bm.check_invariants()
    assert kept == baseline
    assert bm.num_free_blocks == bm.num_blocks
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("prompt_ids", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 1000], SamplingParams(), "prompt token ids"),
        ([-1], SamplingParams(), "prompt token ids"),
        (list(range(64)), SamplingParams(), "maximum context length"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(stop_token_ids=[1000]), "stop_token_ids"),
    ],
)
def test_bad_requests_get_an_error_delta(
    engine: EngineCore, prompt_ids: list[int], params: SamplingParams, message: str
) -> None:
    delta = engine.add_request(AddRequest("bad", prompt_ids, params, 0.0))
    assert delta is not None
    assert delta.finish_reason == "error"
    assert delta.error is not None and message in delta.error
    assert not engine.has_work()


def test_duplicate_request_id_is_refused(engine: EngineCore, prompt: list[int]) -> None:
    assert engine.add_request(AddRequest("dup", prompt, greedy_params(2), 0.0)) is None
    delta = engine.add_request(AddRequest("dup", prompt, greedy_params(2), 0.0))
    assert delta is not None and delta.error is not None and "already in use" in delta.error
    while engine.has_work():
        engine.step()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_kv_cache_is_resident_from_the_start(tiny_models: dict[str, Path]) -> None:
    """The KV budget is in RSS once allocated, not page by page as blocks are first used."""
    runner = tiny_engine(tiny_models).executor.worker.runner
    budget = 256 << 20
    num_blocks = budget // runner.kv_bytes_per_block()
    # Hand freed heap pages back first: earlier tests' freed memory is still
    # resident and a new allocation may reuse it without growing the RSS.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_bytes()
    runner.allocate_kv_cache(num_blocks)
    grown = _rss_bytes() - before
    assert grown >= 0.8 * num_blocks * runner.kv_bytes_per_block(), grown


def test_cpu_kv_cache_is_stored_heads_first_for_the_compiled_kernels(
    tiny_models: dict[str, Path],
) -> None:
    """Each kv head's rows of a block are one run where the compiled kernels
    read the cache; the torch path keeps the plain, contiguous layout."""
    from pagoda.kernels import cpu_ops

    runner = tiny_engine(tiny_models).executor.worker.runner
    for compiled in (True, False):
        runner.backend.compiled_attention = compiled and cpu_ops.load_cpu_ops() is not None
        runner.allocate_kv_cache(8)
        for k, v in runner.kv_caches:
            assert k.shape == v.shape == (8, runner.block_size, *k.shape[2:])
            heads_first = runner.backend.compiled_attention
            assert cpu_ops.heads_first(k) == heads_first == cpu_ops.heads_first(v)
            assert k.is_contiguous() != heads_first


def test_prompt_step_runs_the_last_layer_on_sampled_rows_only(
    engine: EngineCore, prompt: list[int]
) -> None:
    """A prompt step without prompt logprobs feeds only each sequence's last
    token through the last layer's o-projection and MLP; with prompt logprobs
    every token goes through. The first token's logprobs agree either way."""
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    model = runner.model
    seen: list[int | None] = []
    forward = model.forward

    def spy(*args: object, **kwargs: object) -> object:
        last_rows = args[5] if len(args) > 5 else kwargs.get("last_rows")
        seen.append(None if last_rows is None else len(last_rows))  # type: ignore[arg-type]
        return forward(*args, **kwargs)

    other = random_prompts(22, 1, engine.info.vocab_size, 9, 9)[0]
    model.forward = spy
    runs, first_steps = [], []
    try:
        for lp in (None, 1):
            seen.clear()
            params = greedy_params(2, logprobs=4, prompt_logprobs=lp)
            requests = [
                AddRequest(f"lr{lp}{i}", p, params, 0.0) for i, p in enumerate((prompt, other))
            ]
            runs.append(run_to_completion(engine, requests))
            first_steps.append(seen[0])
    finally:
        del model.forward
    # Both prompts in one step: 2 sampled rows; with prompt logprobs, all rows.
    assert first_steps == [2, None]
    for i in range(2):
        plain, full = (run.records[f"lr{lp}{i}"] for run, lp in zip(runs, (None, 1), strict=True))
        assert plain.token_ids == full.token_ids
        for a, b in zip(plain.logprobs, full.logprobs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_padded_table_pads_rows_of_lists_and_tensors_alike() -> None:
    import torch

    from pagoda.engine_core.attention.cpu_backend import _padded_table

    rows = [[3, 1, 4], [1], [], [5, 9]]
    expected = torch.tensor([[3, 1, 4], [1, 0, 0], [0, 0, 0], [5, 9, 0]])
    assert torch.equal(_padded_table(rows), expected)
    mixed = [torch.tensor(r, dtype=torch.long) for r in rows[:2]] + rows[2:]
    assert torch.equal(_padded_table(mixed), expected)
    assert _padded_table([]).shape == (0, 0) and _padded_table([[]]).shape == (1, 0)


def test_step_budget_default_is_small_for_cpu_generation() -> None:
    """No --max-num-batched-tokens: 512 tokens a step for a decoder generating
    on the CPU (prompts arriving mid-stream wait one short step), 2048 where a
    pooling model's whole prompt must fit one step, or on a GPU."""
    from pagoda.engine_core.config import EngineConfig, default_max_num_batched_tokens

    assert default_max_num_batched_tokens(False, "cpu") == 512
    assert default_max_num_batched_tokens(True, "cpu") == 2048
    assert default_max_num_batched_tokens(False, "cuda") == 2048
    assert EngineConfig().max_num_batched_tokens is None  # resolved by EngineCore
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(max_num_batched_tokens=0)


def test_cache_salt_keeps_cached_prefixes_apart(engine: EngineCore) -> None:
    """Blocks cached under one salt (or none) are not found under another;
    under the same salt they are, and the tokens are the same either way."""
    prompt = random_prompts(33, 1, engine.info.vocab_size, 40, 40)[0]
    params = greedy_params(4)

    def run(request_id: str, salt: str | None) -> tuple[list[int], int]:
        add = AddRequest(request_id, prompt, params, 0.0, cache_salt=salt)
        record = run_to_completion(engine, [add]).records[request_id]
        return record.token_ids, record.num_cached_tokens

    tokens, cached = run("plain", None)
    assert cached == 0
    assert run("salted", "tenant-a") == (tokens, 0)
    assert run("salted-again", "tenant-a") == (tokens, 32)  # two full blocks of 16
    assert run("other", "tenant-b") == (tokens, 0)
    assert run("plain-again", None) == (tokens, 32)
