// Pagoda's compiled CPU kernels, one translation unit: paged attention
// (attention.h), fused elementwise ops (elementwise.h), linear layers over
// a few rows (linear.h), bfloat16 linears on AVX512-BF16 (linear_bf16.h)
// and the logits helpers (logits.h). Built once per
// machine by kernels/cpu_ops.py.
#include <torch/extension.h>

#include "attention.h"
#include "elementwise.h"
#include "linear.h"
#include "linear_bf16.h"
#include "logits.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU, float32)");
  m.def("refine_leading_logits", &refine_leading_logits,
        "recompute each row's near-maximal logits in float32, in place (CPU, bfloat16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "attention of one query row per entry over its block table row (CPU)");
  m.def("write_kv_decode_attention", &write_kv_decode_attention,
        "store a decode step's keys and values at their slots, then paged attention (CPU)");
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
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k in place (CPU)");
}
