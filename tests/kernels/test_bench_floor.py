"""The arithmetic behind scripts/bench_floor.py's floors, by hand for the default model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts import bench_floor


def test_default_model_work() -> None:
    shapes = bench_floor.model_shapes()
    # SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, MLP 1536, 30 layers.
    assert shapes["layers"] == 30
    assert shapes["qkv_flop"] == 2 * 576 * (576 + 2 * 192)
    assert shapes["rest_flop"] == 2 * (576 * 576 + 3 * 576 * 1536)
    assert shapes["pair_flop"] == 4 * 9 * 64
    assert shapes["head_flop"] == 2 * 576 * 49152
    assert shapes["kv_bytes"] == 30 * 2 * 192 * 2  # keys and values, bfloat16


SHAPES = {
    "layers": 3.0,
    "qkv_flop": 1e6,
    "rest_flop": 4e6,
    "pair_flop": 100.0,
    "head_flop": 5e6,
    "kv_bytes": 2e4,
}


def test_prompt_skips_the_last_layers_rest_for_all_but_one_token() -> None:
    # 2 tokens, 3 layers: q|k|v 6 times, the rest 2 + 2 + 1 times, 3 query-key
    # pairs (causal) in each layer, one head row.
    expected = 6 * 1e6 + 5 * 4e6 + 3 * 3 * 100 + 5e6
    assert bench_floor.prompt_flop(SHAPES, 2) == pytest.approx(expected)


def test_floors_from_peak_and_bandwidth() -> None:
    best = bench_floor.floors(peak=400.0, bandwidth=20.0, shapes=SHAPES)
    prompt_128 = bench_floor.prompt_flop(SHAPES, 128)
    assert best["ttft_128_ms"] == pytest.approx(prompt_128 / 400e9 * 1e3)
    assert best["short_32_req_s"] == pytest.approx(400e9 / bench_floor.prompt_flop(SHAPES, 32))
    positions = sum(range(129, 256))  # cached positions read decoding tokens 2..128
    flop = prompt_128 + 127 * (3 * 5e6 + 5e6)
    assert best["load_128_128_tok_s"] == pytest.approx(
        128 / (flop / 400e9 + positions * 2e4 / 20e9)
    )


@pytest.mark.skipif(
    shutil.which("cc") is None or "avx512_bf16" not in Path("/proc/cpuinfo").read_text(),
    reason="needs a C compiler and AVX512-BF16",
)
def test_peak_loop_runs() -> None:
    peak = bench_floor.peak_gflops(cores=1, rounds=1)
    # One Zen 4 core: ~230 GFLOP/s; anything this CPU kind does lies far inside.
    assert peak is not None and 20 < peak < 2000
