"""The engine's features across worker ranks: structured output through
pipeline stages and tensor-parallel ranks, sleep / wake-up and profiling at
two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion
from tests.engine_core.test_structured_output import CONSTRAINTS, check, decode, prompts

pytestmark = pytest.mark.slow


def constrained_run(engine: EngineCore) -> dict[str, list[int]]:
    adds = []
    for i, ids in enumerate(prompts(engine)):
        for kind, constraint in [*CONSTRAINTS.items(), ("free", None)]:
            params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
            adds.append(AddRequest(f"{kind}-{i}", ids, params, 0.0))
    records = run_to_completion(engine, adds).records
    for request_id, record in records.items():
        kind = request_id.split("-")[0]
        if kind != "free":
            assert record.finish_reason == "stop", request_id
            check(kind, decode(engine, record.token_ids))
    return {request_id: r.token_ids for request_id, r in records.items()}


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (3, 1)])
def test_structured_output_across_ranks(tp: int, pp: int) -> None:
    """The grammar masks reach the sampling ranks (the last stage; every
    tensor-parallel rank): the default model's constrained greedy outputs are
    one rank's."""
    runs = {}
    for size, stages in ((1, 1), (tp, pp)):
        engine = EngineCore(
            EngineConfig(
                dtype="float32",
                kv_cache_memory_bytes=64 << 20,
                max_model_len=128,
                max_num_batched_tokens=64,
                num_threads=NUM_THREADS,
                tensor_parallel_size=size,
                pipeline_parallel_size=stages,
            )
        )
        try:
            runs[size, stages] = constrained_run(engine)
        finally:
            engine.shutdown()
    assert runs[tp, pp] == runs[1, 1]


def test_sleep_wake_and_profiles_at_two_ranks(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_models["llama"]),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            num_threads=NUM_THREADS,
            tensor_parallel_size=2,
            profiler_dir=str(tmp_path / "traces"),
        )
    )
    try:
        prompt_ids = random_prompts(4, 2, 1000, 5, 30)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        def run(tag: str) -> list[list[int]]:
            adds = [AddRequest(f"{tag}{i}", p, params, 0.0) for i, p in enumerate(prompt_ids)]
            records = run_to_completion(engine, adds).records
            return [records[f"{tag}{i}"].token_ids for i in range(len(prompt_ids))]

        before = run("a")
        for level in (1, 2):
            assert engine.sleep(level) and engine.is_sleeping()
            assert engine.wake_up() and not engine.is_sleeping()
            assert run(f"s{level}-") == before
        assert engine.start_profile()
        run("p")
        path = Path(engine.stop_profile())
        assert path.exists() and "rank0" in path.name
        traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
        assert [t.split("-rank")[1][0] for t in traces] == ["0", "1"]
    finally:
        engine.shutdown()
