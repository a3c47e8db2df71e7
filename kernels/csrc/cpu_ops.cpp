// Pagoda's compiled CPU kernels, one translation unit: paged attention
// (attention.h), dense attention over whole sequences (dense_attention.h), fused elementwise ops (elementwise.h), linear layers over
// a few rows (linear.h), bfloat16 linears on AVX512-BF16 (linear_bf16.h),
// dynamic int8 linears on AVX512-VNNI (linear_int8.h),
// the logits helpers (logits.h) and the sampler (sampling.h). Built once per
// machine by kernels/cpu_ops.py.
#include <torch/extension.h>

#include "attention.h"
#include "dense_attention.h"
#include "elementwise.h"
#include "linear.h"
#include "linear_bf16.h"
#include "linear_int8.h"
#include "logits.h"
#include "sampling.h"

// A decode step's attention straight from the fused qkv projection
// [B, (heads + 2 kv_heads) * D]: the neox rotary embedding of q and k in
// place, then write_kv_decode_attention. One call a layer where Python
// would split, view and rotate first.
torch::Tensor qkv_decode_attention(torch::Tensor qkv, int64_t heads, torch::Tensor positions,
                                   torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                   torch::Tensor v_cache, torch::Tensor slots,
                                   torch::Tensor block_tables, torch::Tensor seq_lens,
                                   double scale) {
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [NB, BS, KVH, D]");
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && heads > 0 && qkv.size(1) == (heads + 2 * KVH) * D,
              "qkv must be [B, (heads + 2 kv_heads) * head_dim]");
  qkv = qkv.contiguous();
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions must be int64, one per row");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D / 2 && D % 2 == 0 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [max_positions, head_dim / 2] of qkv's dtype");
  const int64_t B = qkv.size(0), row = qkv.size(1);
  auto q = qkv.as_strided({B, heads, D}, {row, D, 1}, qkv.storage_offset());
  auto k = qkv.as_strided({B, KVH, D}, {row, D, 1}, qkv.storage_offset() + heads * D);
  auto v = qkv.as_strided({B, KVH, D}, {row, D, 1}, qkv.storage_offset() + (heads + KVH) * D);
  rotary_embedding(q, k, positions, cos, sin);
  return write_kv_decode_attention(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU, float32)");
  m.def("sample_rows", &sample_rows,
        "one token per row by inverse CDF after temperature, top-k, top-p, min-p (CPU)");
  m.def("philox_uniforms", &philox_uniforms, "Philox4x32-10 uniforms in [0, 1) by seed and counter");
  m.def("apply_penalties", &apply_penalties,
        "repetition, frequency and presence penalties from token histories, in place (CPU)");
  m.def("refine_leading_logits", &refine_leading_logits,
        "recompute each row's near-maximal logits in float32, in place (CPU, bfloat16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "attention of one query row per entry over its block table row (CPU)");
  m.def("write_kv_slots", &write_kv_slots,
        "store a step's keys and values at their cache slots, each slot checked first (CPU)");
  m.def("write_kv_decode_attention", &write_kv_decode_attention,
        "store a decode step's keys and values at their slots, then paged attention (CPU)");
  m.def("qkv_decode_attention", &qkv_decode_attention,
        "rotary embedding of a fused qkv, then write_kv_decode_attention (CPU)");
  m.def("has_bf16_attention", &has_bf16_attention,
        "whether bfloat16 attention runs on AVX512-BF16 instructions");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up (CPU)");
  m.def("linear_small_rows", &linear_small_rows,
        "x W^T (+ b) for a few rows, streaming W once (CPU)");
  m.def("linear_q4_small_rows", &linear_q4_small_rows,
        "x W^T (+ b) for a few rows on GGUF Q4 blocks of W (CPU)");
  m.def("linear_q8_small_rows", &linear_q8_small_rows,
        "x W^T (+ b) for a few rows on GGUF Q8_0 blocks of W (CPU)");
  m.def("has_bf16_pairs", &has_bf16_pairs,
        "whether bfloat16 linears run on AVX512-BF16 over weights packed in pairs");
  m.def("linear_bf16_pairs", &linear_bf16_pairs,
        "x W^T (+ b) in bfloat16 over weights packed by pack_bf16_pairs (CPU)");
  m.def("has_int8_vnni", &has_int8_vnni, "whether int8 linears run on AVX512-VNNI here");
  m.def("linear_int8", &linear_int8,
        "x W^T (+ b) in dynamic W8A8 over weights packed by pack_int8 (CPU, AVX512-VNNI)");
  m.def("has_bf16_dense_attention", &has_bf16_dense_attention,
        "whether dense_attention_bf16 runs here (AVX512-BF16)");
  m.def("dense_attention_bf16", &dense_attention_bf16,
        "softmax(q k^T * scale) v per sequence, optionally causal, bfloat16 (CPU, AVX512-BF16)");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k in place (CPU)");
}
