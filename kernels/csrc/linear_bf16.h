// y = x W^T (+ b) in bfloat16 on AVX512-BF16, at every row count.
//
// W is packed once, at load (kernels/linear.py, pack_bf16_pairs), into tiles
// of kTileCols output columns: [tiles][in / 2][kTileCols][2], so one 64-byte
// load holds 16 columns x 2 consecutive inputs, the operand `vdpbf16ps`
// multiplies by a broadcast pair of x's inputs (exact bf16 products, float32
// sums). Each tile's weights are one contiguous run that the tile reads once
// from memory and then from cache for every further block of kRowBlock rows;
// a register block holds kRowBlock rows x kTileCols columns of float32 sums
// (24 of the 32 registers). The result, bias added in float32, is rounded to
// bfloat16 once, as oneDNN's bfloat16 matmul rounds it.
//
// oneDNN's packed path does the same arithmetic but streams the weights
// slower at decode sizes: figures in kernels/linear.py's docstring
// (`python scripts/bench_cpu_kernels.py --linear --dtype bfloat16`).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

constexpr int64_t kTileCols = 48;  // output columns per tile (3 registers of 16)
constexpr int64_t kRowBlock = 8;   // rows per register block
// Rows per work item: the work is split over (tile, row group) pairs so that
// long prompt chunks on narrow layers still give every thread work.
constexpr int64_t kRowGroup = 64;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGODA_BF16_PAIRS 1

// Out: uint16_t (bfloat16, rounded once) or float (the float32 sums).
template <int R, typename Out>
inline void pairs_block(const uint16_t* x, int64_t x_stride, int64_t in, const uint16_t* w,
                        const float* bias, Out* y, int64_t y_stride, int64_t cols) {
  constexpr int Z = kTileCols / 16;
  __m512 acc[R][Z];
  for (int m = 0; m < R; ++m)
    for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_setzero_ps();
  const int64_t pairs = in / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kTileCols * 2;
    __m512bh wv[Z];
    for (int z = 0; z < Z; ++z) wv[z] = (__m512bh)_mm512_loadu_si512(wp + 32 * z);
    for (int m = 0; m < R; ++m) {
      int32_t two;
      __builtin_memcpy(&two, x + m * x_stride + 2 * p, sizeof two);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
      for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], wv[z], xv);
    }
  }
  if (in & 1) {  // the last input pairs with a zero (its weight pair is padded too)
    const uint16_t* wp = w + pairs * kTileCols * 2;
    __m512bh wv[Z];
    for (int z = 0; z < Z; ++z) wv[z] = (__m512bh)_mm512_loadu_si512(wp + 32 * z);
    for (int m = 0; m < R; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[m * x_stride + in - 1]);
      for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], wv[z], xv);
    }
  }
  for (int z = 0; z < Z; ++z) {
    const int64_t c0 = 16 * z;
    if (c0 >= cols) break;
    const int n = static_cast<int>(std::min<int64_t>(16, cols - c0));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c0);
    for (int m = 0; m < R; ++m) {
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(y + m * y_stride + c0, mask, _mm512_add_ps(acc[m][z], b));
      } else {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][z], b));
        _mm256_mask_storeu_epi16(y + m * y_stride + c0, mask, h);
      }
    }
  }
}

template <typename Out>
void linear_bf16_pairs_kernel(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                              const float* bias, Out* y, int64_t rows, int64_t in,
                              int64_t outs) {
  const int64_t tiles = (outs + kTileCols - 1) / kTileCols;
  const int64_t groups = (rows + kRowGroup - 1) / kRowGroup;
  const int64_t tile_elems = (in + 1) / 2 * kTileCols * 2;
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / groups, group = item % groups;
    const uint16_t* wt = w + tile * tile_elems;
    const int64_t c0 = tile * kTileCols, cols = std::min(kTileCols, outs - c0);
    const float* bt = bias == nullptr ? nullptr : bias + c0;
    const int64_t last = std::min(rows, (group + 1) * kRowGroup);
    for (int64_t m0 = group * kRowGroup; m0 < last; m0 += kRowBlock) {
      const uint16_t* xm = x + m0 * x_stride;
      Out* ym = y + m0 * outs + c0;
      switch (std::min(kRowBlock, last - m0)) {
#define PAGODA_PAIRS_CASE(R) \
  case R: pairs_block<R, Out>(xm, x_stride, in, wt, bt, ym, outs, cols); break;
        PAGODA_PAIRS_CASE(1) PAGODA_PAIRS_CASE(2) PAGODA_PAIRS_CASE(3) PAGODA_PAIRS_CASE(4)
        PAGODA_PAIRS_CASE(5) PAGODA_PAIRS_CASE(6) PAGODA_PAIRS_CASE(7) PAGODA_PAIRS_CASE(8)
#undef PAGODA_PAIRS_CASE
      }
    }
  };
  // Items in tile-major order: each thread streams a contiguous run of weights.
  at::parallel_for(0, tiles * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) run_item(item);
  });
}
#endif

bool has_bf16_pairs() {
#ifdef PAGODA_BF16_PAIRS
  return true;
#else
  return false;
#endif
}

// x [rows, in] bfloat16 (rows may be strided), packed [tiles, (in + 1) / 2,
// kTileCols, 2] bfloat16 from pack_bf16_pairs, bias [out] or None: a new
// [rows, out] bfloat16 tensor, or with float_out the float32 sums unrounded.
torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t outs,
                                const c10::optional<torch::Tensor>& bias, bool float_out) {
  TORCH_CHECK(has_bf16_pairs(), "linear_bf16_pairs: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "linear_bf16_pairs: x must be 2-D, packed 4-D");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16_pairs: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "linear_bf16_pairs: bfloat16 tensors only");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == (in + 1) / 2 &&
                  packed.size(2) == kTileCols && packed.size(3) == 2 &&
                  packed.size(0) * kTileCols >= outs && outs >= 0,
              "linear_bf16_pairs: packed weights do not match ", in, " inputs and ", outs,
              " outputs");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == outs, "linear_bf16_pairs: bias must have ", outs, " entries");
  }
  auto y = torch::empty({rows, outs}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || outs == 0) return y;
  if (in == 0) {
    y.zero_();
    if (b.defined()) y.add_(b);
    return y;
  }
#ifdef PAGODA_BF16_PAIRS
  auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (float_out)
    linear_bf16_pairs_kernel(xp, xs.stride(0), wp, bp, y.data_ptr<float>(), rows, in, outs);
  else
    linear_bf16_pairs_kernel(xp, xs.stride(0), wp, bp, reinterpret_cast<uint16_t*>(y.data_ptr()),
                             rows, in, outs);
#endif
  return y;
}

}  // namespace
