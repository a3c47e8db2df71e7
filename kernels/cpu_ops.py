"""Compiled CPU kernels, built once per machine with torch's C++ extension loader.

The build lands under the Pagoda cache directory, keyed by the source, the
torch version and the CPU's instruction-set flags (it is compiled with
-march=native). If no compiler is available the callers fall back to their
plain-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


@functools.cache
def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo, read once (every Linear asks)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _cache_root() -> Path:
    """PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda.

    The rule of protocol/envs.py, read here again because kernels/ imports
    nothing else of Pagoda's.
    """
    base = os.environ.get("PAGODA_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pagoda"


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for path in sorted(_SOURCE.parent.iterdir()):  # the .cpp and its headers
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(torch.__version__.encode() + _cpu_flags().encode())
    digest.update(" ".join(_CFLAGS).encode())
    key = digest.hexdigest()[:16]
    return _cache_root() / "torch_extensions" / key


_MODULE_NAME = "pagoda_cpu_ops"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# A build takes well under a minute; a lock this old was left by a killed process.
_STALE_LOCK_S = 600


def _import_built(build_dir: Path) -> ModuleType | None:
    """The module already built in build_dir, imported without torch's loader.

    torch's loader takes a lock file in the build directory even when nothing
    needs building; a process killed while holding it would leave every later
    start waiting on it.
    """
    path = build_dir / f"{_MODULE_NAME}.so"
    if not path.exists() or (build_dir / "lock").exists():
        return None
    try:
        import importlib.machinery
        import importlib.util

        loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE_NAME, path, loader=loader)
        if spec is None:
            return None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except ImportError:
        return None


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale build lock left by a killed process: %s", lock)
    except OSError:
        pass


# CPU flags for hardware multiplication in each half-precision dtype.
_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def cpu_has_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this instruction-set flag."""
    return flag in _cpu_flags().split()


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies dtype in hardware (float32: always)."""
    if dtype == torch.float32:
        return True
    flags = _cpu_flags().split()
    return any(flag in flags for flag in _NATIVE_FLAGS.get(dtype, ()))


def _run(ops: ModuleType, name: str, *args: Any) -> Any:
    """ops.<name>(*args). Under torch's profiler the call is recorded as
    pagoda::<name>: calls into the extension are otherwise missing from a trace."""
    fn = getattr(ops, name)
    if not torch.autograd.profiler._is_profiler_enabled:
        return fn(*args)
    with torch.profiler.record_function(f"pagoda::{name}"):
        return fn(*args)


def _required_ops() -> ModuleType:
    """The compiled module, for a launcher that has no torch fallback."""
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("compiled CPU kernels are not available")
    return ops


def load_cpu_ops() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils.cpp_extension import load

            build_dir = _build_dir()
            os.makedirs(build_dir, exist_ok=True)
            _module = _import_built(build_dir)
            if _module is not None:
                return _module
            _clear_stale_lock(build_dir)
            _module = load(
                name=_MODULE_NAME,
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - any build failure means: use torch
            logger.warning("compiled CPU kernels unavailable (%s); using plain torch", e)
            _failed = True
    return _module


SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # compiled instantiations in the .cpp


def paged_decode_attention(
    query: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_tables, max_blocks] int64
    seq_lens: torch.Tensor,  # [rows] int64: cached positions each query row attends to
    scale: float,
    table_rows: torch.Tensor | None = None,  # [rows] int64: each row's table (None: row i)
    out: torch.Tensor | None = None,  # [rows, heads, head_dim], contiguous: written in place
) -> torch.Tensor:
    """Launcher: checks shapes, dtypes and layout, then runs the compiled kernel.

    Each query row attends to the first seq_lens[i] positions of its block
    table. Decode steps give one row per sequence; a prompt chunk gives one
    row per token, all pointing at its sequence's table, with lengths that
    grow by one (causal). Query rows may be strided (views of a fused qkv
    projection); the result goes to `out` when given, else to a new tensor.
    The caches are read in place when contiguous or heads first (see
    heads_first), else from a contiguous copy.
    """
    ops = _required_ops()
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("expected query [B, H, D] and caches [NB, BS, KVH, D]")
    batch, heads, head_dim = query.shape
    if k_cache.shape[3] != head_dim or heads % k_cache.shape[2] != 0:
        raise ValueError("head_dim mismatch or heads not a multiple of kv_heads")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("query and caches must share a dtype")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int64")
    if seq_lens.shape != (batch,):
        raise ValueError("seq_lens does not match the batch")
    if table_rows is None:
        if block_tables.shape[0] != batch:
            raise ValueError("block_tables does not match the batch")
        table_rows = _NO_ROWS
    elif table_rows.dtype != torch.int64 or table_rows.shape != (batch,):
        raise ValueError("table_rows must be int64 [batch]")
    if query.device.type != "cpu":
        raise ValueError("this kernel runs on the CPU")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    if out is None:
        out = query.new_empty(query.shape)
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError("out must be contiguous, of the query's shape and dtype")
    _run(
        ops,
        "paged_decode_attention",
        out,
        query,
        _kernel_layout(k_cache),
        _kernel_layout(v_cache),
        block_tables.contiguous(),
        table_rows.contiguous(),
        seq_lens.contiguous(),
        float(scale),
    )
    return out


_NO_ROWS = torch.empty(0, dtype=torch.int64)


def heads_first(cache: torch.Tensor) -> bool:
    """Whether a cache [NB, BS, KVH, D] is the transpose(1, 2) view of a
    contiguous [NB, KVH, BS, D]: each kv head's rows of a block one run."""
    if cache.dim() != 4:
        return False
    _, block_size, kv_heads, head_dim = cache.shape
    return cache.stride() == (
        kv_heads * block_size * head_dim,
        head_dim,
        block_size * head_dim,
        1,
    )


def _kernel_layout(cache: torch.Tensor) -> torch.Tensor:
    """The cache itself where the kernels read its layout in place (contiguous,
    or heads first), else a contiguous copy."""
    return cache if cache.is_contiguous() or heads_first(cache) else cache.contiguous()


def write_kv_slots(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim], rows of any stride (views of qkv)
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64: each key's cache slot
) -> None:
    """reshape_and_cache: store the step's keys and values at their slots,
    every slot checked before anything is written. The checks are the
    kernel's (RuntimeError)."""
    _run(_required_ops(), "write_kv_slots", key, value, k_cache, v_cache, slot_mapping)


def write_kv_decode_attention(
    query: torch.Tensor,  # [batch, heads, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, head_dim], rows of any stride (views of qkv)
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [batch] int64: each new key's cache slot
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    seq_lens: torch.Tensor,  # [batch] int64, the new position included
    scale: float,
) -> torch.Tensor:
    """A decode step's attention in one compiled call: store the step's keys
    and values at their slots, then paged_decode_attention. The checks are
    the kernel's (RuntimeError)."""
    ops = _required_ops()
    return _run(
        ops,
        "write_kv_decode_attention",
        query,
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        float(scale),
    )


def qkv_decode_attention(
    qkv: torch.Tensor,  # [batch, (heads + 2 * kv_heads) * head_dim], the fused projection
    heads: int,
    positions: torch.Tensor,  # [batch] int64
    cos: torch.Tensor,  # [max_positions, head_dim / 2]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [batch] int64
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    seq_lens: torch.Tensor,  # [batch] int64, the new position included
    scale: float,
) -> torch.Tensor:
    """rotary_embedding on qkv's q and k in place, then write_kv_decode_attention:
    a decode step's attention from the fused projection in one compiled call
    → [batch, heads, head_dim]. The checks are the kernel's (RuntimeError)."""
    ops = _required_ops()
    return _run(
        ops,
        "qkv_decode_attention",
        qkv,
        heads,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        float(scale),
    )


def has_bf16_attention() -> bool:
    """Whether bfloat16 attention runs on the AVX512-BF16 kernel (fast enough for prompts)."""
    ops = load_cpu_ops()
    return ops is not None and bool(ops.has_bf16_attention())


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden], overwritten with the normed sum
    residual: torch.Tensor,  # [num_tokens, hidden], overwritten with residual + x
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> None:
    """Launcher: residual += x; x = rms_norm(residual) * weight, in place."""
    ops = _required_ops()
    if x.shape != residual.shape or x.shape[-1] != weight.shape[0] or weight.dim() != 1:
        raise ValueError("expected x and residual [num_tokens, hidden] and weight [hidden]")
    if not (x.dtype == residual.dtype == weight.dtype):
        raise ValueError("x, residual and weight must share a dtype")
    if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
        raise ValueError("x, residual and weight must be contiguous")
    _run(ops, "fused_add_rms_norm", x, residual, weight, float(eps))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Launcher: [num_tokens, 2 * inter] → silu(gate) * up, [num_tokens, inter]."""
    ops = _required_ops()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError("expected gate_up [num_tokens, 2 * inter]")
    if not gate_up.is_contiguous():
        raise ValueError("gate_up must be contiguous")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _run(ops, "silu_and_mul", out, gate_up)
    return out


def rotary_embedding(
    query: torch.Tensor,  # [num_tokens, heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [num_tokens] int64
    cos: torch.Tensor,  # [max_positions, head_dim / 2]
    sin: torch.Tensor,
) -> None:
    """Launcher: neox-style rotary embedding in place. query and key may be
    views into one fused qkv projection (rows of any stride, heads packed)."""
    ops = _required_ops()
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0]:
        raise ValueError("expected query [T, heads, d] and key [T, kv_heads, d]")
    head_dim = query.shape[2]
    if key.shape[2] != head_dim or head_dim % 2:
        raise ValueError("query and key must share an even head_dim")
    for x in (query, key):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("heads must be packed rows of head_dim elements")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise ValueError("expected cos and sin [max_positions, head_dim / 2]")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    if not query.dtype == key.dtype == cos.dtype == sin.dtype:
        raise ValueError("query, key, cos and sin must share a dtype")
    if positions.dtype != torch.int64 or positions.shape != (query.shape[0],):
        raise ValueError("positions must be int64 [num_tokens]")
    # The compiled op checks each position against the tables' length.
    _run(ops, "rotary_embedding", query, key, positions.contiguous(), cos, sin)


def refine_leading_logits(
    logits: torch.Tensor,  # [rows, vocab] float32, refined in place
    hidden: torch.Tensor,  # [rows, dim] bfloat16
    weight: torch.Tensor,  # [vocab, dim] bfloat16, plain layout
    bias: torch.Tensor | None,
    mantissa_bits: int,
    max_per_row: int,
) -> None:
    """Launcher: each row's logits within one rounding step of its maximum,
    recomputed in float32 (LlamaModel.compute_logits has the torch form)."""
    ops = _required_ops()
    if logits.dtype != torch.float32 or not hidden.dtype == weight.dtype == torch.bfloat16:
        raise ValueError("expected float32 logits and bfloat16 hidden and weight")
    if not (logits.is_contiguous() and hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError("logits, hidden and weight must be contiguous")
    if logits.shape[0] != hidden.shape[0] or weight.shape != (logits.shape[1], hidden.shape[1]):
        raise ValueError("shapes do not match: logits [R, V], hidden [R, D], weight [V, D]")
    bias = _NO_BIAS if bias is None else bias.contiguous()
    _run(ops, "refine_leading_logits", logits, hidden, weight, bias, mantissa_bits, max_per_row)


_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for float32 [rows, vocab] on the CPU, compiled
    when the kernels are (0.7-0.8 ms instead of 2.8-3.1 at 64 x 49152 on 2 cores)."""
    ops = load_cpu_ops()
    if ops is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError("expected logits [rows, vocab]")
    return _run(ops, "argmax_rows", logits.contiguous())


def linear_small_rows(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # [out, in], plain layout
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:
    """Launcher: x W^T (+ b) for a few rows, streaming W from memory once
    (kernels/linear.Linear picks it for small batches). The compiled op
    checks shapes, dtypes and layout."""
    ops = _required_ops()
    if x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    return _run(ops, "linear_small_rows", x, weight, bias)


def linear_q4_small_rows(
    x: torch.Tensor,  # [rows, in]
    codes: torch.Tensor,  # [out, in / 2] uint8, GGUF Q4 blocks' codes
    scale: torch.Tensor,  # [out, in / 32] float32
    offset: torch.Tensor,  # [out, in / 32] float32
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:
    """Launcher: x W^T (+ b) for a few rows with W = q * scale + offset
    rebuilt from 4-bit codes as it streams (kernels/linear.BlockWeight). The
    compiled op checks shapes, dtypes and layout."""
    ops = _required_ops()
    if x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    return _run(ops, "linear_q4_small_rows", x, codes, scale, offset, bias)


def linear_q8_small_rows(
    x: torch.Tensor,  # [rows, in]
    codes: torch.Tensor,  # [out, in] int8, GGUF Q8_0 blocks' codes
    scale: torch.Tensor,  # [out, in / 32] float32
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:
    """Launcher: x W^T (+ b) for a few rows with W = q * scale rebuilt from
    8-bit codes as it streams (kernels/linear.BlockWeight)."""
    ops = _required_ops()
    if x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    return _run(ops, "linear_q8_small_rows", x, codes, scale, bias)


def has_bf16_pairs() -> bool:
    """Whether bfloat16 linears can run on the AVX512-BF16 pairs kernel here."""
    ops = load_cpu_ops()
    return ops is not None and bool(ops.has_bf16_pairs())


# Output columns per tile of pack_bf16_pairs (kTileCols in linear_bf16.h).
PAIRS_TILE_COLS = 48


def pack_bf16_pairs(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """W [out, in] bfloat16 in the pairs kernel's layout: [tiles, (in + 1) / 2,
    48, 2], zero-padded to whole tiles and an even number of inputs, so that
    one 64-byte load holds 16 columns x 2 consecutive inputs.

    glu: W is a gated MLP's gate|up projection (gate rows, then as many up
    rows); each tile then holds 24 units' gate columns and their up columns,
    for linear_bf16_pairs' gated forms (GLU_CONCAT, GLU_SILU_MUL)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError("expected bfloat16 weights [out, in]")
    outs, ins = weight.shape
    if glu:
        if outs % 2:
            raise ValueError("glu: expected gate|up weights, an even number of rows")
        half, units = PAIRS_TILE_COLS // 2, outs // 2
        tiles = -(-units // half)
        gate_up = weight.new_zeros(2, tiles * half, ins)
        gate_up[:, :units] = weight.view(2, units, ins)
        # [gate|up, tiles, 24, in] -> [tiles, gate 24 | up 24, in]
        weight = gate_up.view(2, tiles, half, ins).transpose(0, 1).reshape(-1, ins)
        outs = weight.shape[0]
    tiles, pairs = -(-outs // PAIRS_TILE_COLS), (ins + 1) // 2
    padded = weight.new_zeros(tiles * PAIRS_TILE_COLS, pairs * 2)
    padded[:outs, :ins] = weight
    return padded.view(tiles, PAIRS_TILE_COLS, pairs, 2).permute(0, 2, 1, 3).contiguous()


# linear_bf16_pairs' output forms over weights packed with glu=True:
# gate|up as the plain projection gives them, or silu(gate) * up.
GLU_CONCAT = 1
GLU_SILU_MUL = 2


def linear_bf16_pairs(
    x: torch.Tensor,  # [rows, in] bfloat16
    packed: torch.Tensor,  # pack_bf16_pairs(W)
    outs: int,
    bias: torch.Tensor | None = None,  # [out]
    float_out: bool = False,
    glu: int = 0,
) -> torch.Tensor:
    """Launcher: x W^T (+ b) on weights packed by pack_bf16_pairs
    (kernels/linear.Linear picks it for bfloat16 on AVX512-BF16): bfloat16,
    or with float_out the float32 sums of the exact products, unrounded.
    glu (weights packed with glu=True, no bias): GLU_CONCAT gives gate|up
    [rows, outs], GLU_SILU_MUL silu(gate) * up [rows, outs / 2], rounded as
    silu_and_mul of the former. The compiled op checks shapes, dtypes and
    layout."""
    ops = _required_ops()
    return _run(ops, "linear_bf16_pairs", x, packed, outs, bias, float_out, glu)


def has_bf16_dense_attention() -> bool:
    """Whether dense_attention runs here (the compiled kernel on AVX512-BF16)."""
    ops = load_cpu_ops()
    return ops is not None and bool(ops.has_bf16_dense_attention())


def dense_attention(
    q: torch.Tensor,  # [..., heads, Sq, D] bfloat16
    k: torch.Tensor,  # [..., kv_heads, Sk, D]: heads / kv_heads query heads share each
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over whole sequences (kernels/csrc/dense_attention.h):
    what F.scaled_dot_product_attention computes, in bfloat16 with float32
    sums, without materialising the scores. Causal: key j seen by query i
    when j <= i + Sk - Sq. Needs has_bf16_dense_attention()."""
    if q.dtype != torch.bfloat16 or k.shape != v.shape or q.shape[:-3] != k.shape[:-3]:
        raise ValueError("dense_attention: bfloat16 q [..., H, Sq, D], k and v [..., KVH, Sk, D]")
    lead, (sq, d), sk = q.shape[:-2], q.shape[-2:], k.shape[-2]
    out = _run(
        _required_ops(),
        "dense_attention_bf16",
        q.reshape(-1, sq, d),
        k.reshape(-1, sk, d),
        v.reshape(-1, sk, d),
        float(scale),
        causal,
    )
    return out.view(*lead, sq, d)


def has_int8_vnni() -> bool:
    """Whether int8 linears can run on the AVX512-VNNI kernel here."""
    ops = load_cpu_ops()
    return ops is not None and bool(ops.has_int8_vnni())


def linear_int8(
    x: torch.Tensor,  # [rows, in] bfloat16 or float32
    packed: torch.Tensor,  # [tiles, in4 / 4, 48, 4] uint8 (kernels/linear_int8.pack_int8)
    wscale: torch.Tensor,  # [tiles * 48] float32
    outs: int,
    bias: torch.Tensor | None = None,  # [out]
    int32_out: bool = False,
) -> torch.Tensor:
    """Launcher: x W^T (+ b) in dynamic W8A8 (each row of x quantized to int8 on
    the fly per group of 64 inputs, int32 sums, scaled per group and per
    channel) in x's dtype; with int32_out the exact int32 sums, unscaled. The
    compiled op checks shapes, dtypes and layout."""
    ops = _required_ops()
    return _run(ops, "linear_int8", x, packed, wscale, outs, bias, int32_out)
