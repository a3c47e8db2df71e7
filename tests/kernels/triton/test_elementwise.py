"""Triton reshape_and_cache, RMSNorm, rotary embedding and SiLU-and-mul vs torch references."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from pagoda.engine_core.attention.backend import apply_rope as _apply_rope  # noqa: E402
from pagoda.engine_core.models.llama import rope_inv_freq  # noqa: E402
from pagoda.kernels.triton_ops import reference as ref  # noqa: E402
from pagoda.kernels.triton_ops.activation import silu_and_mul  # noqa: E402
from pagoda.kernels.triton_ops.cache import reshape_and_cache  # noqa: E402
from pagoda.kernels.triton_ops.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from pagoda.kernels.triton_ops.rotary import rotary_embedding  # noqa: E402
from tests.kernels.triton.helpers import (  # noqa: E402
    DEVICE,
    FULL,
    check_close,
    poisoned,
    randn,
)

F32, BF16 = torch.float32, torch.bfloat16
TOKENS = [1, 7] + ([4096] if FULL else [])


@pytest.mark.parametrize("dtype,block_size", [(F32, 16), (BF16, 32)])
def test_reshape_and_cache(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_tokens, kv_heads, head_dim = (2048, 8, 128) if FULL else (9, 3, 64)
    num_blocks = -(-num_tokens // block_size) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype, gen=gen), randn(*shape, dtype=dtype, gen=gen)
    # key/value as strided views of a fused qkv projection, as the model makes them.
    qkv = randn(num_tokens, 4 * kv_heads * head_dim, dtype=dtype, gen=gen)
    qkv = qkv.view(num_tokens, 4 * kv_heads, head_dim)
    key, value = qkv[:, 2 * kv_heads : 3 * kv_heads], qkv[:, 3 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[num_tokens // 2] = -1  # a padding token: written nowhere
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    # A copy: exact. The written values differ from the random ones they replace.
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rms_norm_and_fused_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = 4096 if FULL else 96  # not a power of two
    for tokens in TOKENS:
        x = randn(tokens, hidden, dtype=dtype, gen=gen)
        residual = randn(tokens, hidden, dtype=dtype, gen=gen)
        weight = randn(hidden, dtype=dtype, gen=gen)
        out = poisoned(x.shape, dtype)
        rms_norm(x, weight, 1e-5, out=out)
        check_close(out, ref.rms_norm_ref(x, None, weight, 1e-5)[0], dtype, "rms_norm")

        expected, expected_res = ref.rms_norm_ref(x, residual, weight, 1e-5)
        assert expected_res is not None
        fused_add_rms_norm(x, residual, weight, 1e-5)  # in place
        check_close(x, expected, dtype, "fused_add_rms_norm out")
        check_close(residual, expected_res, dtype, "fused_add_rms_norm residual")


LLAMA3 = types.SimpleNamespace(
    head_dim=64,
    rope_theta=500000.0,
    rope_scaling_dict={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)


@pytest.mark.parametrize("dtype,is_neox", [(F32, True), (BF16, True), (F32, False), (BF16, False)])
def test_rotary_embedding(dtype: torch.dtype, is_neox: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim = (32, 8, 128) if FULL else (3, 1, 64)
    config = types.SimpleNamespace(**{**vars(LLAMA3), "head_dim": head_dim})
    inv_freq = rope_inv_freq(config)  # type: ignore[arg-type]
    cos, sin = ref.rope_cos_sin(inv_freq, 8192)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    for tokens in TOKENS:
        qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
        qkv = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
        q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]  # strided views, as in the model
        positions = torch.randint(0, 8192, (tokens,), generator=gen).to(DEVICE)
        q_ref = ref.rotary_ref(q, positions, cos, sin, is_neox)
        k_ref = ref.rotary_ref(k, positions, cos, sin, is_neox)
        v_before = qkv[:, heads + kv_heads :].clone()
        q_before = q.clone()
        rotary_embedding(positions, q, k, cos, sin, is_neox)
        check_close(q, q_ref, dtype, "rotary q")
        check_close(k, k_ref, dtype, "rotary k")
        assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v untouched
        if is_neox and dtype == F32:
            # The model's own torch rotary (neox, the CPU path) agrees too.
            model_q = _apply_rope(q_before, cos[positions][:, None], sin[positions][:, None])
            check_close(q, model_q, dtype, "model rope")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    inter = 14336 if FULL else 1100  # over one 1024-wide program, not a power of two
    for tokens in TOKENS:
        gate_up = randn(tokens, 2 * inter, dtype=dtype, gen=gen)
        out = poisoned((tokens, inter), dtype)
        silu_and_mul(gate_up, out=out)
        check_close(out, ref.silu_and_mul_ref(gate_up), dtype, "silu_and_mul")


def test_elementwise_launchers_reject_bad_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x = randn(2, 8, dtype=F32, gen=gen)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(4, dtype=F32, gen=gen), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        fused_add_rms_norm(x, x.to(BF16), randn(8, dtype=F32, gen=gen), 1e-5)
    with pytest.raises(ValueError, match="2 \\* inter"):
        silu_and_mul(randn(2, 7, dtype=F32, gen=gen))
    with pytest.raises(ValueError, match="unit stride"):
        silu_and_mul(randn(8, 4, dtype=F32, gen=gen).t())
    q = randn(2, 2, 8, dtype=F32, gen=gen)
    cos = randn(16, 4, dtype=F32, gen=gen)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.tensor([0, 1, 2]), q, q.clone(), cos, cos.clone())
    with pytest.raises(ValueError, match="head_dim / 2"):
        rotary_embedding(torch.tensor([0, 1]), q, q.clone(), cos[:, :2], cos[:, :2])
    cache = randn(4, 16, 2, 8, dtype=F32, gen=gen)
    with pytest.raises(ValueError, match="slot"):
        reshape_and_cache(q, q.clone(), cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="int32 or int64"):
        reshape_and_cache(q, q.clone(), cache, cache.clone(), torch.tensor([0.0, 1.0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_tensors_refused_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        silu_and_mul(torch.randn(2, 8))
