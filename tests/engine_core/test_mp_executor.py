"""The mp executor: worker processes behind the same seam as the in-process one.

Every plan and control call crosses a process boundary as msgpack; the tokens
and logprobs must be those of the uni executor, errors come back as the same
exceptions, and a worker that dies ends the engine with an error naming its
rank instead of a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.executor import ExecutorError
from pagoda.engine_core.executor.mp import MPExecutor
from pagoda.engine_core.model_config import load_model_config
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.hf_reference import hf_greedy

pytestmark = pytest.mark.slow


def tiny_engine(model: Path, backend: str, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(
        model=str(model),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_num_batched_tokens=32,  # prompts are chunked
        num_threads=NUM_THREADS,
        distributed_executor_backend=backend,
    )
    settings.update(overrides)
    return EngineCore(EngineConfig(**settings))  # type: ignore[arg-type]


def requests(vocab: int) -> list[AddRequest]:
    prompts = random_prompts(3, 4, vocab, 5, 40)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=1.0, repetition_penalty=1.2, seed=11, max_tokens=12, ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
    ]
    return [
        AddRequest(f"r{i}", prompt, p, 0.0)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]


@pytest.mark.parametrize("pp", [1, 2])
def test_mp_gives_the_uni_executors_tokens_and_logprobs(
    tiny_models: dict[str, Path], pp: int
) -> None:
    """Greedy, seeded top-p, penalties, logprobs and prompt logprobs: the same
    through worker processes (and pipeline stages, whose last stage samples
    and sends the tokens back through the engine) as in process."""
    runs = {}
    for backend in ("uni", "mp"):
        stages = pp if backend == "mp" else 1
        engine = tiny_engine(tiny_models["llama"], backend, pipeline_parallel_size=stages)
        try:
            assert isinstance(engine.executor, MPExecutor) == (backend == "mp")
            runs[backend] = run_to_completion(engine, requests(engine.info.vocab_size)).records
        finally:
            engine.shutdown()
    for request_id, uni in runs["uni"].items():
        mp = runs["mp"][request_id]
        assert mp.token_ids == uni.token_ids, request_id
        if pp == 1:  # the same batches: the same sums
            assert mp.logprobs == uni.logprobs, request_id
            assert mp.prompt_logprobs == uni.prompt_logprobs, request_id
        else:  # the stages' plans split the batch: float32 rounding differs
            assert_close_logprobs(mp.logprobs, uni.logprobs)
            assert_close_logprobs(mp.prompt_logprobs or [], uni.prompt_logprobs or [])


def assert_close_logprobs(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if a is None or b is None:  # a prompt's first position
            assert a is b
            continue
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.fixture(scope="module")
def mp_engine(tiny_models: dict[str, Path]) -> EngineCore:
    engine = tiny_engine(tiny_models["llama"], "mp")
    yield engine
    engine.shutdown()


def test_control_calls_reach_the_worker_process(mp_engine: EngineCore) -> None:
    executor = mp_engine.executor
    assert isinstance(executor, MPExecutor)
    (info,) = executor.collective_rpc("describe")
    assert info.rank == 0 and info.dtype == "float32" and info.device == "cpu"
    with pytest.raises(ValueError, match="no control call"):
        executor.collective_rpc("no_such_call")
    with pytest.raises(ValueError, match="no control call"):
        executor.collective_rpc("_serve")
    # Sleep mode through the executor: the worker drops and restores its state.
    assert mp_engine.sleep(1) and mp_engine.is_sleeping()
    assert mp_engine.wake_up() and not mp_engine.is_sleeping()
    prompt = random_prompts(5, 1, mp_engine.info.vocab_size, 8, 8)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run = run_to_completion(mp_engine, [AddRequest("after-wake", prompt, params, 0.0)])
    assert len(run.records["after-wake"].token_ids) == 4


def test_a_killed_worker_fails_the_engine_naming_its_rank(tiny_models: dict[str, Path]) -> None:
    engine = tiny_engine(tiny_models["llama"], "mp")
    try:
        executor = engine.executor
        assert isinstance(executor, MPExecutor)
        prompt = random_prompts(6, 1, engine.info.vocab_size, 8, 8)[0]
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        assert engine.add_request(AddRequest("doomed", prompt, params, 0.0)) is None
        engine.step()
        pid = executor.pids[0]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ExecutorError, match=r"worker rank 0 \(pid \d+\) exited with code -9"):
            while engine.has_work():
                engine.step()
        assert time.monotonic() - started < 5
        with pytest.raises(ExecutorError, match="rank 0"):
            executor.check_health()
    finally:
        engine.shutdown()


def greedy_run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    adds = [AddRequest(f"g{i}", p, params, 0.0) for i, p in enumerate(prompts)]
    return run_to_completion(engine, adds).records


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "all_reduce"),
    [
        ("llama", 2, 1, "shm"),
        ("qwen3", 2, 1, "shm"),
        ("llama", 4, 1, "shm"),
        ("llama", 2, 1, "gloo"),
        ("llama", 1, 2, ""),
        ("qwen3", 1, 2, ""),
        ("llama", 2, 2, "shm"),
        ("qwen3", 2, 2, "gloo"),
    ],
)
def test_parallel_ranks_give_the_single_rank_tokens(
    tiny_models: dict[str, Path], kind: str, tp: int, pp: int, all_reduce: str, monkeypatch: Any
) -> None:
    """Heads, MLP and vocabulary split over tp ranks (at 4 ranks the 2 KV heads
    are replicated), the partial sums added through shared memory or gloo,
    the layers split into pp stages passing hidden states on: greedy tokens
    as at one rank and as transformers gives them, logprobs within 1e-4;
    prompts chunked, and preempted by a small cache."""
    monkeypatch.setenv("PAGODA_CPU_ALLREDUCE", all_reduce or "shm")
    prompts = random_prompts(8, 5, 1000, 4, 40)
    mc = load_model_config(str(tiny_models[kind]))
    runs = {}
    for size, stages in ((1, 1), (tp, pp)):
        # 12 blocks of 16 on every rank (each holds its KV heads of its stage's
        # layers): too few for the five requests at once, so some are
        # preempted and recomputed.
        kv_heads = max(mc.num_kv_heads // size, 1)
        block_bytes = 2 * (mc.num_layers // stages) * 16 * kv_heads * mc.head_dim * 4
        engine = tiny_engine(
            tiny_models[kind],
            "mp" if size * stages > 1 else "uni",
            tensor_parallel_size=size,
            pipeline_parallel_size=stages,
            kv_cache_memory_bytes=12 * block_bytes,
        )
        try:
            assert engine.info.num_kv_blocks == 12
            info = engine.executor.collective_rpc("describe")
            used = "nccl" if torch.cuda.is_available() else all_reduce  # on GPUs, NCCL
            assert [i.all_reduce for i in info] == [used if size > 1 else ""] * (size * stages)
            assert [i.stage for i in info] == [rank // size for rank in range(size * stages)]
            depths: list[int] = []
            engine.executor.submit = counting_submits(engine, depths)  # type: ignore[method-assign]
            runs[size, stages] = greedy_run(engine, prompts, 16)
            assert engine.scheduler.num_preemptions > 0
            assert max(depths) == stages  # a plan in flight per stage
        finally:
            engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models[kind]), dtype=torch.float32)
    expected = hf_greedy(hf, prompts, 16)
    for i, tokens in enumerate(expected):
        one, many = runs[1, 1][f"g{i}"], runs[tp, pp][f"g{i}"]
        assert many.token_ids == one.token_ids == tokens, i
        for a, b in zip(one.logprobs, many.logprobs, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def counting_submits(engine: EngineCore, depths: list[int]) -> Any:
    """The engine's executor.submit, noting how many plans are in flight with each."""
    submit = engine.executor.submit

    def counted(plan: Any) -> None:
        depths.append(len(engine._in_flight) + 1)
        submit(plan)

    return counted


def test_tensor_parallel_refuses_what_does_not_divide(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="4 attention heads do not divide by"):
        tiny_engine(tiny_models["llama"], "mp", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs --distributed-executor-backend mp"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_default_model_at_three_ranks_gives_the_single_rank_tokens() -> None:
    """The default model's 9 query heads, 3 KV heads and 49,152-token vocabulary
    split over 3 ranks (float32, dense weights): the greedy tokens of one rank,
    logprobs within 1e-4."""
    prompts = random_prompts(1, 4, 49152, 8, 60)
    runs = {}
    for size in (1, 3):
        engine = EngineCore(
            EngineConfig(
                dtype="float32",
                tensor_parallel_size=size,
                kv_cache_memory_bytes=64 << 20,
                num_threads=NUM_THREADS,
            )
        )
        try:
            runs[size] = greedy_run(engine, prompts, 16)
        finally:
            engine.shutdown()
    for request_id, one in runs[1].items():
        three = runs[3][request_id]
        assert three.token_ids == one.token_ids, request_id
        for a, b in zip(one.logprobs, three.logprobs, strict=True):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_two_nodes_over_loopback_give_the_single_rank_tokens(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 is a separate command, `engine-core --headless`, running rank 1;
    node 0's engine core runs rank 0 and reaches rank 1 over tcp: the tokens
    of one rank. Shutting the engine down ends node 1's workers and command."""
    model = tiny_models["llama"]
    port = free_ports(6)  # torch.distributed, the channel, its replies, 2 ranks
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log = tmp_path / "node1.log"
    with open(log, "wb") as out:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "pagoda.engine_core.cli", "--headless", "--node-rank", "1"]
            + ["--tensor-parallel-size", "2", "--model", str(model), *node],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prompts = random_prompts(9, 3, 1000, 4, 30)
    runs = {}
    try:
        for nnodes in (1, 2):
            overrides: dict[str, object] = {}
            if nnodes == 2:
                overrides = dict(
                    tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port
                )
            engine = tiny_engine(model, "mp" if nnodes == 2 else "uni", **overrides)
            try:
                if nnodes == 2:
                    info = engine.executor.collective_rpc("describe")
                    assert [i.rank for i in info] == [0, 1]
                    assert [i.all_reduce for i in info] == ["gloo", "gloo"]
                runs[nnodes] = greedy_run(engine, prompts, 12)
            finally:
                engine.shutdown()
        assert node1.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
    for request_id, one in runs[1].items():
        assert runs[2][request_id].token_ids == one.token_ids, request_id


def test_aborts_while_plans_are_in_flight(tiny_models: dict[str, Path]) -> None:
    """Two stages, plans in flight: requests aborted between steps leave the
    others' tokens as one rank makes them, and every block comes back."""
    prompts = random_prompts(17, 6, 1000, 5, 30)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = {}
    engine = tiny_engine(tiny_models["llama"], "uni")
    try:
        adds = [AddRequest(f"r{i}", p, params, 0.0) for i, p in enumerate(prompts)]
        reference = {k: v.token_ids for k, v in run_to_completion(engine, adds).records.items()}
    finally:
        engine.shutdown()
    engine = tiny_engine(tiny_models["llama"], "mp", pipeline_parallel_size=2)
    try:
        for i, p in enumerate(prompts):
            assert engine.add_request(AddRequest(f"r{i}", p, params, 0.0)) is None
        tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        steps = 0
        while engine.has_work():
            for _, delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finish_reason:
                    finished[delta.request_id] = delta.finish_reason
            steps += 1
            if steps == 6:
                assert engine._in_flight  # aborting with plans in flight
                engine.abort_requests(["r1", "r3", "r5"])
        for i in (0, 2, 4):
            assert tokens[f"r{i}"] == reference[f"r{i}"], i
            assert finished[f"r{i}"] == "length"
        for i in (1, 3, 5):
            assert tokens.get(f"r{i}", []) == reference[f"r{i}"][: len(tokens.get(f"r{i}", []))]
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.in_flight
        # The freed blocks serve new requests correctly.
        again = run_to_completion(engine, [AddRequest("late", prompts[1], params, 0.0)])
        assert again.records["late"].token_ids == reference["r1"]
    finally:
        engine.shutdown()
