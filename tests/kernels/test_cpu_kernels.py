"""Compiled CPU kernels and packed linears against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagoda.kernels.linear
from pagoda.engine_core.attention.cpu_backend import CpuBackend, decode_attention, write_kv
from pagoda.kernels import cpu_ops
from pagoda.kernels.linear import (
    BLOCKS_MAX_ROWS,
    INT4_MAX_ROWS,
    SMALL_ROWS_MAX,
    BlockWeight,
    Linear,
    int4_available,
    pack_int4,
    padded_rows,
    reference_linear,
)
from pagoda.kernels.triton_ops.reference import causal_attention_ref

needs_compiled = pytest.mark.skipif(
    cpu_ops.load_cpu_ops() is None, reason="no C++ compiler for the CPU kernels"
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def make_paged(
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Random caches with each sequence's blocks scattered at random."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.long)
    per_seq = []
    for i, nb in enumerate(blocks_per_seq):
        ids = [order.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids)
        per_seq.append(ids)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(lens), per_seq


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_attention_matches_reference(
    dtype: torch.dtype, group: int, block_size: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + block_size + head_dim)
    kv_heads = 2
    heads = kv_heads * group
    # Ragged lengths: 1, exact block boundaries, one past, and a long one.
    lens = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 200]
    q, kc, vc, tables, seq_lens, per_seq = make_paged(
        lens, heads, kv_heads, head_dim, block_size, dtype, gen
    )
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, scale)
    assert not torch.isnan(out).any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, n in enumerate(lens):
        k = kc[per_seq[i]].flatten(0, 1)[:n]
        v = vc[per_seq[i]].flatten(0, 1)[:n]
        ref = causal_attention_ref(q[i : i + 1], k, v, scale)[0]
        assert rel_err(out[i], ref) < tol, (i, n)
    # The batched torch path agrees as well.
    torch_path = decode_attention(q, kc, vc, tables, seq_lens, max(lens), scale)
    assert rel_err(out, torch_path) < tol


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_decode_attention_reads_strided_rows_and_writes_out(dtype: torch.dtype) -> None:
    """Query rows as views of a wider projection row are read in place, and
    `out` is written in place: the same values as from a contiguous copy."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim = 6, 2, 64
    q, kc, vc, tables, seq_lens, _ = make_paged(
        [1, 17, 40, 200], heads, kv_heads, head_dim, 16, dtype, gen
    )
    wide = torch.randn(q.shape[0], (heads + 3) * head_dim, generator=gen).to(dtype)
    wide[:, head_dim : (heads + 1) * head_dim] = q.flatten(1)
    strided = wide[:, head_dim : (heads + 1) * head_dim].view(-1, heads, head_dim)
    assert not strided.is_contiguous()
    ref = cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    assert torch.equal(
        cpu_ops.paged_decode_attention(strided, kc, vc, tables, seq_lens, 0.125), ref
    )
    out = torch.full((q.shape[0] + 2, heads, head_dim), 7.0, dtype=dtype)
    cpu_ops.paged_decode_attention(strided, kc, vc, tables, seq_lens, 0.125, out=out[1:-1])
    assert torch.equal(out[1:-1], ref) and bool((out[0] == 7).all() and (out[-1] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, out=out[:2])


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_rows_match_causal_reference(dtype: torch.dtype, group: int, head_dim: int) -> None:
    """Prompt chunks as one query row per token over the sequence's table row:
    fresh prompts and chunks after cached context (a prefix hit, an earlier
    chunk), each token attending causally."""
    gen = torch.Generator().manual_seed(group * 7 + head_dim)
    kv_heads, block_size = 2, 16
    heads = kv_heads * group
    # (context before the chunk, chunk length) per sequence
    chunks = [(0, 1), (0, 37), (16, 16), (21, 40), (0, 130)]
    totals = [c + n for c, n in chunks]
    _, kc, vc, tables, _, per_seq = make_paged(
        totals, heads, kv_heads, head_dim, block_size, dtype, gen
    )
    num_tokens = sum(n for _, n in chunks)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    rows = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(chunks)])
    lens = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in chunks])
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, scale, table_rows=rows)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    start = 0
    for i, (context, n) in enumerate(chunks):
        k = kc[per_seq[i]].flatten(0, 1)[: context + n]
        v = vc[per_seq[i]].flatten(0, 1)[: context + n]
        ref = causal_attention_ref(q[start : start + n].float(), k.float(), v.float(), scale)
        assert rel_err(out[start : start + n], ref) < tol, (context, n)
        start += n


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_split_by_cost_give_the_same_bits(dtype: torch.dtype) -> None:
    """Rows are shared out between threads by the positions they read (a
    fresh prompt's last rows read the most): each row's result is the same
    bits whatever the thread count, for a prompt chunk next to decode rows."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    chunk, decode_lens = 150, [3, 90, 400]
    totals = [chunk, *decode_lens]
    _, kc, vc, tables, _, _ = make_paged(totals, heads, kv_heads, head_dim, block_size, dtype, gen)
    rows = torch.tensor([0] * chunk + [1, 2, 3])
    lens = torch.cat([torch.arange(1, chunk + 1), torch.tensor(decode_lens)])
    q = torch.randn(len(rows), heads, head_dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(
                cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, table_rows=rows)
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_write_kv_slots_is_index_copy(dtype: torch.dtype, tokens: int) -> None:
    """A prompt's keys and values, strided views of a fused qkv row, stored at
    their slots exactly as index_copy_ stores them; one bad slot and nothing
    is written."""
    gen = torch.Generator().manual_seed(tokens)
    kc, vc = torch.zeros(2, 40, 16, 2, 64, dtype=dtype)
    qkv = torch.randn(tokens, (6 + 2 * 2) * 64, generator=gen).to(dtype)
    _, k, v = (t.view(tokens, -1, 64) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], -1))
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    kc2, vc2 = kc.clone(), vc.clone()
    cpu_ops.write_kv_slots(k, v, kc, vc, slots)
    write_kv(k, v.contiguous(), kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    bad = slots.clone()
    bad[-1] = -1
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.write_kv_slots(k * 2, v * 2, kc, vc, bad)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(RuntimeError, match="one per row"):
        cpu_ops.write_kv_slots(k, v, kc, vc, slots[:-1] if tokens > 1 else slots[:0])


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_decode_attention_is_write_then_attend(dtype: torch.dtype) -> None:
    """The one-call decode paths store k and v (strided views of a fused qkv
    row) at their slots and attend exactly as write_kv then the kernel; from
    the fused projection, after the same rotary embedding."""
    gen = torch.Generator().manual_seed(11)
    lens = [1, 16, 17, 90]
    _, kc, vc, tables, seq_lens, per_seq = make_paged(lens, 6, 2, 64, 16, dtype, gen)
    qkv = torch.randn(len(lens), (6 + 2 * 2) * 64, generator=gen).to(dtype)
    q, k, v = (t.view(len(lens), -1, 64) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], -1))
    slots = torch.tensor(
        [ids[(n - 1) // 16] * 16 + (n - 1) % 16 for ids, n in zip(per_seq, lens, strict=True)]
    )
    kc2, vc2 = kc.clone(), vc.clone()
    out = cpu_ops.write_kv_decode_attention(q, k, v, kc, vc, slots, tables, seq_lens, 0.125)
    write_kv(k, v.contiguous(), kc2, vc2, slots)
    ref = cpu_ops.paged_decode_attention(q, kc2, vc2, tables, seq_lens, 0.125)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = slots.clone()
        bad[2] = kc.shape[0] * 16
        cpu_ops.write_kv_decode_attention(q, k, v, kc, vc, bad, tables, seq_lens, 0.125)

    # From the fused projection: the rotary embedding first, then the same.
    cos, sin = torch.randn(2, 256, 32, generator=gen).to(dtype)
    positions = seq_lens - 1
    kc3, vc3 = kc2.clone(), vc2.clone()
    fused = cpu_ops.qkv_decode_attention(
        qkv.clone(), 6, positions, cos, sin, kc3, vc3, slots, tables, seq_lens, 0.125
    )
    cpu_ops.rotary_embedding(q, k, positions, cos, sin)
    ref = cpu_ops.write_kv_decode_attention(q, k, v, kc2, vc2, slots, tables, seq_lens, 0.125)
    assert torch.equal(kc3, kc2) and torch.equal(vc3, vc2)
    assert torch.equal(fused, ref)


def heads_first_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored as the engine stores it on the CPU: the
    transpose(1, 2) view of a contiguous [blocks, kv_heads, block_size, dim]."""
    blocks, block_size, kv_heads, dim = cache.shape
    stored = cache.new_empty(blocks, kv_heads, block_size, dim).transpose(1, 2)
    assert cpu_ops.heads_first(stored) and not stored.is_contiguous()
    return stored.copy_(cache)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_heads_first_caches_give_the_same_bits(dtype: torch.dtype) -> None:
    """Every cache path reads and writes a heads-first cache in place, with
    the same results to the bit as on a contiguous one: decode rows, prompt
    rows, the slot writes (compiled and torch), the one-call decode paths and
    the torch decode path."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 16, 17, 90, 200]
    q, kc, vc, tables, seq_lens, per_seq = make_paged(lens, 9, 3, 64, 16, dtype, gen)
    hk, hv = heads_first_copy(kc), heads_first_copy(vc)
    ref = cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    assert torch.equal(cpu_ops.paged_decode_attention(q, hk, hv, tables, seq_lens, 0.125), ref)
    rows = torch.tensor([4] * 50)
    prompt_lens = torch.arange(151, 201)
    qp = torch.randn(50, 9, 64, generator=gen).to(dtype)
    assert torch.equal(
        cpu_ops.paged_decode_attention(qp, hk, hv, tables, prompt_lens, 0.125, table_rows=rows),
        cpu_ops.paged_decode_attention(qp, kc, vc, tables, prompt_lens, 0.125, table_rows=rows),
    )
    assert torch.equal(
        decode_attention(q, hk, hv, tables, seq_lens, 200, 0.125),
        decode_attention(q, kc, vc, tables, seq_lens, 200, 0.125),
    )

    # Writes: a step's keys and values at the next slot of each sequence.
    qkv = torch.randn(len(lens), (9 + 2 * 3) * 64, generator=gen).to(dtype)
    qs, k, v = (t.view(len(lens), -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], -1))
    slots = torch.tensor(
        [ids[n // 16] * 16 + n % 16 if n % 16 else -1 for ids, n in zip(per_seq, lens, strict=True)]
    )
    keep = slots >= 0  # sequences whose next position is inside their last block
    slots, qs, k, v = slots[keep], qs[keep], k[keep], v[keep]
    after = seq_lens[keep] + 1
    sub_tables = tables[keep]
    for write in ("compiled", "torch"):
        kc2, vc2, hk2, hv2 = kc.clone(), vc.clone(), heads_first_copy(kc), heads_first_copy(vc)
        if write == "compiled":
            cpu_ops.write_kv_slots(k, v, kc2, vc2, slots)
            cpu_ops.write_kv_slots(k, v, hk2, hv2, slots)
        else:
            write_kv(k, v.contiguous(), kc2, vc2, slots)
            write_kv(k, v.contiguous(), hk2, hv2, slots)
        assert torch.equal(hk2, kc2) and torch.equal(hv2, vc2), write
    hk3, hv3 = heads_first_copy(kc), heads_first_copy(vc)
    out = cpu_ops.write_kv_decode_attention(qs, k, v, hk3, hv3, slots, sub_tables, after, 0.125)
    ref = cpu_ops.paged_decode_attention(qs, kc2, vc2, sub_tables, after, 0.125)
    assert torch.equal(out, ref) and torch.equal(hk3, kc2) and torch.equal(hv3, vc2)
    cos, sin = torch.randn(2, 256, 32, generator=gen).to(dtype)
    fused = qkv[keep].clone()
    kc4, vc4, hk4, hv4 = kc.clone(), vc.clone(), heads_first_copy(kc), heads_first_copy(vc)
    args = (after - 1, cos, sin)
    a = cpu_ops.qkv_decode_attention(
        fused.clone(), 9, *args, kc4, vc4, slots, sub_tables, after, 0.125
    )
    b = cpu_ops.qkv_decode_attention(
        fused.clone(), 9, *args, hk4, hv4, slots, sub_tables, after, 0.125
    )
    assert torch.equal(a, b) and torch.equal(hk4, kc4) and torch.equal(hv4, vc4)


@needs_compiled
def test_caches_in_another_layout_are_read_from_a_copy_and_never_written() -> None:
    """Attention reads a cache of any other layout from a contiguous copy; the
    slot writes refuse one (a copy would lose the write)."""
    gen = torch.Generator().manual_seed(9)
    q, kc, vc, tables, seq_lens, _ = make_paged([5, 40], 6, 2, 64, 16, torch.float32, gen)
    # Blocks first, then kv heads, with positions strided: neither layout.
    odd_k = kc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    odd_v = vc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert not odd_k.is_contiguous() and not cpu_ops.heads_first(odd_k)
    ref = cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    assert torch.equal(
        cpu_ops.paged_decode_attention(q, odd_k, odd_v, tables, seq_lens, 0.125), ref
    )
    k = torch.randn(1, 2, 64, generator=gen)
    with pytest.raises(RuntimeError, match="transpose"):
        cpu_ops.write_kv_slots(k, k, odd_k, odd_v, torch.tensor([3]))


@needs_compiled
@pytest.mark.skipif(not cpu_ops.has_bf16_attention(), reason="no AVX512-BF16 kernel here")
def test_bf16_attention_is_float32_attention_rounded_once() -> None:
    """The AVX512-BF16 kernel multiplies bfloat16 values exactly and sums in
    float32; like flash attention it rounds the softmax numerators to
    bfloat16 for p . v. Its output is that computation in float32 rounded
    once, up to float32 summation order and the exp approximation (here: at
    most one bfloat16 step on a few elements)."""
    gen = torch.Generator().manual_seed(5)
    lens = [1, 15, 16, 17, 190]
    q, kc, vc, tables, seq_lens, per_seq = make_paged(lens, 9, 3, 64, 16, torch.bfloat16, gen)
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    for i, n in enumerate(lens):
        k = kc[per_seq[i]].flatten(0, 1)[:n].float().repeat_interleave(3, dim=1)
        v = vc[per_seq[i]].flatten(0, 1)[:n].float().repeat_interleave(3, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), k) * 0.125
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        ref = torch.einsum("hk,khd->hd", e.bfloat16().float(), v) / e.sum(-1, keepdim=True)
        exact = out[i] == ref.bfloat16()
        assert exact.float().mean() > 0.99, (n, exact.float().mean())
        # and within bfloat16 noise of attention computed wholly in float32
        full = causal_attention_ref(q[i : i + 1].float(), k[:, ::3], v[:, ::3], 0.125)[0]
        assert rel_err(out[i], full) < 1e-2, n


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [0, 1, 300])
def test_a_single_row_matches_reference(dtype: torch.dtype, length: int) -> None:
    """One decoding sequence: fewer rows than threads, where the work is split
    by kv head instead of by row."""
    gen = torch.Generator().manual_seed(length)
    q, kc, vc, tables, _, per_seq = make_paged([max(length, 1)], 9, 3, 64, 16, dtype, gen)
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, torch.tensor([length]), 0.125)
    if length == 0:
        assert not out.any()
        return
    k = kc[per_seq[0]].flatten(0, 1)[:length]
    v = vc[per_seq[0]].flatten(0, 1)[:length]
    ref = causal_attention_ref(q.float(), k.float(), v.float(), 0.125)[0]
    assert rel_err(out[0], ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_with_nothing_to_attend_to_is_zero(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, tables, _, per_seq = make_paged([5, 40], 6, 2, 64, 16, dtype, gen)
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, torch.tensor([0, 40]), 0.125)
    assert not out[0].any()
    k = kc[per_seq[1]].flatten(0, 1)[:40]
    v = vc[per_seq[1]].flatten(0, 1)[:40]
    ref = causal_attention_ref(q[1:2].float(), k.float(), v.float(), 0.125)[0]
    assert rel_err(out[1], ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_compiled
def test_paged_decode_attention_rejects_bad_shapes() -> None:
    q = torch.randn(2, 4, 64)
    kc = torch.randn(8, 16, 2, 64)
    tables = torch.zeros(2, 1, dtype=torch.long)
    lens = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="int64"):
        cpu_ops.paged_decode_attention(q, kc, kc, tables.int(), lens, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.paged_decode_attention(q.bfloat16(), kc, kc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_ops.paged_decode_attention(torch.randn(2, 4, 32), kc, kc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="batch"):
        cpu_ops.paged_decode_attention(q, kc, kc, tables, torch.tensor([3]), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 9, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype: torch.dtype, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    out = Linear(w, b)(x)
    ref = reference_linear(x, w, b)
    assert out.shape == (rows, 96)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


needs_pairs = pytest.mark.skipif(
    not (cpu_ops.load_cpu_ops() is not None and cpu_ops.has_bf16_pairs()),
    reason="the bfloat16 pairs kernel needs AVX512-BF16",
)


@needs_pairs
@pytest.mark.parametrize("shape", [(96, 80), (50, 7), (49, 1), (1000, 33)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_pairs_kernel_is_float32_product_rounded_once(
    shape: tuple[int, int], rows: int, bias: bool
) -> None:
    """Any output width (tiles of 48, the last one partial), odd input counts
    (the last input paired with a zero), row counts across register blocks
    of 8 and row groups of 64, strided x rows: x W^T (+ b) in float32 sums,
    rounded once to bfloat16, as oneDNN's bfloat16 matmul gives it."""
    outs, ins = shape
    gen = torch.Generator().manual_seed(rows * 7 + ins)
    w = torch.randn(outs, ins, generator=gen).bfloat16()
    b = torch.randn(outs, generator=gen).bfloat16() if bias else None
    wide = torch.randn(rows, ins + 5, generator=gen).bfloat16()
    x = wide[:, 2 : 2 + ins]  # rows strided by ins + 5
    packed = cpu_ops.pack_bf16_pairs(w)
    assert packed.shape == (-(-outs // 48), (ins + 1) // 2, 48, 2)
    out = cpu_ops.linear_bf16_pairs(x, packed, outs, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.shape == (rows, outs) and out.dtype == torch.bfloat16
    # One rounding of the float32 sum: within one bfloat16 step of the exact
    # product rounded, and equal to it almost everywhere.
    exact = ref.bfloat16()
    step = exact.float().abs() * 2**-7 + 1e-30
    assert ((out.float() - exact.float()).abs() <= step).all()
    assert (out == exact).float().mean() > 0.98
    onednn = F.linear(x, w, b)
    assert (out == onednn).float().mean() > 0.98
    # float_out: the same float32 sums, unrounded (the logits head's form)
    sums = cpu_ops.linear_bf16_pairs(x, packed, outs, b, float_out=True)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), out)
    assert torch.allclose(sums.double(), ref, rtol=1e-5, atol=1e-4)


@needs_pairs
@pytest.mark.parametrize("shape", [(1536, 576), (50, 33), (24, 8), (7, 5), (17, 9)])
@pytest.mark.parametrize("rows", [1, 9, 64, 130])
def test_bf16_pairs_gated_forms_equal_the_plain_projection(
    shape: tuple[int, int], rows: int
) -> None:
    """gate|up packed with glu=True (24 units' gate and up columns a tile,
    the last tile partial): GLU_CONCAT gives exactly the plain projection,
    GLU_SILU_MUL exactly silu_and_mul of it (the one compiled arithmetic),
    which is torch's unfused silu(gate) * up almost everywhere."""
    units, ins = shape
    gen = torch.Generator().manual_seed(units + rows)
    w = torch.randn(2 * units, ins, generator=gen).bfloat16()
    x = torch.randn(rows, ins + 3, generator=gen).bfloat16()[:, 1 : 1 + ins]
    plain = cpu_ops.linear_bf16_pairs(x, cpu_ops.pack_bf16_pairs(w), 2 * units)
    packed = cpu_ops.pack_bf16_pairs(w, glu=True)
    assert packed.shape == (-(-units // 24), (ins + 1) // 2, 48, 2)
    assert torch.equal(
        cpu_ops.linear_bf16_pairs(x, packed, 2 * units, glu=cpu_ops.GLU_CONCAT), plain
    )
    act = cpu_ops.linear_bf16_pairs(x, packed, 2 * units, glu=cpu_ops.GLU_SILU_MUL)
    assert act.shape == (rows, units) and torch.equal(act, cpu_ops.silu_and_mul(plain))
    gate, up = plain.chunk(2, dim=-1)
    # torch's exp now and then rounds silu one step apart, which the product
    # can carry to two steps.
    ref = F.silu(gate) * up
    assert ((act.float() - ref.float()).abs() <= ref.float().abs() * 2**-6 + 1e-6).all()
    assert int((act != ref).sum()) <= max(1, act.numel() // 200)


@needs_pairs
def test_linear_gate_up_fuses_silu_and_mul() -> None:
    from pagoda.kernels.linear import Linear

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(2 * 100, 64, generator=gen).bfloat16()
    x = torch.randn(16, 64, generator=gen).bfloat16()
    fused = Linear(w, glu=True)
    assert fused.glu and fused.float32_sums(x) is None
    assert torch.equal(fused(x), Linear(w)(x))
    act = fused.silu_and_mul(x)
    assert act is not None and torch.equal(act, cpu_ops.silu_and_mul(fused(x)))
    assert Linear(w).silu_and_mul(x) is None  # not packed for it
    # A bias keeps the plain layout (the gated forms take none).
    biased = Linear(w, torch.zeros(200).bfloat16(), glu=True)
    assert not biased.glu and biased.silu_and_mul(x) is None


@needs_pairs
def test_bf16_pairs_gated_forms_check_their_inputs() -> None:
    w = torch.randn(2 * 30, 8).bfloat16()
    glu = cpu_ops.pack_bf16_pairs(w, glu=True)
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="gated forms"):
        cpu_ops.linear_bf16_pairs(x, glu, 60, torch.zeros(60), glu=cpu_ops.GLU_SILU_MUL)
    with pytest.raises(RuntimeError, match="gated forms"):
        cpu_ops.linear_bf16_pairs(x, glu, 60, float_out=True, glu=cpu_ops.GLU_CONCAT)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.linear_bf16_pairs(x, glu, 120, glu=cpu_ops.GLU_SILU_MUL)
    with pytest.raises(RuntimeError, match="glu must be"):
        cpu_ops.linear_bf16_pairs(x, glu, 60, glu=3)
    with pytest.raises(ValueError, match="even number"):
        cpu_ops.pack_bf16_pairs(w[:59], glu=True)


@needs_pairs
def test_bf16_pairs_kernel_checks_its_inputs() -> None:
    w = torch.randn(50, 8).bfloat16()
    packed = cpu_ops.pack_bf16_pairs(w)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.linear_bf16_pairs(torch.randn(2, 10).bfloat16(), packed, 50)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.linear_bf16_pairs(torch.randn(2, 8).bfloat16(), packed, 97)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.linear_bf16_pairs(torch.randn(2, 8), packed, 50)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_ops.pack_bf16_pairs(w.float())
    assert cpu_ops.linear_bf16_pairs(torch.randn(0, 8).bfloat16(), packed, 50).shape == (0, 50)


@needs_pairs
def test_bf16_linear_runs_on_the_pairs_kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AVX512-BF16 without AMX a bfloat16 Linear keeps one copy, the pairs,
    used at every row count: no oneDNN copy, no plain copy, no GGUF blocks.
    With AMX, oneDNN's copy as before."""
    monkeypatch.setattr(cpu_ops, "cpu_has_flag", lambda flag: False)
    weight, dense = random_q4(40, 64, seed=11)
    w = dense.bfloat16()
    linear = Linear(w, None, small_rows=True, blocks=weight)
    assert linear.pairs is not None and linear.weight is linear.pairs
    assert linear.plain is None and linear.blocks is None
    gen = torch.Generator().manual_seed(12)
    for rows in (1, 4, 300):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        assert rel_err(linear(x), reference_linear(x, w)) < 1e-2
    linear.pairs.zero_()  # the only copy: every row count reads it
    for rows in (1, 4, 300):
        assert not linear(torch.randn(rows, 64).bfloat16()).any()
    monkeypatch.setattr(cpu_ops, "cpu_has_flag", lambda flag: flag == "amx_bf16")
    assert Linear(w).pairs is None
    assert Linear(w.float()).pairs is None


@pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul")
@pytest.mark.parametrize("rows", [1, 6, 7, 16])
def test_int4_linear_matches_its_dequantized_weights(rows: int) -> None:
    """Small batches run on the 4-bit weights, larger ones on the dense copy;
    both compute x W^T for W = (q - 8) * scale + zero."""
    gen = torch.Generator().manual_seed(rows)
    out_f, in_f, group = 96, 128, 32
    q = torch.randint(0, 16, (out_f, in_f), generator=gen)
    scale = torch.rand(out_f, in_f // group, generator=gen) * 0.02
    zero = torch.randn(out_f, in_f // group, generator=gen) * 0.05
    dense = ((q.float() - 8).view(out_f, -1, group) * scale[..., None] + zero[..., None]).view(
        out_f, in_f
    )
    bias = torch.randn(out_f, generator=gen).to(torch.bfloat16)
    linear = Linear(dense.to(torch.bfloat16), bias, pack_int4(q, scale, zero))
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    out = linear(x)
    assert out.shape == (rows, out_f) and out.dtype == torch.bfloat16
    ref = F.linear(x.float(), dense, bias.float())
    assert rel_err(out, ref) < 2e-2
    # Which copy ran: with a zero dense copy only the 4-bit path gives x W^T.
    routed = Linear(torch.zeros_like(dense, dtype=torch.bfloat16), None, linear.int4)(x)
    if rows <= INT4_MAX_ROWS:
        assert rel_err(routed, ref - bias.float()) < 2e-2
    else:
        assert not routed.any()


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "outs", "ins"), [(1, 96, 80), (2, 7, 13), (3, 1, 8), (5, 130, 576)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_linear_matches_reference(
    dtype: torch.dtype, rows: int, outs: int, ins: int, bias: bool
) -> None:
    """The few-row kernel: tiles past the ends of rows, outputs and the input
    width, strided rows of x, half-precision weights converted in registers."""
    gen = torch.Generator().manual_seed(rows * 1000 + outs)
    w = torch.randn(outs, ins, generator=gen).to(dtype)
    b = torch.randn(outs, generator=gen).to(dtype) if bias else None
    wide = torch.randn(rows, ins + 5, generator=gen).to(dtype)
    x = wide[:, 2 : 2 + ins]  # rows of stride ins + 5
    out = cpu_ops.linear_small_rows(x, w, b)
    assert out.shape == (rows, outs) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    if dtype == torch.float32:
        # Sums of up to 576 products ~N(0, 1) in another order than the
        # reference's: a few 1e-5 apart at most.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:  # float32 sums, rounded once to the activation dtype
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=1e-2, atol=2e-2)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batches_run_on_the_plain_weights(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to SMALL_ROWS_MAX rows a Linear built with small_rows reads its plain
    copy; above, the packed one. Both give x W^T."""
    monkeypatch.setattr(cpu_ops, "cpu_has_native", lambda dtype: True)
    monkeypatch.setattr(pagoda.kernels.linear, "pairs_available", lambda: False)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=gen).to(dtype)
    linear = Linear(w, None, small_rows=True)
    if not linear.packed:
        pytest.skip("oneDNN packing is unavailable")
    limit = SMALL_ROWS_MAX[dtype]
    assert linear.plain is not None and linear.small_rows_max == limit
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        assert rel_err(linear(x), reference_linear(x, w)) < (
            1e-6 if dtype == torch.float32 else 1e-2
        )
    # Which copy ran: with the plain copy zeroed only the packed path gives x W^T.
    linear.plain.zero_()
    assert not linear(torch.randn(limit, 64).to(dtype)).any()
    assert linear(torch.randn(limit + 1, 64).to(dtype)).any()
    assert Linear(w).plain is None  # not asked for: no second copy


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_without_hardware_runs_on_the_kernel_only(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without hardware half-precision arithmetic a Linear keeps one plain copy,
    used at every row count, whether or not the model asked for small_rows."""
    monkeypatch.setattr(cpu_ops, "cpu_has_native", lambda dtype: dtype == torch.float32)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    for small_rows in (False, True):
        linear = Linear(w, b, small_rows=small_rows)
        if linear.plain is None:
            pytest.skip("oneDNN packing is unavailable")
        assert not linear.packed and linear.weight is linear.plain
        for rows in (1, 17, 300):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            assert rel_err(linear(x), reference_linear(x, w, b)) < 1e-2
        linear.plain.zero_()  # the only copy: every row count reads it
        assert not (linear(torch.randn(300, 64).to(dtype)) - b).any()
    assert Linear(w.float()).plain is None  # float32 is always native


@needs_compiled
def test_small_rows_linear_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_ops.linear_small_rows(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="weight expects 8"):
        cpu_ops.linear_small_rows(torch.randn(2, 7), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="bias must have 4"):
        cpu_ops.linear_small_rows(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


def random_q4(outs: int, ins: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """GGUF-style Q4_1 blocks with float16 scales and offsets, and the float32
    weights a dequantizer makes of them: q * d + m, rounded once."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (outs, ins), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(outs, ins // 32, generator=gen) * 0.05 + 1e-3).half().float()
    offset = (-8 * scale * torch.rand(outs, ins // 32, generator=gen)).half().float()
    blocks = q.view(outs, -1, 2, 16)  # per block: elements 0-15, then 16-31
    codes = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(outs, ins // 2).contiguous()
    dense = (
        q.double().view(outs, -1, 32) * scale.double()[..., None] + offset.double()[..., None]
    ).float()  # exact product, one rounding of the sum
    return BlockWeight(codes, scale, offset), dense.view(outs, ins)


def random_q8(outs: int, ins: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """GGUF-style Q8_0 blocks and their float32 weights, q * d (exact)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (outs, ins), generator=gen, dtype=torch.int8)
    scale = (torch.rand(outs, ins // 32, generator=gen) * 0.01 + 1e-4).half().float()
    dense = (codes.float().view(outs, -1, 32) * scale[..., None]).view(outs, ins)
    return BlockWeight(codes, scale, None), dense


@needs_compiled
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_block_linear_matches_its_dequantized_weights(
    rows: int, dtype: torch.dtype, kind: str
) -> None:
    """The 4-bit and 8-bit kernels rebuild exactly the dequantized float32
    weights: only the order of the float32 sums differs from x W^T; every
    tile width (1-4 rows), strided rows of x, a bias, half-precision
    activations."""
    weight, dense = (random_q4 if kind == "q4" else random_q8)(37, 96, seed=rows)
    gen = torch.Generator().manual_seed(rows + 100)
    bias = torch.randn(37, generator=gen)
    wide = torch.randn(rows, 96 + 3, generator=gen)
    x = wide[:, 1:97]
    out = weight.matmul(x.to(dtype), bias.to(dtype))
    assert out.shape == (rows, 37) and out.dtype == dtype
    ref = F.linear(x.to(dtype).double(), dense.double(), bias.to(dtype).double())
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # float32 sums, rounded once to the activation dtype
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=1e-2, atol=2e-2)


@needs_compiled
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_blocks_uses_them_for_few_rows(
    dtype: torch.dtype, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to BLOCKS_MAX_ROWS rows (float32's where the CPU lacks hardware for
    the dtype) a Linear with GGUF blocks reads them (no plain copy is kept);
    above, the dense weights. Both give x W^T."""
    monkeypatch.setattr(cpu_ops, "cpu_has_native", lambda d: native or d == torch.float32)
    monkeypatch.setattr(pagoda.kernels.linear, "pairs_available", lambda: False)
    weight, dense = random_q4(40, 64, seed=5)
    linear = Linear(dense.to(dtype), None, small_rows=True, blocks=weight)
    limit = BLOCKS_MAX_ROWS[dtype if native else torch.float32]
    assert linear.blocks_max_rows == limit
    assert linear.plain is None or not native  # without hardware: the only copy
    gen = torch.Generator().manual_seed(6)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        ref = reference_linear(x.float(), dense)
        assert rel_err(linear(x), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    weight.scale.zero_()
    assert weight.offset is not None
    weight.offset.zero_()
    assert not linear(torch.randn(limit, 64).to(dtype)).any()
    assert linear(torch.randn(limit + 1, 64).to(dtype)).any()


@needs_compiled
def test_block_linears_reject_bad_input() -> None:
    weight, _ = random_q4(4, 64, seed=7)
    codes, scale, offset = weight.codes, weight.scale, weight.offset
    assert offset is not None
    with pytest.raises(RuntimeError, match="not whole 32-element blocks"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 48), codes[:, :24], scale, offset)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 64), codes.int(), scale, offset)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 96), codes, scale, offset)
    with pytest.raises(RuntimeError, match="scale and offset must be"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 64), codes, scale[:3], offset)
    with pytest.raises(RuntimeError, match="scale and offset must be"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 64), codes, scale, offset.half())
    with pytest.raises(RuntimeError, match="bias must have 4"):
        cpu_ops.linear_q4_small_rows(torch.randn(2, 64), codes, scale, offset, torch.randn(5))
    q8, _ = random_q8(4, 64, seed=8)
    with pytest.raises(RuntimeError, match="codes must be int8"):
        cpu_ops.linear_q8_small_rows(torch.randn(2, 64), codes, scale)  # 4-bit codes
    with pytest.raises(RuntimeError, match="scale and offset must be"):
        cpu_ops.linear_q8_small_rows(torch.randn(2, 64), q8.codes, q8.scale.double())
    with pytest.raises(RuntimeError, match="dtype|float32, bfloat16 or float16"):
        cpu_ops.linear_q8_small_rows(torch.randn(2, 64).double(), q8.codes, q8.scale)


def test_padded_rows_are_few_and_waste_little() -> None:
    buckets = [padded_rows(m) for m in range(1, 16385)]
    assert all(b >= m for m, b in enumerate(buckets, 1))
    assert all(b - m < 8 for m, b in enumerate(buckets[:64], 1))  # bandwidth-bound sizes
    assert all(b <= m * 1.125 for m, b in enumerate(buckets[64:], 65))
    assert buckets[:8] == list(range(1, 9))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 80  # so oneDNN's per-shape caches stay small


def reference_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' order of operations: add, normalize in float32, cast, scale."""
    summed = residual + x
    xf = summed.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), summed


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    ref_out, ref_sum = reference_add_rms_norm(x, residual, weight, 1e-5)
    cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, ref_sum)  # same rounding of the sum
    assert rel_err(x, ref_out) < (1e-6 if dtype == torch.float32 else 1e-2)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows + 100)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(dtype)
    out = cpu_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@needs_compiled
def test_bf16_fused_ops_round_as_torch_does() -> None:
    """The vectorized bfloat16 rounding: nearest even as torch's cast, NaN kept."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 576, generator=gen).bfloat16()
    residual = torch.randn(64, 576, generator=gen).bfloat16()
    x[3, 5] = float("nan")
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    ref_out, ref_sum = reference_add_rms_norm(x, residual, weight, 1e-5)
    cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual.isnan(), ref_sum.isnan()) and bool(residual[3].isnan().any())
    finite = ~ref_sum.isnan()
    assert torch.equal(residual[finite], ref_sum[finite])
    rows = [r for r in range(64) if r != 3]
    same = (x[rows] == ref_out[rows]).float().mean().item()
    assert same > 0.99  # the row's sum of squares is taken in another order
    assert bool(x[3].isnan().all())

    gate_up = (torch.randn(64, 2 * 1536, generator=gen) * 4).bfloat16()
    gate_up[0, 0] = float("nan")
    out = cpu_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert bool(out[0, 0].isnan())
    # torch's own SiLU takes exp from another approximation per CPU (~0.1%
    # of these products round one step apart on an AVX512 CPU).
    assert (out[1:] == ref[1:]).float().mean().item() > 0.998


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_embedding_in_place_on_qkv_views(dtype: torch.dtype) -> None:
    """In place on the q and k views of one fused projection; v untouched.
    Equal to the unfused torch rope (the same products rounded the same way)."""
    from pagoda.engine_core.attention.backend import apply_rope as _apply_rope

    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 37, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    before = qkv.clone()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.outer(torch.arange(512.0), torch.rand(head_dim // 2, generator=gen))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    ref_q = _apply_rope(q.clone(), cos[positions][:, None], sin[positions][:, None])
    ref_k = _apply_rope(k.clone(), cos[positions][:, None], sin[positions][:, None])
    cpu_ops.rotary_embedding(q, k, positions, cos, sin)
    if dtype == torch.float32:
        assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6
    else:
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, before[:, (heads + kv_heads) * head_dim :])
    # A position past either end of the tables is refused before anything rotates.
    rotated = q.clone()
    for bad in (positions + 512 - positions.max(), positions - positions.min() - 1):
        with pytest.raises(RuntimeError, match="outside the rotary tables"):
            cpu_ops.rotary_embedding(q, k, bad, cos, sin)
    assert torch.equal(q, rotated)
    with pytest.raises(ValueError, match="int64"):
        cpu_ops.rotary_embedding(q, k, positions.int(), cos, sin)


@needs_compiled
def test_fused_launchers_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_ops.fused_add_rms_norm(
            torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-5
        )
    with pytest.raises(ValueError, match="2 \\* inter"):
        cpu_ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.silu_and_mul(torch.randn(8, 4).t())


@needs_compiled
@pytest.mark.parametrize("bias", [False, True])
def test_refined_logits_order_near_ties_by_float32(bias: bool) -> None:
    """bfloat16 logits of ~20 are rounded in steps of 0.125: here two tokens
    tie after rounding though float32 separates them. The refinement recomputes
    the leading logits in float32, compiled and torch forms alike."""
    from pagoda.engine_core.models.llama import _MANTISSA_BITS, _MAX_REFINED_PER_ROW, LlamaModel

    gen = torch.Generator().manual_seed(11)
    vocab, dim, rows = 500, 64, 6
    hidden = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.3).to(torch.bfloat16)
    b = (torch.randn(vocab, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    exact = hidden.float() @ weight.float().T + (b.float() if b is not None else 0)
    # Make token 7 and token 9 near-tied leaders of row 0: 20.03 and 20.01.
    for token, target in ((7, 20.03), (9, 20.01)):
        w = weight[token].float()
        w += (target - exact[0, token]) * hidden[0].float() / hidden[0].float().square().sum()
        weight[token] = w.to(torch.bfloat16)
    exact = hidden.float() @ weight.float().T + (b.float() if b is not None else 0)
    rounded = F.linear(hidden, weight, b).float()
    results = []
    for compiled in (True, False):
        logits = rounded.clone()
        if compiled:
            cpu_ops.refine_leading_logits(
                logits, hidden, weight, b, _MANTISSA_BITS[torch.bfloat16], _MAX_REFINED_PER_ROW
            )
        else:
            model = LlamaModel.__new__(LlamaModel)
            model.backend = CpuBackend(torch.device("cpu"), torch.bfloat16, 64)
            model.backend.compiled_ops = False  # the torch path
            model.head_plain = None
            model.lm_head = Linear(weight, b)
            model.lm_head.packed = False
            model.lm_head.weight = weight
            model._refine_leading(hidden, logits)
        results.append(logits)
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))
        assert (logits[0, 7] - exact[0, 7]).abs() < 1e-4
        # Far from the maximum nothing changes.
        far = rounded < rounded.amax(-1, keepdim=True) - 1
        assert torch.equal(logits[far], rounded[far])
    assert torch.allclose(results[0], results[1], atol=1e-4)
    assert rounded[0, 7] == rounded[0, 9]  # the tie that needed refining


@needs_compiled
def test_argmax_rows_is_torch_argmax() -> None:
    """First index of the maximum; ties, infinities and NaN (which torch
    counts as the maximum) as torch does."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 1000, generator=gen)
    logits[1, [10, 600]] = 50.0  # a tie: the first wins
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, [700, 20]] = float("nan")
    logits[4, 3] = 1e30
    logits[5, 999] = 1e9  # the last column
    logits[6] = 0.0  # a flat row
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax_rows(logits[:0]), logits[:0].argmax(dim=-1))
    with pytest.raises(ValueError, match="rows"):
        cpu_ops.argmax_rows(torch.randn(5))


def test_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path) -> None:  # noqa: ANN001
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    cpu_ops._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - 3600
    os.utime(lock, (old, old))
    cpu_ops._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert cpu_ops._import_built(tmp_path) is None  # nothing built there


@needs_compiled
def test_compiled_ops_are_named_in_a_profile() -> None:
    """Calls into the extension appear in torch's profiler as pagoda::<op>, so a
    trace shows the few-row linears and the fused ops, not a gap."""
    weight, dense = random_q4(40, 64, seed=9)
    linear = Linear(dense, None, blocks=weight)
    x = torch.randn(2, 64)
    with torch.profiler.profile() as prof:
        linear(x)
        cpu_ops.silu_and_mul(torch.randn(2, 64))
    names = {event.name for event in prof.events()}
    assert {"pagoda::linear_q4_small_rows", "pagoda::silu_and_mul"} <= names


needs_dense = pytest.mark.skipif(
    not (cpu_ops.load_cpu_ops() is not None and cpu_ops.has_bf16_dense_attention()),
    reason="the dense attention kernel needs AVX512-BF16",
)


@needs_dense
@pytest.mark.parametrize(
    ("n", "sq", "sk", "d", "causal"),
    [
        (1, 1, 1, 64, False),
        (2, 5, 5, 64, True),
        (3, 37, 37, 64, False),  # rows across register blocks of 8 and 4, keys across tiles
        (2, 17, 40, 32, True),  # queries the last 17 of 40 positions
        (1, 70, 130, 96, False),  # a head size that is an odd multiple of 32
        (2, 33, 33, 128, True),
    ],
)
def test_dense_attention_is_the_softmax_of_bf16_products(
    n: int, sq: int, sk: int, d: int, causal: bool
) -> None:
    """softmax(q k^T * scale) v in float32 sums over the bfloat16 inputs, the
    probabilities rounded to bfloat16 before they meet v (as the kernel
    multiplies them), the output rounded once, query heads sharing their kv
    head: against plain torch in float64, and within bfloat16 rounding of
    float32 SDPA."""
    gen = torch.Generator().manual_seed(sq * 31 + sk + d)
    q = torch.randn(n, 6, sq, d, generator=gen).bfloat16()
    k, v = (torch.randn(n, 2, sk, d, generator=gen).bfloat16() for _ in range(2))
    scale = d**-0.5
    got = cpu_ops.dense_attention(q, k, v, scale, causal)  # 3 query heads per kv head
    k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        seen = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        scores = scores.masked_fill(~seen, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).float().bfloat16().double()
    want = (p @ v.double()) / p.sum(-1, keepdim=True)
    assert (got.double() - want).abs().max().item() <= 2**-7 * want.abs().max().item() + 1e-3
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=scale
    )
    assert (got.float() - sdpa).abs().max().item() < 2e-2


@needs_dense
def test_dense_attention_refuses_what_it_does_not_run() -> None:
    q = torch.randn(1, 4, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.dense_attention(q, q, q, 0.1)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_ops.dense_attention(q.float(), q.float(), q.float(), 0.1)
    with pytest.raises(RuntimeError, match="causal"):
        cpu_ops.dense_attention(torch.randn(1, 5, 32).bfloat16(), q[..., :32], q[..., :32], 1, True)
