// y = x W^T (+ b) for a few rows of x, on W in its plain [out, in] layout.
//
// With one to a few rows a linear layer does almost no arithmetic per weight
// it reads, so its time is the time to stream W from memory. This kernel
// reads each weight once, converts it to float32 in registers and multiplies
// it into every row: four output rows by two input rows per register tile,
// float32 sums, one horizontal reduction per output. The two cores each
// stream a contiguous half of W.
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_SMALL_ROWS_SIMD 1

inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const uint16_t* p) {  // bfloat16 bits
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8_f32(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int kTileOut = 4;  // output rows per register tile
constexpr int kTileIn = 2;   // input rows per register tile

// One tile: out[m][n] = x[m] . w[n] for the tile's kTileIn rows m and
// kTileOut rows n. Rows past the ends repeat the last one (their results are
// not stored), so the inner loop has no branches.
template <typename S>
inline void small_rows_tile(const typename S::T* const* xr, const typename S::T* const* wr,
                            int64_t in, float (*sums)[kTileOut]) {
  int64_t k = 0;
#ifdef PAGODA_SMALL_ROWS_SIMD
  __m256 acc[kTileIn][kTileOut];
  for (int m = 0; m < kTileIn; ++m)
    for (int n = 0; n < kTileOut; ++n) acc[m][n] = _mm256_setzero_ps();
  for (; k + 8 <= in; k += 8) {
    __m256 wv[kTileOut];
    for (int n = 0; n < kTileOut; ++n) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[n] + k + kTileOut * in), _MM_HINT_T0);
      wv[n] = load8_f32(wr[n] + k);
    }
    for (int m = 0; m < kTileIn; ++m) {
      const __m256 xv = load8_f32(xr[m] + k);
      for (int n = 0; n < kTileOut; ++n) acc[m][n] = _mm256_fmadd_ps(wv[n], xv, acc[m][n]);
    }
  }
  for (int m = 0; m < kTileIn; ++m)
    for (int n = 0; n < kTileOut; ++n) sums[m][n] = sum_lanes(acc[m][n]);
#else
  for (int m = 0; m < kTileIn; ++m)
    for (int n = 0; n < kTileOut; ++n) sums[m][n] = 0.f;
#endif
  for (; k < in; ++k)
    for (int m = 0; m < kTileIn; ++m)
      for (int n = 0; n < kTileOut; ++n) sums[m][n] += S::load(xr[m][k]) * S::load(wr[n][k]);
}

template <typename S>
void linear_small_rows_kernel(const typename S::T* x, int64_t x_stride, const typename S::T* w,
                              const typename S::T* bias, typename S::T* out, int64_t out_stride,
                              int64_t rows, int64_t in, int64_t outs) {
  using T = typename S::T;
  const int64_t tiles = (outs + kTileOut - 1) / kTileOut;
  // Enough tiles per task that each thread streams one long contiguous run.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTileOut;
      const T* wr[kTileOut];
      for (int n = 0; n < kTileOut; ++n) wr[n] = w + std::min(n0 + n, outs - 1) * in;
      // The tile's weights stay in L1 while later input rows reuse them.
      for (int64_t m0 = 0; m0 < rows; m0 += kTileIn) {
        const T* xr[kTileIn];
        for (int m = 0; m < kTileIn; ++m) xr[m] = x + std::min(m0 + m, rows - 1) * x_stride;
        float sums[kTileIn][kTileOut];
        small_rows_tile<S>(xr, wr, in, sums);
        for (int m = 0; m < kTileIn && m0 + m < rows; ++m)
          for (int n = 0; n < kTileOut && n0 + n < outs; ++n) {
            const float b = bias == nullptr ? 0.f : S::load(bias[n0 + n]);
            out[(m0 + m) * out_stride + n0 + n] = S::store(sums[m][n] + b);
          }
      }
    }
  });
}

// x [rows, in] (rows may be strided), weight [out, in] contiguous, bias [out]
// or None: a new [rows, out] tensor in x's dtype.
torch::Tensor linear_small_rows(const torch::Tensor& x, const torch::Tensor& weight,
                                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear_small_rows: x and weight must be 2-D");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_small_rows: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "linear_small_rows: x and weight dtypes differ");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_small_rows: x has ", x.size(1),
              " features, weight expects ", weight.size(1));
  TORCH_CHECK(weight.is_contiguous(), "linear_small_rows: weight must be contiguous");
  TORCH_CHECK(x.stride(1) == 1, "linear_small_rows: x rows must be contiguous");
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == outs && b.scalar_type() == x.scalar_type(),
                "linear_small_rows: bias must have ", outs, " entries of x's dtype");
  }
  auto out = torch::empty({rows, outs}, x.options());
  if (rows == 0 || outs == 0) return out;
  dispatch_storage(x.scalar_type(), "linear_small_rows", [&](auto s) {
    using S = decltype(s);
    linear_small_rows_kernel<S>(ptr<S>(x), x.stride(0), ptr<S>(weight),
                                b.defined() ? ptr<S>(b) : nullptr, ptr<S>(out), outs, rows, in,
                                outs);
  });
  return out;
}

}  // namespace
