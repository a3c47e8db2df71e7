"""Sleep mode in the engine core: weights parked or dropped, KV cache freed, exact wake-up."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.engine_utilities import EngineBusyError
from pagoda.engine_core.worker.sleep import tensor_slots
from pagoda.protocol.messages import AddRequest
from tests.engine_core.helpers import NUM_THREADS, greedy_params, run_to_completion

PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 300, 2]]


def requests() -> list[AddRequest]:
    return [
        AddRequest(f"r{i}", p, greedy_params(12, logprobs=1), time.time())
        for i, p in enumerate(PROMPTS)
    ]


def outputs(engine: EngineCore) -> list[tuple[list[int], list[list[float]]]]:
    run = run_to_completion(engine, requests())
    return [
        (rec.token_ids, [lp.logprobs for lp in rec.logprobs])
        for _, rec in sorted(run.records.items())
    ]


def weight_bytes(engine: EngineCore) -> int:
    total = 0
    seen: set[int] = set()
    for _, _, t in tensor_slots(engine.executor.worker.runner.model):
        if id(t) not in seen and t.layout == torch.strided:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def check_sleep_cycle(engine: EngineCore, tmp_path: Path | None) -> None:
    reference = outputs(engine)
    assert weight_bytes(engine) > 0
    for level in (1, 2, 1):
        engine.sleep(level)
        assert engine.is_sleeping() and engine.stats().is_sleeping
        runner = engine.executor.worker.runner
        assert runner.kv_caches == []
        assert runner.model is None or weight_bytes(engine) == 0
        refusal = engine.add_request(requests()[0])
        assert refusal is not None and refusal.error_kind == "sleeping"
        engine.wake_up(["weights"])
        assert engine.is_sleeping()  # the KV cache is still out
        engine.wake_up()
        assert not engine.is_sleeping()
        assert outputs(engine) == reference
    if tmp_path is not None:
        assert not list(tmp_path.iterdir())  # the spill file is gone after wake-up


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sleep_levels_restore_identical_outputs(
    tiny_models: dict[str, Path], tmp_path: Path, dtype: str
) -> None:
    # bfloat16 on this CPU exercises oneDNN-packed weights (parked dense, re-packed).
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        dtype=dtype,
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        num_threads=NUM_THREADS,
        sleep_offload_dir=str(tmp_path),
    )
    check_sleep_cycle(EngineCore(config), tmp_path)


def test_sleep_refused_while_requests_run(tiny_models: dict[str, Path]) -> None:
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        num_threads=NUM_THREADS,
    )
    engine = EngineCore(config)
    assert engine.add_request(requests()[0]) is None
    with pytest.raises(EngineBusyError, match="in flight"):
        engine.sleep(1)
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["gpu"])
    engine.abort_requests(["r0"])
    engine.step()
    engine.sleep(2)
    engine.wake_up()
    assert not engine.is_sleeping()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_frees_device_memory(tiny_models: dict[str, Path]) -> None:
    config = EngineConfig(
        model=str(tiny_models["llama"]),
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
    )
    engine = EngineCore(config)
    outputs(engine)
    awake = torch.cuda.memory_allocated()
    engine.sleep(1)
    assert torch.cuda.memory_allocated() < awake - (200 << 20)
    engine.wake_up()
    check_sleep_cycle(engine, None)
