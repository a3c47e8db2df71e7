"""Microbenchmark of the compiled CPU kernels against plain torch.

    python scripts/bench_cpu_kernels.py              # elementwise ops
    python scripts/bench_cpu_kernels.py --attention  # attention
    python scripts/bench_cpu_kernels.py --linear     # few-row linears

Elementwise: microseconds per call for fused add+RMSNorm (hidden 576),
SiLU-and-mul (intermediate 1536) and the rotary embedding (9 + 3 heads of
64), the default model's sizes, at decode (64 rows) and prefill (4096 rows)
sizes, in bfloat16 and float32.

Attention, with the default model's heads: a decode step (64 rows of ~200
positions) over 30 layers' caches, so each layer's keys and values come
from memory as in the model, in both cache layouts with each row's blocks
in order and scattered; and prompt chunks of several lengths, one
query row per token through the compiled kernel against one SDPA call per
sequence (the CPU backend's choice between them, COMPILED_PROMPT_MAX_LEN).

Linears: the default model's 30 layers of projections (qkv, o, gate|up,
down), each layer's weights its own so they come from memory as in the
model, at 1 to 64 rows: oneDNN's packed path against the few-row kernel on
the plain weights (kernels/linear.py's choice, SMALL_ROWS_MAX) and
the kernel on the default model's own GGUF blocks (BlockWeight,
BLOCKS_MAX_ROWS) and, in bfloat16 on AVX512-BF16 without AMX, the pairs
kernel (what Linear runs there), alternated, the best of 7 rounds each;
with the pairs kernel also a 4096-row prompt chunk over 4 layers; then the
49152-wide head at 1 row.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagoda.engine_core.attention.backend import apply_rope as _apply_rope
from pagoda.engine_core.attention.cpu_backend import prefill_attention
from pagoda.engine_core.loaders.gguf import load_gguf_blocks
from pagoda.engine_core.model_config import default_model_path, load_model_config
from pagoda.kernels import cpu_ops
from pagoda.kernels.linear import BlockWeight, pack_weight, pairs_available

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def best_alternated(runs: dict[str, Callable[[], object]], rounds: int) -> str:
    """Each run's best time over `rounds` rounds, the runs alternated in each."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, fn in runs.items():
            best[key] = min(best[key], per_call_us(fn, 1) / 1e3)
    return ", ".join(f"{key} {ms:6.1f} ms" for key, ms in best.items())


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    summed = residual + x
    xf = summed.float()
    _ = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def bench_size(dtype: torch.dtype, rows: int) -> None:
    calls = 20 if rows > 64 else 200
    x = torch.randn(rows, 576).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    weight = torch.rand(576).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    table = torch.randn(8192, HEAD_DIM // 2).to(dtype)
    positions = torch.randint(0, 8192, (rows,))

    def torch_rope() -> None:
        cos, sin = table[positions][:, None], table[positions][:, None]
        _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    cases = {
        "rotary": (lambda: cpu_ops.rotary_embedding(q, k, positions, table, table), torch_rope),
        "add_rms_norm": (
            lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: torch_add_rms_norm(x, residual, weight),
        ),
        "silu_and_mul": (lambda: cpu_ops.silu_and_mul(gate_up), lambda: F.silu(gate) * up),
    }
    for name, (compiled, plain) in cases.items():
        print(
            f"{dtype_name(dtype):>9} {rows:>5} {name:>13} "
            f"{per_call_us(compiled, calls):>12.1f} {per_call_us(plain, calls):>9.1f}"
        )


def bench_decode_attention(
    dtype: torch.dtype, layers: int = 30, batch: int = 64, length: int = 192
) -> None:
    """Both cache layouts (positions first, and heads first as the engine
    stores it on the CPU), with each row's blocks in order (a fresh cache)
    and scattered (a free list reshuffled by hours of serving), alternated."""
    blocks = batch * -(-length // BLOCK)
    plain = [
        (
            torch.randn(2 * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype),
            torch.randn(2 * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype),
        )
        for _ in range(layers)
    ]
    heads_first = [
        tuple(
            c.new_empty(2 * blocks, KV_HEADS, BLOCK, HEAD_DIM).transpose(1, 2).copy_(c)
            for c in pair
        )
        for pair in plain
    ]
    lens = torch.full((batch,), length)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
    shape = f"{batch} rows x {length} positions, {layers} layers"
    for order, table in (
        ("in order", torch.arange(blocks)),
        ("scattered", torch.randperm(2 * blocks)[:blocks]),
    ):
        tables = table.view(batch, -1).contiguous()

        def step(caches: list, tables: torch.Tensor = tables) -> None:
            for kc, vc in caches:
                cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)

        runs: dict[str, Callable[[], object]] = {
            "positions first": partial(step, plain),
            "heads first": partial(step, heads_first),
        }
        print(f"{dtype_name(dtype)} decode step, {shape}, blocks {order}: ", end="")
        print(best_alternated(runs, 7))


def bench_prompt_attention(dtype: torch.dtype, seqs: int, length: int) -> None:
    tokens = seqs * length
    kc = torch.randn(tokens // BLOCK, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    vc = torch.randn(tokens // BLOCK, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    tables = torch.arange(tokens // BLOCK).view(seqs, -1)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=dtype)
    k = kc.flatten(0, 1)
    v = vc.flatten(0, 1)
    rows = torch.arange(seqs).repeat_interleave(length)
    lens = torch.arange(1, length + 1).repeat(seqs)

    def compiled() -> None:
        cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, table_rows=rows)

    def sdpa() -> None:
        for i in range(seqs):
            part = slice(i * length, (i + 1) * length)
            prefill_attention(q[part], k[part], v[part], 0.125)

    print(
        f"{dtype_name(dtype)} prompts {seqs:>3} x {length:>4}: "
        f"compiled {per_call_us(compiled, 5) / 1e3:6.2f} ms, "
        f"SDPA {per_call_us(sdpa, 5) / 1e3:6.2f} ms per layer"
    )


LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate|up, down


def bench_linears(dtype: torch.dtype, layers: int = 30) -> None:
    gen = torch.Generator().manual_seed(0)
    dense = [
        [(torch.randn(shape, generator=gen) * 0.05).to(dtype) for shape in LAYER_SHAPES]
        for _ in range(layers)
    ]
    model = [[pack_weight(w) for w in layer] for layer in dense]
    # bfloat16 on AVX512-BF16 without AMX: the path Linear takes there.
    pairs = (
        [[cpu_ops.pack_bf16_pairs(w) for w in layer] for layer in dense]
        if dtype == torch.bfloat16 and pairs_available()
        else []
    )
    del dense
    # Each layer's plain weights are their own tensors, as in the model.
    plain = [
        [(torch.randn(shape, generator=gen) * 0.05).to(dtype) for shape in LAYER_SHAPES]
        for _ in range(layers)
    ]
    name = dtype_name(dtype)
    # The GGUF blocks kernels run float32 and bfloat16 models.
    blocks, head_blocks = default_model_blocks(layers) if dtype != torch.float16 else ([], None)
    for rows in (1, 2, 3, 4, 8, 16, 32, 64):
        xs = [torch.randn(rows, shape[1], generator=gen).to(dtype) for shape in LAYER_SHAPES]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for layer in model:
                for w, x in zip(layer, xs, strict=True):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def pairs_kernel(xs: list[torch.Tensor] = xs) -> None:
            for layer in pairs:
                for w, x, shape in zip(layer, xs, LAYER_SHAPES, strict=True):
                    cpu_ops.linear_bf16_pairs(x, w, shape[0])

        def few_rows(xs: list[torch.Tensor] = xs) -> None:
            for layer in plain:
                for w, x in zip(layer, xs, strict=True):
                    cpu_ops.linear_small_rows(x, w)

        def gguf_blocks(xs: list[torch.Tensor] = xs) -> None:
            for layer in blocks:
                for w, x in zip(layer, xs, strict=True):
                    w.matmul(x, None)

        runs = {"oneDNN": onednn, "few-row kernel": few_rows}
        if pairs:
            runs["pairs kernel"] = pairs_kernel
        if blocks:
            runs["GGUF blocks"] = gguf_blocks
        print(f"{name:>9} {rows:>4} rows, {layers} layers: {best_alternated(runs, 7)}")
    if pairs:  # a prompt chunk: 4 layers at 4096 rows
        xs = [torch.randn(4096, shape[1], generator=gen).to(dtype) for shape in LAYER_SHAPES]
        prompt = {
            "oneDNN": lambda: [
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                for layer in model[:4]
                for w, x in zip(layer, xs, strict=True)
            ],
            "pairs kernel": lambda: [
                cpu_ops.linear_bf16_pairs(x, w, shape[0])
                for layer in pairs[:4]
                for w, x, shape in zip(layer, xs, LAYER_SHAPES, strict=True)
            ],
        }
        print(f"{name:>9} 4096 rows, 4 layers: {best_alternated(prompt, 3)}")
    head = (torch.randn(49152, 576, generator=gen) * 0.05).to(dtype)
    packed_head, x = pack_weight(head), torch.randn(1, 576, generator=gen).to(dtype)
    heads = {
        "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed_head, None, "none", [], ""),
        "few-row kernel": lambda: cpu_ops.linear_small_rows(x, head),
    }
    if pairs:
        pairs_head = cpu_ops.pack_bf16_pairs(head)
        heads["pairs kernel"] = lambda: cpu_ops.linear_bf16_pairs(x, pairs_head, head.shape[0])
    if head_blocks is not None:
        heads["GGUF blocks (Q8_0)"] = lambda: head_blocks.matmul(x, None)
    figures = ", ".join(
        f"{key} {min(per_call_us(fn, 1) for _ in range(7)) / 1e3:.1f} ms"
        for key, fn in heads.items()
    )
    print(f"{name:>9} head 49152 x 576, 1 row: {figures}")


def default_model_blocks(layers: int) -> tuple[list[list[BlockWeight]], BlockWeight | None]:
    """The default model's GGUF blocks, fused per layer as LlamaModel fuses them
    (qkv, o, gate|up, down), and its Q8_0 embeddings (the tied head)."""
    config = load_model_config(default_model_path())
    found = load_gguf_blocks(config)

    def fused(*names: str) -> BlockWeight:
        parts = [found[name] for name in names]
        offsets = [p[2] for p in parts]
        offset = None if offsets[0] is None else torch.cat(offsets)  # type: ignore[arg-type]
        return BlockWeight(
            torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), offset
        )

    model = []
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        model.append(
            [
                fused(*(f"{a}{n}_proj.weight" for n in "qkv")),
                fused(a + "o_proj.weight"),
                fused(m + "gate_proj.weight", m + "up_proj.weight"),
                fused(m + "down_proj.weight"),
            ]
        )
    embed = "model.embed_tokens.weight"
    head = fused(embed) if embed in found else None
    return model, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attention", action="store_true", help="attention instead")
    parser.add_argument("--linear", action="store_true", help="few-row linears instead")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="one dtype only (default: both)"
    )
    args = parser.parse_args()
    if cpu_ops.load_cpu_ops() is None:
        raise SystemExit("the compiled CPU kernels are not available here")
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    if args.linear:
        for dtype in dtypes:
            bench_linears(dtype)
        return
    if args.attention:
        for dtype in dtypes:
            bench_decode_attention(dtype)
            for seqs, length in ((64, 32), (32, 128), (16, 256), (8, 512), (1, 4096)):
                bench_prompt_attention(dtype, seqs, length)
        return
    print(f"{'dtype':>9} {'rows':>5} {'op':>13} {'compiled us':>12} {'torch us':>9}")
    for dtype in reversed(dtypes):
        for rows in (64, 4096):
            bench_size(dtype, rows)


if __name__ == "__main__":
    main()
