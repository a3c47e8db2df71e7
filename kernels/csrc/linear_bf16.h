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
// A gated MLP's gate|up projection can be packed with each tile holding 24
// gate columns and the 24 up columns of the same units (pack_bf16_pairs(...,
// glu=True)). The kernel then either writes gate|up in their usual order
// (kGluConcat) or straight away silu(gate) * up (kGluSiluMul), rounded where
// the unfused ops round: gate and up to bfloat16, silu, the product. That
// saves silu_and_mul's pass over the projection's output.
//
// oneDNN's packed path does the same arithmetic but streams the weights
// slower at decode sizes: figures in kernels/linear.py's docstring
// (`python scripts/bench_cpu_kernels.py --linear --dtype bfloat16`).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "elementwise.h"  // silu_mul_bf16

namespace {

constexpr int64_t kTileCols = 48;  // output columns per tile (3 registers of 16)
constexpr int64_t kRowBlock = 8;   // rows per register block
// Rows per work item: the work is split over (tile, row group) pairs so that
// long prompt chunks on narrow layers still give every thread work.
constexpr int64_t kRowGroup = 64;
// Output forms: plain tiles; gate|up tiles written as gate|up; as silu(gate) * up.
constexpr int kPlain = 0, kGluConcat = 1, kGluSiluMul = 2;
constexpr int64_t kGluHalf = kTileCols / 2;  // gate (or up) columns per tile

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGODA_BF16_PAIRS 1

// The gated forms' epilogue for one row, from its three sum registers:
// columns 0-23 of the tile are units' gate sums, 24-47 their up sums; n of
// the 24 units are real. y: the row's first gate output; kGluConcat writes
// the up outputs up_offset on.
template <int Mode>
inline void glu_store(const __m512* acc, int64_t n, uint16_t* y, int64_t up_offset) {
  // Units 0-15: gate acc[0], up acc[1] lanes 8-15 | acc[2] lanes 0-7.
  // Units 16-23: gate acc[1] lanes 0-7, up acc[2] lanes 8-15.
  const __m512 gate_a = acc[0], gate_b = acc[1];
  const __m512 up_a = _mm512_shuffle_f32x4(acc[1], acc[2], _MM_SHUFFLE(1, 0, 3, 2));
  const __m512 up_b = _mm512_shuffle_f32x4(acc[2], acc[2], _MM_SHUFFLE(3, 2, 3, 2));
  const __mmask16 mask_a = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
  const __mmask16 mask_b = n > 16 ? __mmask16((1u << (n - 16)) - 1u) : __mmask16(0);
  if constexpr (Mode == kGluConcat) {
    _mm256_mask_storeu_epi16(y, mask_a, (__m256i)_mm512_cvtneps_pbh(gate_a));
    _mm256_mask_storeu_epi16(y + 16, mask_b, (__m256i)_mm512_cvtneps_pbh(gate_b));
    _mm256_mask_storeu_epi16(y + up_offset, mask_a, (__m256i)_mm512_cvtneps_pbh(up_a));
    _mm256_mask_storeu_epi16(y + up_offset + 16, mask_b, (__m256i)_mm512_cvtneps_pbh(up_b));
  } else {  // gate and up rounded as the plain form stores them, then silu_and_mul
    _mm256_mask_storeu_epi16(y, mask_a, silu_mul_x16(round_bf16_x16(gate_a), round_bf16_x16(up_a)));
    if (mask_b)
      _mm256_mask_storeu_epi16(y + 16, mask_b, silu_mul_x16(round_bf16_x16(gate_b), round_bf16_x16(up_b)));
  }
}

// Out: uint16_t (bfloat16, rounded once) or float (the float32 sums).
// Mode kPlain: cols real columns at y; a gated Mode: cols real units.
template <int R, typename Out, int Mode = kPlain>
inline void pairs_block(const uint16_t* x, int64_t x_stride, int64_t in, const uint16_t* w,
                        const float* bias, Out* y, int64_t y_stride, int64_t cols,
                        int64_t up_offset = 0) {
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
  if constexpr (Mode != kPlain) {
    static_assert(std::is_same_v<Out, uint16_t>, "the gated forms write bfloat16");
    for (int m = 0; m < R; ++m) glu_store<Mode>(acc[m], cols, y + m * y_stride, up_offset);
    return;
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

// outs: the projection's output columns (gate and up together in a gated Mode).
template <typename Out, int Mode = kPlain>
void linear_bf16_pairs_kernel(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                              const float* bias, Out* y, int64_t rows, int64_t in,
                              int64_t outs) {
  const int64_t units = outs / 2;  // the gated forms' gate (and up) columns
  const int64_t tiles = Mode == kPlain ? (outs + kTileCols - 1) / kTileCols
                                       : (units + kGluHalf - 1) / kGluHalf;
  const int64_t groups = (rows + kRowGroup - 1) / kRowGroup;
  const int64_t tile_elems = (in + 1) / 2 * kTileCols * 2;
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / groups, group = item % groups;
    const uint16_t* wt = w + tile * tile_elems;
    // Where the tile's outputs go: plain, its columns; gated, its units'
    // gate columns (kGluConcat, rows of gate|up) or activations (kGluSiluMul).
    const int64_t c0 = Mode == kPlain ? tile * kTileCols : tile * kGluHalf;
    const int64_t cols = Mode == kPlain ? std::min(kTileCols, outs - c0) : std::min(kGluHalf, units - c0);
    const int64_t y_stride = Mode == kGluSiluMul ? units : outs;
    const float* bt = bias == nullptr ? nullptr : bias + c0;
    const int64_t last = std::min(rows, (group + 1) * kRowGroup);
    for (int64_t m0 = group * kRowGroup; m0 < last; m0 += kRowBlock) {
      const uint16_t* xm = x + m0 * x_stride;
      Out* ym = y + m0 * y_stride + c0;
      switch (std::min(kRowBlock, last - m0)) {
#define PAGODA_PAIRS_CASE(R) \
  case R: pairs_block<R, Out, Mode>(xm, x_stride, in, wt, bt, ym, y_stride, cols, units); break;
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
// glu: kPlain, or a gated form over gate|up weights packed with glu=True
// (no bias): [rows, out] gate|up (kGluConcat), [rows, out / 2] silu(gate) * up.
torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t outs,
                                const c10::optional<torch::Tensor>& bias, bool float_out,
                                int64_t glu) {
  TORCH_CHECK(has_bf16_pairs(), "linear_bf16_pairs: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "linear_bf16_pairs: x must be 2-D, packed 4-D");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16_pairs: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "linear_bf16_pairs: bfloat16 tensors only");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(glu == kPlain || glu == kGluConcat || glu == kGluSiluMul,
              "linear_bf16_pairs: glu must be 0 (plain), 1 (gate|up) or 2 (silu(gate) * up)");
  const bool gated = glu != kPlain;
  TORCH_CHECK(!gated || (outs % 2 == 0 && !float_out && !(bias.has_value() && bias->defined())),
              "linear_bf16_pairs: the gated forms take an even number of outputs, "
              "no bias and no float_out");
  const int64_t tiles = gated ? (outs / 2 + kGluHalf - 1) / kGluHalf : (outs + kTileCols - 1) / kTileCols;
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == (in + 1) / 2 &&
                  packed.size(2) == kTileCols && packed.size(3) == 2 && packed.size(0) == tiles &&
                  outs >= 0,
              "linear_bf16_pairs: packed weights do not match ", in, " inputs and ", outs,
              " outputs");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == outs, "linear_bf16_pairs: bias must have ", outs, " entries");
  }
  auto y = torch::empty({rows, glu == kGluSiluMul ? outs / 2 : outs},
                        x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
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
  auto* yb = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (glu == kGluConcat)
    linear_bf16_pairs_kernel<uint16_t, kGluConcat>(xp, xs.stride(0), wp, nullptr, yb, rows, in, outs);
  else if (glu == kGluSiluMul)
    linear_bf16_pairs_kernel<uint16_t, kGluSiluMul>(xp, xs.stride(0), wp, nullptr, yb, rows, in, outs);
  else if (float_out)
    linear_bf16_pairs_kernel(xp, xs.stride(0), wp, bp, y.data_ptr<float>(), rows, in, outs);
  else
    linear_bf16_pairs_kernel(xp, xs.stride(0), wp, bp, yb, rows, in, outs);
#endif
  return y;
}

}  // namespace
