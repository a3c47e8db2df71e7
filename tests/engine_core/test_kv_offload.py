"""The host KV tier (--kv-transfer-config OffloadingConnector): prefix blocks
evicted from the device cache come back from host memory on a later prompt,
with the same output as recomputing them; and its bookkeeping alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.kv_offload import HostTier, offloading_bytes, offloading_disk
from pagoda.engine_core.model_config import load_model_config
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, random_prompts, run_to_completion


def test_the_tier_keeps_what_is_loaded_and_evicts_the_oldest() -> None:
    tier = HostTier(2)
    tier.save(7, 101)
    tier.save(8, 102)
    assert tier.take_copies() == ([(7, 0), (8, 1)], [])
    tier.load(101, 3)  # 101 becomes the newest
    tier.save(9, 103)  # evicts 102, the oldest, not 101 (being loaded)
    saves, loads = tier.take_copies()
    assert loads == [(0, 3)] and saves == [(9, 1)]
    assert 101 in tier and 103 in tier and 102 not in tier
    tier.save(10, 101)  # already kept: nothing to copy
    assert tier.take_copies() == ([], [])


def test_the_config_is_checked() -> None:
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": 9}}
    assert offloading_bytes(json.dumps(config)) == 9
    assert offloading_bytes(None) is None
    assert offloading_bytes('{"kv_connector": "PeerConnector"}') is None
    for bad, why in [
        ("{", "not JSON"),
        ('{"kv_connector": "NixlConnector"}', "not available"),
        ('{"kv_connector": "OffloadingConnector", "kv_role": "both"}', "kv_role"),
        ('{"kv_connector": "OffloadingConnector"}', "cpu_bytes"),
        (
            '{"kv_connector": "OffloadingConnector", '
            '"kv_connector_extra_config": {"cpu_bytes": 9, "disk_bytes": 9}}',
            "disk_dir",
        ),
    ]:
        with pytest.raises(ValueError, match=why):
            offloading_bytes(bad)
            offloading_disk(bad)


def engine_with(
    model: Path, host_blocks: int, disk_blocks: int = 0, disk_dir: Path | None = None
) -> EngineCore:
    mc = load_model_config(str(model))
    block_bytes = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    extra = {}
    if host_blocks:
        connector: dict[str, object] = {"cpu_bytes": host_blocks * block_bytes}
        if disk_blocks:
            connector.update(disk_dir=str(disk_dir), disk_bytes=disk_blocks * block_bytes)
        extra["kv_transfer_config"] = json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": connector,
            }
        )
    return EngineCore(
        EngineConfig(
            model=str(model),
            dtype="float32",
            kv_cache_memory_bytes=10 * block_bytes,  # two 64-token prompts at most
            num_threads=NUM_THREADS,
            **extra,  # type: ignore[arg-type]
        )
    )


@pytest.mark.parametrize(("host_blocks", "disk_blocks"), [(0, 0), (32, 0), (2, 30)])
def test_an_evicted_prompt_comes_back_from_host_memory(
    tiny_models: dict[str, Path], host_blocks: int, disk_blocks: int, tmp_path: Path
) -> None:
    """Without a tier, from memory slots, and mostly from the disk level's
    (two memory slots, thirty in a file)."""
    prompts = random_prompts(41, 4, 1000, 64, 64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = engine_with(tiny_models["llama"], host_blocks, disk_blocks, tmp_path / "kv")
    try:

        def run(request_id: str, prompt: list[int]) -> tuple[list[int], int]:
            add = AddRequest(request_id, prompt, params, 0.0)
            record = run_to_completion(engine, [add]).records[request_id]
            return record.token_ids, record.num_cached_tokens

        first, _ = run("a", prompts[0])
        for i in (1, 2, 3):  # push the first prompt's blocks out of the device cache
            run(f"other{i}", prompts[i])
        bm = engine.scheduler.block_manager
        again, cached = run("a-again", prompts[0])
        assert again == first
        if host_blocks:
            assert cached == 48  # 3 of its 4 blocks (the last token is always computed)
            assert bm.host_tier is not None and bm.host_tier.num_loaded >= 3
            assert bm.host_tier.num_slots == host_blocks + disk_blocks
            if disk_blocks:
                assert max(bm.host_tier.slots.values()) >= host_blocks
                assert list((tmp_path / "kv").iterdir()) == []  # the file is mapped, not named
        else:
            assert cached == 0 and bm.host_tier is None
    finally:
        engine.shutdown()
