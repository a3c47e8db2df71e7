"""Triton kernel benchmark: each kernel vs its torch path and vs a memory-bandwidth floor.

    python scripts/bench_triton.py                 # on a CUDA GPU, Llama-3-8B-like shapes
    python scripts/bench_triton.py --json out.json
    TRITON_INTERPRET=1 python scripts/bench_triton.py --smoke   # tiny shapes, CPU interpreter

For every kernel: its relative error against the torch path, the time per
call of both, the bytes it must move at least, and the floor those bytes
set at the device's measured copy bandwidth (a large device-to-device copy,
read + write). "of floor" is floor / kernel time: 100% would be a kernel
that only moves its bytes. The torch path is the engine's own batched torch
code where it has one (write_kv, decode_attention, per-sequence SDPA
prefill, the grouped LoRA matmul of kernels/lora.py), else the plain ops the model runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.engine_core.attention.cpu_backend import (  # noqa: E402
    AttentionMetadata,
    PrefillSeq,
    decode_attention,
    paged_attention,
    write_kv,
)
from pagoda.kernels.lora import add_lora as torch_add_lora  # noqa: E402
from pagoda.kernels.lora import lora_groups  # noqa: E402
from pagoda.kernels.triton_ops.activation import silu_and_mul  # noqa: E402
from pagoda.kernels.triton_ops.cache import reshape_and_cache  # noqa: E402
from pagoda.kernels.triton_ops.decode_attention import paged_decode_attention  # noqa: E402
from pagoda.kernels.triton_ops.lora import add_lora as triton_add_lora  # noqa: E402
from pagoda.kernels.triton_ops.lora import lora_index  # noqa: E402
from pagoda.kernels.triton_ops.norm import fused_add_rms_norm  # noqa: E402
from pagoda.kernels.triton_ops.prefill_attention import paged_prefill_attention  # noqa: E402
from pagoda.kernels.triton_ops.rotary import rotary_embedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Row:
    """One kernel's figures."""

    kernel: str
    shape: str
    rel_err: float
    triton_ms: float
    torch_ms: float
    bytes_moved: int
    floor_ms: float

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call, after one warm-up call (which also compiles)."""
    fn()
    sync()
    if DEVICE.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes per second of a device copy, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * src.element_size() / (ms / 1000)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def paged_inputs(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random caches and block tables with each sequence's blocks scattered."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    order = torch.randperm(num_blocks).tolist()
    blocks = [[order.pop() for _ in range(nb)] for nb in per_seq]
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    for i, b in enumerate(blocks):
        table[i, : len(b)] = torch.tensor(b)
    return k_cache, v_cache, table.to(DEVICE), blocks


def bench_all(cfg: dict[str, Any], iters: int, bandwidth: float) -> list[Row]:
    dtype = torch.bfloat16
    heads, kv_heads, head_dim, bs = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], 16
    elt = torch.tensor([], dtype=dtype).element_size()
    scale = head_dim**-0.5
    rows: list[Row] = []

    def add(name: str, shape: str, out: torch.Tensor, ref: torch.Tensor, tri: Any, tor: Any,
            nbytes: int) -> None:  # fmt: skip
        rows.append(
            Row(
                name,
                shape,
                rel_err(out, ref),
                timed(tri, iters),
                timed(tor, iters),
                nbytes,
                nbytes / bandwidth * 1000,
            )  # fmt: skip
        )

    # reshape_and_cache
    t = cfg["tokens"]
    kc, vc, _, _ = paged_inputs([t], heads, kv_heads, head_dim, bs, dtype)
    key = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    value = torch.randn_like(key)
    slots = torch.randperm(kc.shape[0] * bs, device=DEVICE)[:t]
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    write_kv(key, value, kc2, vc2, slots)
    add("reshape_and_cache", f"T={t}", kc, kc2,
        lambda: reshape_and_cache(key, value, kc, vc, slots),
        lambda: write_kv(key, value, kc2, vc2, slots),
        4 * key.numel() * elt + slots.numel() * 8)  # fmt: skip

    # paged decode, plain and split-K
    for name, batch, ctx, split in (
        ("decode", cfg["decode_batch"], cfg["decode_ctx"], False),
        ("decode split-K", cfg["split_batch"], cfg["split_ctx"], True),
    ):
        lens = [ctx] * batch
        kc, vc, table, _ = paged_inputs(lens, heads, kv_heads, head_dim, bs, dtype)
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device=DEVICE)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        seq_lens64, table64 = seq_lens.long(), table.long()
        out = paged_decode_attention(q, kc, vc, table, seq_lens, scale, split=split)
        ref = decode_attention(q, kc, vc, table64, seq_lens64, ctx, scale)
        add(name, f"B={batch} ctx={ctx}", out, ref,
            lambda q=q, kc=kc, vc=vc, table=table, seq_lens=seq_lens, split=split:
                paged_decode_attention(q, kc, vc, table, seq_lens, scale, split=split),
            lambda q=q, kc=kc, vc=vc, table64=table64, seq_lens64=seq_lens64, ctx=ctx:
                decode_attention(q, kc, vc, table64, seq_lens64, ctx, scale),
            2 * batch * ctx * kv_heads * head_dim * elt + 2 * q.numel() * elt)  # fmt: skip

    # chunked prefill: each sequence's chunk after a cached context
    n_seq, chunk, cached = cfg["prefill_seqs"], cfg["prefill_chunk"], cfg["prefill_cached"]
    lens = [cached + chunk] * n_seq
    kc, vc, table, blocks = paged_inputs(lens, heads, kv_heads, head_dim, bs, dtype)
    q = torch.randn(n_seq * chunk, heads, head_dim, dtype=dtype, device=DEVICE)
    cu = torch.arange(0, n_seq * chunk + 1, chunk, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    # The torch path re-writes the chunk's keys (gathered from the cache) first.
    flat_slots = torch.tensor(
        [b[p // bs] * bs + p % bs for b in blocks for p in range(cached, cached + chunk)],
        device=DEVICE,
    )
    k_new = kc.view(-1, kv_heads, head_dim)[flat_slots].clone()
    v_new = vc.view(-1, kv_heads, head_dim)[flat_slots].clone()
    meta = AttentionMetadata(
        slot_mapping=flat_slots,
        num_decode_tokens=0,
        decode_block_tables=table[:0].long(),
        decode_seq_lens=seq_lens[:0].long(),
        decode_max_len=0,
        prefills=[
            PrefillSeq(i * chunk, chunk, cached + chunk, torch.tensor(b, device=DEVICE))
            for i, b in enumerate(blocks)
        ],
    )
    out = paged_prefill_attention(q, kc, vc, table, cu, seq_lens, chunk, scale)
    ref = paged_attention(q, k_new, v_new, kc, vc, meta, scale)
    add("prefill (chunked)", f"{n_seq}x{chunk} after {cached}", out, ref,
        lambda: paged_prefill_attention(q, kc, vc, table, cu, seq_lens, chunk, scale),
        lambda: paged_attention(q, k_new, v_new, kc, vc, meta, scale),
        2 * q.numel() * elt + 2 * sum(lens) * kv_heads * head_dim * elt)  # fmt: skip

    # fused residual add + RMSNorm (in place: restore inputs is not needed for timing)
    hidden = cfg["hidden"]
    x = torch.randn(t, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=DEVICE)
    x1, r1 = x.clone(), res.clone()
    fused_add_rms_norm(x1, r1, w, 1e-5)

    def torch_add_rms(x: torch.Tensor = x, res: torch.Tensor = res) -> torch.Tensor:
        s = res + x
        sf = s.float()
        return w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    x2, r2 = x.clone(), res.clone()
    add("fused_add_rms_norm", f"T={t} N={hidden}", x1, torch_add_rms(),
        lambda: fused_add_rms_norm(x2, r2, w, 1e-5), torch_add_rms,
        4 * x.numel() * elt + w.numel() * elt)  # fmt: skip

    # rotary, neox, in place on q and k
    qk = torch.randn(t, heads + kv_heads, head_dim, dtype=dtype, device=DEVICE)
    pos = torch.randint(0, 8192, (t,), device=DEVICE)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def torch_rope() -> torch.Tensor:
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        x1, x2 = qk.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    expected = torch_rope()
    qk1 = qk.clone()
    rotary_embedding(pos, qk1[:, :heads], qk1[:, heads:], cos, sin)
    qk2 = qk.clone()
    add("rotary (neox)", f"T={t}", qk1, expected,
        lambda: rotary_embedding(pos, qk2[:, :heads], qk2[:, heads:], cos, sin), torch_rope,
        2 * qk.numel() * elt + t * head_dim * elt)  # fmt: skip

    # SiLU-and-mul
    inter = cfg["inter"]
    gu = torch.randn(t, 2 * inter, dtype=dtype, device=DEVICE)

    def torch_silu() -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    add("silu_and_mul", f"T={t} I={inter}", silu_and_mul(gu), torch_silu(),
        lambda: silu_and_mul(gu), torch_silu, 3 * t * inter * elt)  # fmt: skip

    # batched LoRA on q|k|v (rank 16 per projection, stacked), 4 adapters + base tokens
    loras, rank = 4, 16
    outs = heads * head_dim + 2 * kv_heads * head_dim
    a = torch.randn(loras + 1, 3 * rank, hidden, dtype=dtype, device=DEVICE) / hidden**0.5
    b = torch.randn(loras + 1, outs, 3 * rank, dtype=dtype, device=DEVICE) / rank
    for name, n in (("lora qkv decode", cfg["decode_batch"]), ("lora qkv prefill", t)):
        token_slots = [i % (loras + 1) for i in range(n)]  # a fifth of the tokens on no adapter
        x = torch.randn(n, hidden, dtype=dtype, device=DEVICE)
        y = torch.randn(n, outs, dtype=dtype, device=DEVICE)
        groups, index = lora_groups(token_slots, DEVICE), lora_index(token_slots, DEVICE)
        y1, y2 = y.clone(), y.clone()
        n_lora = sum(1 for s in token_slots if s)
        add(name, f"T={n} r={rank}x3 N={outs}",
            triton_add_lora(y.clone(), x, a, b, index), torch_add_lora(y.clone(), x, a, b, groups),
            lambda x=x, y1=y1, index=index: triton_add_lora(y1, x, a, b, index),
            lambda x=x, y2=y2, groups=groups: torch_add_lora(y2, x, a, b, groups),
            (n_lora * (hidden + 2 * outs) + loras * 3 * rank * (hidden + outs)) * elt)  # fmt: skip
    return rows


FULL = dict(
    heads=32, kv_heads=8, head_dim=128, hidden=4096, inter=14336, tokens=4096,
    decode_batch=64, decode_ctx=1024, split_batch=4, split_ctx=16384,
    prefill_seqs=8, prefill_chunk=512, prefill_cached=512,
)  # fmt: skip
SMOKE = dict(
    heads=4, kv_heads=2, head_dim=64, hidden=96, inter=80, tokens=8,
    decode_batch=2, decode_ctx=40, split_batch=1, split_ctx=1100,
    prefill_seqs=2, prefill_chunk=8, prefill_cached=20,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one iteration")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    smoke = args.smoke or DEVICE.type != "cuda"
    cfg = SMOKE if smoke else FULL
    iters = args.iters or (1 if smoke else 50)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(1 << 24 if smoke else 1 << 30, max(iters, 10))
    rows = bench_all(cfg, iters, bandwidth)
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (interpreter)"
    print(f"device: {device}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    header = f"{'kernel':<20} {'shape':<24} {'rel err':>8} {'triton ms':>10} {'torch ms':>9}"
    print(header + f" {'speed-up':>8} {'floor ms':>9} {'of floor':>8}")
    for r in rows:
        print(
            f"{r.kernel:<20} {r.shape:<24} {r.rel_err:8.1e} {r.triton_ms:10.3f} {r.torch_ms:9.3f}"
            f" {r.torch_ms / r.triton_ms:7.2f}x {r.floor_ms:9.3f} {r.floor_ms / r.triton_ms:7.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device, "bandwidth_Bps": bandwidth, "rows": [r.as_dict() for r in rows]},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
