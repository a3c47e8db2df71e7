// y = x W^T (+ b) in dynamic W8A8 on AVX512-VNNI, at every row count.
//
// W is quantized and packed once, at load (kernels/linear_int8.py,
// pack_int8): int8, symmetric per output channel (w = q * w_scale[c]), in
// tiles of kI8TileCols output columns: [tiles][in4 / 4][kI8TileCols][4], so
// one 64-byte load holds 16 columns x 4 consecutive inputs, the operand of
// `vpdpbusd`. Each row of x is quantized on the fly, symmetric per token
// (x ~ q_x * x_scale[m], q_x in -127..127, rounded half to even), into a
// scratch buffer.
//
// `vpdpbusd` multiplies unsigned by signed bytes (this CPU has no
// `vpdpbssd`, which is AVX-VNNI-INT8), so the activations are stored
// shifted by +128 (0..254) and the kernel subtracts 128 * sum_k q_w[c, k],
// precomputed per channel at pack time: the int32 sums are exactly
// sum_k q_x[m, k] * q_w[c, k] (no overflow below ~130k inputs). They are
// then scaled: y = float(sum) * x_scale[m] * w_scale[c] (+ b), rounded once
// to the output dtype.
//
// The tile loop is the bfloat16 pairs kernel's (linear_bf16.h): a register
// block of kI8RowBlock rows x kI8TileCols columns of int32 sums, work split
// over (tile, row group) items in tile-major order.
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
constexpr int64_t kI8RowBlock = 8;   // rows per register block
constexpr int64_t kI8RowGroup = 64;  // rows per work item

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGODA_INT8_VNNI 1

// acc += the 4-byte dot products of u8 (unsigned) and s8 (signed), in place.
// GCC 12's intrinsic does not tie the accumulator to its register: over a
// block of 24 accumulators it copied each one and spilled them to the stack
// every iteration (0.8x the bfloat16 kernel at 64 rows); the asm keeps them.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// Out: uint16_t (bfloat16), float, or int32_t (the exact integer sums, for tests).
template <int R, typename Out>
inline void int8_block(const uint8_t* x, int64_t x_stride, int64_t in4, const int8_t* w,
                       const int32_t* wsum, const float* wscale, const float* xscale,
                       const float* bias, Out* y, int64_t y_stride, int64_t cols) {
  constexpr int Z = kI8TileCols / 16;
  __m512i acc[R][Z];
  for (int m = 0; m < R; ++m)
    for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_setzero_si512();
  const int64_t quads = in4 / 4;
  for (int64_t p = 0; p < quads; ++p) {
    const int8_t* wp = w + p * kI8TileCols * 4;
    __m512i wv[Z];
    for (int z = 0; z < Z; ++z) wv[z] = _mm512_loadu_si512(wp + 64 * z);
    for (int m = 0; m < R; ++m) {
      int32_t four;
      std::memcpy(&four, x + m * x_stride + 4 * p, sizeof four);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int z = 0; z < Z; ++z) acc[m][z] = dpbusd(acc[m][z], xv, wv[z]);
    }
  }
  for (int z = 0; z < Z; ++z) {
    const int64_t c0 = 16 * z;
    if (c0 >= cols) break;
    const int n = static_cast<int>(std::min<int64_t>(16, cols - c0));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    // The +128 shift of the activations, undone: 128 * sum_k q_w[c, k].
    const __m512i shift = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, wsum + c0), 7);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, wscale + c0);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c0);
    for (int m = 0; m < R; ++m) {
      const __m512i sums = _mm512_sub_epi32(acc[m][z], shift);
      if constexpr (std::is_same_v<Out, int32_t>) {
        _mm512_mask_storeu_epi32(y + m * y_stride + c0, mask, sums);
      } else {
        const __m512 v = _mm512_add_ps(
            _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xscale[m])), ws), b);
        if constexpr (std::is_same_v<Out, float>) {
          _mm512_mask_storeu_ps(y + m * y_stride + c0, mask, v);
        } else {
          _mm256_mask_storeu_epi16(y + m * y_stride + c0, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  }
}

template <typename Out>
void linear_int8_kernel(const uint8_t* x, int64_t x_stride, const int8_t* w, const int32_t* wsum,
                        const float* wscale, const float* xscale, const float* bias, Out* y,
                        int64_t rows, int64_t in4, int64_t outs) {
  const int64_t tiles = (outs + kI8TileCols - 1) / kI8TileCols;
  const int64_t groups = (rows + kI8RowGroup - 1) / kI8RowGroup;
  const int64_t tile_elems = in4 * kI8TileCols;
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / groups, group = item % groups;
    const int8_t* wt = w + tile * tile_elems;
    const int64_t c0 = tile * kI8TileCols;
    const int64_t cols = std::min(kI8TileCols, outs - c0);
    const float* bt = bias == nullptr ? nullptr : bias + c0;
    const int64_t last = std::min(rows, (group + 1) * kI8RowGroup);
    for (int64_t m0 = group * kI8RowGroup; m0 < last; m0 += kI8RowBlock) {
      const uint8_t* xm = x + m0 * x_stride;
      Out* ym = y + m0 * outs + c0;
      switch (std::min(kI8RowBlock, last - m0)) {
#define PAGODA_INT8_CASE(R)                                                                  \
  case R:                                                                                    \
    int8_block<R, Out>(xm, x_stride, in4, wt, wsum + c0, wscale + c0, xscale + m0, bt, ym, \
                       outs, cols);                                                          \
    break;
        PAGODA_INT8_CASE(1) PAGODA_INT8_CASE(2) PAGODA_INT8_CASE(3) PAGODA_INT8_CASE(4)
        PAGODA_INT8_CASE(5) PAGODA_INT8_CASE(6) PAGODA_INT8_CASE(7) PAGODA_INT8_CASE(8)
#undef PAGODA_INT8_CASE
      }
    }
  };
  at::parallel_for(0, tiles * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) run_item(item);
  });
}

// One row of x quantized per token: q = round_half_even(x * (127 / amax)),
// stored + 128 in in4 bytes (the padding as 128, i.e. zero). Returns amax / 127.
template <typename In>
inline float quantize_row(const In* x, int64_t in, int64_t in4, uint8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < in; ++k) {
    float v;
    if constexpr (std::is_same_v<In, float>) v = x[k];
    else v = bf16_bits_to_f(x[k]);
    amax = std::max(amax, std::fabs(v));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 v;
    if constexpr (std::is_same_v<In, float>) {
      v = _mm512_loadu_ps(x + k);
    } else {
      v = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k))), 16));
    }
    // Round to nearest even (the default MXCSR mode), as torch.round.
    __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
    qi = _mm512_add_epi32(qi, _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtusepi32_epi8(qi));
  }
  for (; k < in; ++k) {
    float v;
    if constexpr (std::is_same_v<In, float>) v = x[k];
    else v = bf16_bits_to_f(x[k]);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(v * inv)) + 128);
  }
  for (; k < in4; ++k) q[k] = 128;
  return amax / 127.f;
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
// / 4, kI8TileCols, 4] int8 from pack_int8 (in4: in rounded up to 4); wsum
// [tiles * kI8TileCols] int32, the per-channel sums of the int8 weights;
// wscale [same] float32; bias [out] or None. Returns a new [rows, out] tensor
// in x's dtype, or with int32_out the exact int32 sums sum_k q_x q_w.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& wsum, const torch::Tensor& wscale, int64_t outs,
                          const c10::optional<torch::Tensor>& bias, bool int32_out) {
  TORCH_CHECK(has_int8_vnni(), "linear_int8: this CPU has no AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "linear_int8: x must be 2-D, packed 4-D");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_int8: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_int8: x must be bfloat16 or float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "linear_int8: packed must be contiguous int8");
  const int64_t rows = x.size(0), in = x.size(1), in4 = (in + 3) / 4 * 4;
  const int64_t tiles = (outs + kI8TileCols - 1) / kI8TileCols;
  TORCH_CHECK(outs >= 0 && packed.size(0) == tiles && packed.size(1) == in4 / 4 &&
                  packed.size(2) == kI8TileCols && packed.size(3) == 4,
              "linear_int8: packed weights do not match ", in, " inputs and ", outs, " outputs");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() &&
                  wsum.numel() == tiles * kI8TileCols,
              "linear_int8: wsum must be contiguous int32 [", tiles * kI8TileCols, "]");
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
  // The activations, quantized: [rows, in4] bytes and [rows] scales.
  std::vector<uint8_t> q(static_cast<size_t>(rows * in4));
  std::vector<float> xscale(static_cast<size_t>(rows));
  const int64_t x_stride = xs.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (xs.scalar_type() == at::kFloat)
        xscale[m] = quantize_row(xs.data_ptr<float>() + m * x_stride, in, in4, q.data() + m * in4);
      else
        xscale[m] = quantize_row(reinterpret_cast<const uint16_t*>(xs.data_ptr()) + m * x_stride,
                                 in, in4, q.data() + m * in4);
    }
  });
  const auto* wp = packed.data_ptr<int8_t>();
  const int32_t* sp = wsum.data_ptr<int32_t>();
  const float* cp = wscale.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (int32_out)
    linear_int8_kernel(q.data(), in4, wp, sp, cp, xscale.data(), bp, y.data_ptr<int32_t>(), rows,
                       in4, outs);
  else if (y.scalar_type() == at::kFloat)
    linear_int8_kernel(q.data(), in4, wp, sp, cp, xscale.data(), bp, y.data_ptr<float>(), rows, in4,
                       outs);
  else
    linear_int8_kernel(q.data(), in4, wp, sp, cp, xscale.data(), bp,
                       reinterpret_cast<uint16_t*>(y.data_ptr()), rows, in4, outs);
#endif
  return y;
}

}  // namespace
