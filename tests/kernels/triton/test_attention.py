"""Triton paged attention (decode, split-K decode, prefill) against torch references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagoda.engine_core.attention.cpu_backend import AttentionMetadata, PrefillSeq, paged_attention  # noqa: E402
from pagoda.kernels.triton_ops import reference as ref  # noqa: E402
from pagoda.kernels.triton_ops.cache import reshape_and_cache  # noqa: E402
from pagoda.kernels.triton_ops.decode_attention import paged_decode_attention  # noqa: E402
from pagoda.kernels.triton_ops.prefill_attention import paged_prefill_attention  # noqa: E402
from tests.kernels.triton.helpers import (  # noqa: E402
    DEVICE,
    FULL,
    check_close,
    grid,
    make_paged_cache,
    poisoned,
    randn,
)

F32, BF16 = torch.float32, torch.bfloat16


def decode_lens(block_size: int) -> list[int]:
    # Ragged: 1, exact block boundaries, one past, one short of three blocks.
    lens = [1, block_size, block_size + 1, 3 * block_size - 1]
    return lens + [1000, 4097, 2 * block_size] if FULL else lens


# (dtype, head_dim, block_size, group, kv_heads, split); kv_heads 1 is MQA.
DECODE_CASES = grid(
    [
        (F32, 64, 16, 1, 2, False),
        (BF16, 128, 32, 3, 2, True),
        (F32, 128, 16, 4, 1, True),
        (BF16, 64, 16, 8, 1, False),
        (F32, 64, 8, 3, 2, True),  # blocks smaller than a tile
    ],
    [F32, BF16],
    [64, 128],
    [8, 16, 32],
    [1, 3, 4, 8],
    [1, 2],
    [False, True],
)


@pytest.mark.parametrize("dtype,head_dim,block_size,group,kv_heads,split", DECODE_CASES)
def test_paged_decode_attention(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int, kv_heads: int, split: bool
) -> None:
    gen = torch.Generator().manual_seed(head_dim + block_size + group + kv_heads)
    lens = decode_lens(block_size)
    heads = kv_heads * group
    k_cache, v_cache, tables = make_paged_cache(lens, kv_heads, head_dim, block_size, dtype, gen)
    query = randn(len(lens), heads, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, device=DEVICE)
    scale = head_dim**-0.5
    out = poisoned(query.shape, dtype)
    # Small partitions in the interpreter so that split-K spans several of them
    # (a multiple of the interpreter's 32-token tile).
    partition = 512 if FULL else max(2 * block_size, 32)
    paged_decode_attention(
        query, k_cache, v_cache, tables, seq_lens, scale,
        split=split, partition_size=partition, out=out,
    )  # fmt: skip
    expected = ref.paged_decode_attention_ref(query, k_cache, v_cache, tables, seq_lens, scale)
    check_close(out, expected, dtype, f"decode split={split}")


def test_paged_decode_attention_default_split_long_context() -> None:
    """The launcher's own choice: a table wider than one 512-token partition goes split-K,
    int64 tables and lengths as the torch path uses them."""
    gen = torch.Generator().manual_seed(11)
    lens = [1100, 1, 513]
    k_cache, v_cache, tables = make_paged_cache(lens, 1, 64, 16, BF16, gen)
    query = randn(len(lens), 4, 64, dtype=BF16, gen=gen)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out = poisoned(query.shape, BF16)
    paged_decode_attention(query, k_cache, v_cache, tables.long(), seq_lens, 0.125, out=out)
    expected = ref.paged_decode_attention_ref(query, k_cache, v_cache, tables, seq_lens, 0.125)
    check_close(out, expected, BF16, "decode default split")


# (dtype, head_dim, block_size, group, kv_heads)
PREFILL_CASES = grid(
    [
        (F32, 64, 16, 1, 2),
        (BF16, 128, 32, 3, 1),
        (F32, 128, 16, 4, 2),
        (BF16, 64, 16, 8, 1),
        (BF16, 64, 8, 4, 2),  # blocks smaller than a tile
    ],
    [F32, BF16],
    [64, 128],
    [8, 16, 32],
    [1, 3, 4, 8],
    [1, 2],
)


def prefill_seqs(block_size: int) -> list[tuple[int, int]]:
    """(query length, context length after the step) per sequence."""
    seqs = [
        (1, 1),  # a one-token prompt
        (block_size, block_size),  # a whole prompt filling exactly one block
        (5, block_size + 5),  # a chunk starting mid-sequence (prefix hit)
        (1, 2 * block_size + 3),  # a decode row in the same batch
        (block_size + 3, 2 * block_size),  # a chunk ending on a block boundary
    ]
    return seqs + [(700, 700), (300, 2100)] if FULL else seqs


@pytest.mark.parametrize("dtype,head_dim,block_size,group,kv_heads", PREFILL_CASES)
def test_paged_prefill_attention(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int, kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(7 * head_dim + block_size + group + kv_heads)
    seqs = prefill_seqs(block_size)
    q_lens = [q for q, _ in seqs]
    lens = [n for _, n in seqs]
    k_cache, v_cache, tables = make_paged_cache(lens, kv_heads, head_dim, block_size, dtype, gen)
    query = randn(sum(q_lens), kv_heads * group, head_dim, dtype=dtype, gen=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    scale = head_dim**-0.5
    out = poisoned(query.shape, dtype)
    paged_prefill_attention(
        query, k_cache, v_cache, tables, cu, seq_lens, max(q_lens), scale, out=out
    )
    expected = ref.paged_prefill_attention_ref(query, k_cache, v_cache, tables, cu, seq_lens, scale)
    check_close(out, expected, dtype, "prefill")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_step_matches_engine_torch_path(dtype: torch.dtype) -> None:
    """One mixed step (decodes + a fresh prompt + a mid-sequence chunk) through the Triton
    kernels equals engine_core's torch paged_attention, which the CPU runner uses."""
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, group, head_dim = 16, 2, 3, 64
    # (tokens already cached, tokens this step); decode rows first, as the runner orders them.
    rows = [(20, 1), (16, 1), (0, 1), (0, 18), (11, 7)]
    heads = kv_heads * group
    num_blocks = 16
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype, gen=gen), randn(*shape, dtype=dtype, gen=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-(c + n) // block_size))] for c, n in rows]
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, (c, n) in zip(tables, rows, strict=True)
        for p in range(c, c + n)
    ]
    num_tokens = len(slots)
    query = randn(num_tokens, heads, head_dim, dtype=dtype, gen=gen)
    key = randn(num_tokens, kv_heads, head_dim, dtype=dtype, gen=gen)
    value = randn(num_tokens, kv_heads, head_dim, dtype=dtype, gen=gen)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(rows), width, dtype=torch.int32, device=DEVICE)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    seq_lens = torch.tensor([c + n for c, n in rows], device=DEVICE)
    scale = head_dim**-0.5

    # The engine's torch path on copies of the caches.
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    num_decode = 3
    starts = [0, *torch.tensor([n for _, n in rows]).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=num_decode,
        decode_block_tables=table[:num_decode].long(),
        decode_seq_lens=seq_lens[:num_decode],
        decode_max_len=int(seq_lens[:num_decode].max()),
        prefills=[
            PrefillSeq(starts[i], rows[i][1], int(seq_lens[i]), torch.tensor(tables[i]))
            for i in range(num_decode, len(rows))
        ],
    )
    expected = paged_attention(query, key, value, kc_ref, vc_ref, meta, scale)

    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    out = poisoned(query.shape, dtype)
    paged_decode_attention(
        query[:num_decode], k_cache, v_cache, table[:num_decode], seq_lens[:num_decode], scale,
        out=out[:num_decode],
    )  # fmt: skip
    cu = torch.tensor(starts[num_decode:], device=DEVICE)
    cu = cu - cu[0]
    paged_prefill_attention(
        query[num_decode:], k_cache, v_cache, table[num_decode:], cu, seq_lens[num_decode:],
        max(n for _, n in rows), scale, out=out[num_decode:],
    )  # fmt: skip
    check_close(out, expected, dtype, "step")


def test_attention_launchers_reject_bad_input() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = make_paged_cache([5], 2, 64, 16, F32, gen)
    seq_lens = torch.tensor([5], device=DEVICE)
    q = randn(1, 4, 64, dtype=F32, gen=gen)
    with pytest.raises(ValueError, match="multiple of"):
        paged_decode_attention(randn(1, 3, 64, dtype=F32, gen=gen), k_cache, v_cache, tables,
                               seq_lens, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(randn(1, 4, 32, dtype=F32, gen=gen), k_cache, v_cache, tables,
                               seq_lens, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.to(BF16), k_cache, v_cache, tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_decode_attention(q, k_cache, v_cache, tables.float(), seq_lens, 0.1)
    with pytest.raises(ValueError, match="batch"):
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([5, 5]), 0.1)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, partition_size=20)
    with pytest.raises(ValueError, match="sequences"):
        paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0]), seq_lens, 1, 0.1)
    with pytest.raises(ValueError, match="tile_size"):
        paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 1]), seq_lens, 1, 0.1, tile_size=24
        )
