// y = x W^T (+ b) in dynamic W8A8 on AVX512-VNNI, at every row count.
//
// W is quantized and packed once, at load (kernels/linear_int8.py,
// pack_int8): int8, symmetric per output channel (w = q_w * w_scale[c]),
// stored + 128 as unsigned bytes, in tiles of kI8TileCols output columns:
// [tiles][in4 / 4][kI8TileCols][4], so one 64-byte load holds 16 columns x 4
// consecutive inputs, the unsigned operand of `vpdpbusd`. Each row of x is
// quantized on the fly, symmetric per token and per group of kI8Group
// consecutive inputs (x ~ q_x * x_scale[m, g], q_x in -127..127, rounded
// half to even), into a scratch buffer, with each group's sum of q_x.
//
// `vpdpbusd` multiplies unsigned by signed bytes (this CPU has no
// `vpdpbssd`, which is AVX-VNNI-INT8), hence the +128 on the weights; the
// kernel subtracts 128 * sum_k q_x[m, k] per group, so the int32 sums are
// exactly sum_k q_x[m, k] * q_w[c, k] over the group (no overflow). Each
// group's sums are scaled by x_scale[m, g] into float32, and at the end by
// w_scale[c] (+ b), rounded once to the output dtype.
//
// Why groups of 64 and not one scale per token: activations have outlier
// channels, and one scale per row spends the 8 bits on them. On the default
// model, over 2046 tokens of English text, quantizing only the activations
// per token cost +2.3% perplexity, per group of 64 +0.2%
// (scripts/bench_int8_quality.py has the whole model's figures).
//
// The tile loop is the bfloat16 pairs kernel's (linear_bf16.h): a register
// block of kI8RowBlock rows x kI8TileCols columns of int32 sums plus their
// float32 totals, work split over (tile, row group) items in tile-major order.
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

constexpr int64_t kI8TileCols = 48;  // output columns per tile (3 registers of 16)
constexpr int64_t kI8RowBlock = 4;   // rows per register block (int32 and float32 sums)
constexpr int64_t kI8RowGroup = 64;  // rows per work item
constexpr int64_t kI8Group = 64;     // inputs per activation scale
constexpr int64_t kI8GroupQuads = kI8Group / 4;

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGODA_INT8_VNNI 1

// acc += the 4-byte dot products of u8 (unsigned) and s8 (signed), in place.
// GCC 12's intrinsic does not tie the accumulator to its register: over a
// block of accumulators it copied each one and spilled them to the stack
// every iteration (0.8x the bfloat16 kernel at 64 rows); the asm keeps them.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// Out: uint16_t (bfloat16), float, or int32_t (the exact integer sums over
// all inputs, unscaled, for tests). x: R rows of in4 signed bytes; xscale and
// xsum: R rows of `groups` entries.
template <int R, typename Out>
inline void int8_block(const int8_t* x, int64_t in4, int64_t groups, const uint8_t* w,
                       const float* wscale, const float* xscale, const int32_t* xsum,
                       const float* bias, Out* y, int64_t y_stride, int64_t cols) {
  constexpr int Z = kI8TileCols / 16;
  constexpr bool kInt = std::is_same_v<Out, int32_t>;
  __m512 total[R][Z];
  __m512i itotal[R][Z];
  for (int m = 0; m < R; ++m)
    for (int z = 0; z < Z; ++z) {
      total[m][z] = _mm512_setzero_ps();
      itotal[m][z] = _mm512_setzero_si512();
    }
  const int64_t quads = in4 / 4;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][Z];
    for (int m = 0; m < R; ++m)
      for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_setzero_si512();
    const int64_t end = std::min(quads, (g + 1) * kI8GroupQuads);
    for (int64_t p = g * kI8GroupQuads; p < end; ++p) {
      const uint8_t* wp = w + p * kI8TileCols * 4;
      __m512i wv[Z];
      for (int z = 0; z < Z; ++z) wv[z] = _mm512_loadu_si512(wp + 64 * z);
      for (int m = 0; m < R; ++m) {
        int32_t four;
        std::memcpy(&four, x + m * in4 + 4 * p, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int z = 0; z < Z; ++z) acc[m][z] = dpbusd(acc[m][z], wv[z], xv);
      }
    }
    for (int m = 0; m < R; ++m) {
      // The +128 of the weights, undone: 128 * the group's sum of q_x.
      const __m512i shift = _mm512_set1_epi32(xsum[m * groups + g] * 128);
      const __m512 xs = _mm512_set1_ps(xscale[m * groups + g]);
      for (int z = 0; z < Z; ++z) {
        const __m512i sums = _mm512_sub_epi32(acc[m][z], shift);
        if constexpr (kInt)
          itotal[m][z] = _mm512_add_epi32(itotal[m][z], sums);
        else
          total[m][z] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), xs, total[m][z]);
      }
    }
  }
  for (int z = 0; z < Z; ++z) {
    const int64_t c0 = 16 * z;
    if (c0 >= cols) break;
    const int n = static_cast<int>(std::min<int64_t>(16, cols - c0));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, wscale + c0);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c0);
    for (int m = 0; m < R; ++m) {
      if constexpr (kInt) {
        _mm512_mask_storeu_epi32(y + m * y_stride + c0, mask, itotal[m][z]);
      } else {
        const __m512 v = _mm512_fmadd_ps(total[m][z], ws, b);
        if constexpr (std::is_same_v<Out, float>)
          _mm512_mask_storeu_ps(y + m * y_stride + c0, mask, v);
        else
          _mm256_mask_storeu_epi16(y + m * y_stride + c0, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

template <typename Out>
void linear_int8_kernel(const int8_t* x, const float* xscale, const int32_t* xsum,
                        const uint8_t* w, const float* wscale, const float* bias, Out* y,
                        int64_t rows, int64_t in4, int64_t outs) {
  const int64_t tiles = (outs + kI8TileCols - 1) / kI8TileCols;
  const int64_t row_groups = (rows + kI8RowGroup - 1) / kI8RowGroup;
  const int64_t groups = (in4 + kI8Group - 1) / kI8Group;
  const int64_t tile_elems = in4 * kI8TileCols;
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / row_groups, row_group = item % row_groups;
    const uint8_t* wt = w + tile * tile_elems;
    const int64_t c0 = tile * kI8TileCols;
    const int64_t cols = std::min(kI8TileCols, outs - c0);
    const float* bt = bias == nullptr ? nullptr : bias + c0;
    const int64_t last = std::min(rows, (row_group + 1) * kI8RowGroup);
    for (int64_t m0 = row_group * kI8RowGroup; m0 < last; m0 += kI8RowBlock) {
      const int8_t* xm = x + m0 * in4;
      const float* sm = xscale + m0 * groups;
      const int32_t* um = xsum + m0 * groups;
      Out* ym = y + m0 * outs + c0;
      switch (std::min(kI8RowBlock, last - m0)) {
#define PAGODA_INT8_CASE(R)                                                                   \
  case R:                                                                                     \
    int8_block<R, Out>(xm, in4, groups, wt, wscale + c0, sm, um, bt, ym, outs, cols);       \
    break;
        PAGODA_INT8_CASE(1) PAGODA_INT8_CASE(2) PAGODA_INT8_CASE(3) PAGODA_INT8_CASE(4)
#undef PAGODA_INT8_CASE
      }
    }
  };
  at::parallel_for(0, tiles * row_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) run_item(item);
  });
}

template <typename In>
inline float load_f(const In* x, int64_t k) {
  if constexpr (std::is_same_v<In, float>) return x[k];
  else return bf16_bits_to_f(x[k]);
}

// One row of x quantized per group of kI8Group inputs: q = round_half_even(x
// * (127 / amax)), in in4 bytes (the padding zero); per group the scale
// amax / 127 and the sum of q.
template <typename In>
inline void quantize_row(const In* x, int64_t in, int64_t in4, int8_t* q, float* scale,
                         int32_t* qsum) {
  for (int64_t g0 = 0, g = 0; g0 < in4; g0 += kI8Group, ++g) {
    const int64_t g1 = std::min(in, g0 + kI8Group);
    float amax = 0.f;
    for (int64_t k = g0; k < g1; ++k) amax = std::max(amax, std::fabs(load_f(x, k)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    int64_t k = g0;
    for (; k + 16 <= g1; k += 16) {
      __m512 v;
      if constexpr (std::is_same_v<In, float>) {
        v = _mm512_loadu_ps(x + k);
      } else {
        v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k))), 16));
      }
      // Round to nearest even (the default MXCSR mode), as torch.round.
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
      sum += _mm512_reduce_add_epi32(qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(qi));
    }
    for (; k < g1; ++k) {
      const int32_t qi = static_cast<int32_t>(std::nearbyint(load_f(x, k) * inv));
      sum += qi;
      q[k] = static_cast<int8_t>(qi);
    }
    for (; k < std::min(in4, g0 + kI8Group); ++k) q[k] = 0;
    scale[g] = amax / 127.f;
    qsum[g] = sum;
  }
}
#endif

bool has_int8_vnni() {
#ifdef PAGODA_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// x [rows, in] bfloat16 or float32 (rows may be strided); packed [tiles, in4
// / 4, kI8TileCols, 4] uint8 (q_w + 128) from pack_int8 (in4: in rounded up
// to 4); wscale [tiles * kI8TileCols] float32; bias [out] or None. Returns a
// new [rows, out] tensor in x's dtype, or with int32_out the exact int32
// sums sum_k q_x q_w (x quantized per group, unscaled).
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& wscale, int64_t outs,
                          const c10::optional<torch::Tensor>& bias, bool int32_out) {
  TORCH_CHECK(has_int8_vnni(), "linear_int8: this CPU has no AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "linear_int8: x must be 2-D, packed 4-D");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_int8: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_int8: x must be bfloat16 or float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "linear_int8: packed must be contiguous uint8");
  const int64_t rows = x.size(0), in = x.size(1), in4 = (in + 3) / 4 * 4;
  const int64_t tiles = (outs + kI8TileCols - 1) / kI8TileCols;
  TORCH_CHECK(outs >= 0 && packed.size(0) == tiles && packed.size(1) == in4 / 4 &&
                  packed.size(2) == kI8TileCols && packed.size(3) == 4,
              "linear_int8: packed weights do not match ", in, " inputs and ", outs, " outputs");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() &&
                  wscale.numel() == tiles * kI8TileCols,
              "linear_int8: wscale must be contiguous float32 [", tiles * kI8TileCols, "]");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == outs, "linear_int8: bias must have ", outs, " entries");
  }
  auto y = torch::empty({rows, outs}, x.options().dtype(int32_out ? at::kInt : x.scalar_type()));
  if (rows == 0 || outs == 0) return y;
#ifdef PAGODA_INT8_VNNI
  auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t groups = (in4 + kI8Group - 1) / kI8Group;
  // The activations, quantized: [rows, in4] bytes, [rows, groups] scales and sums.
  std::vector<int8_t> q(static_cast<size_t>(rows * in4));
  std::vector<float> xscale(static_cast<size_t>(rows * groups));
  std::vector<int32_t> xsum(static_cast<size_t>(rows * groups));
  const int64_t x_stride = xs.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* qm = q.data() + m * in4;
      float* sm = xscale.data() + m * groups;
      int32_t* um = xsum.data() + m * groups;
      if (xs.scalar_type() == at::kFloat)
        quantize_row(xs.data_ptr<float>() + m * x_stride, in, in4, qm, sm, um);
      else
        quantize_row(reinterpret_cast<const uint16_t*>(xs.data_ptr()) + m * x_stride, in, in4, qm,
                     sm, um);
    }
  });
  const auto* wp = packed.data_ptr<uint8_t>();
  const float* cp = wscale.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (int32_out)
    linear_int8_kernel(q.data(), xscale.data(), xsum.data(), wp, cp, bp, y.data_ptr<int32_t>(),
                       rows, in4, outs);
  else if (y.scalar_type() == at::kFloat)
    linear_int8_kernel(q.data(), xscale.data(), xsum.data(), wp, cp, bp, y.data_ptr<float>(), rows,
                       in4, outs);
  else
    linear_int8_kernel(q.data(), xscale.data(), xsum.data(), wp, cp, bp,
                       reinterpret_cast<uint16_t*>(y.data_ptr()), rows, in4, outs);
#endif
  return y;
}

}  // namespace
