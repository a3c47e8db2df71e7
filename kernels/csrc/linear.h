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
#include <cmath>
#include <cstdint>
#include <vector>
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


// The same product on weights as a GGUF file stores them, in blocks of 32
// inputs with a float32 scale d (and for 4-bit codes an offset m) per block:
// Q4_0 / Q4_1, 16 bytes of codes q in 0..15 (element j in the low nibble of
// byte j, element j + 16 in the high one), w = q * d + m; Q8_0, 32 signed
// bytes, w = q * d. Each weight is rebuilt in float32 with one FMA (or
// multiply), which rounds once as the dequantizer's q * d + m does (q * d is
// exact), so the kernel multiplies by exactly the float32 weights a GGUF
// model is loaded with while reading 4.5 (8.5) bits per weight instead of 32.
// A tile is one output row by up to four input rows, the weights rebuilt once
// per tile; one or two rows keep four accumulators each so that the FMAs of
// a block do not wait on one another.
constexpr int kCodesBlock = 32;
constexpr int kCodesTileIn = 4;

struct Q4Codes {
  static constexpr int kBytes = 16;
  static constexpr bool kOffset = true;
  static float code(const uint8_t* p, int j) {
    return static_cast<float>(j < 16 ? (p[j] & 0xF) : (p[j - 16] >> 4));
  }
#ifdef PAGODA_SMALL_ROWS_SIMD
  static void unpack(const uint8_t* p, __m256* q) {  // elements 0-7, 8-15, 16-23, 24-31
    const __m256i low = _mm256_set1_epi32(0xF);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
#endif
};

struct Q8Codes {
  static constexpr int kBytes = 32;
  static constexpr bool kOffset = false;
  static float code(const uint8_t* p, int j) { return static_cast<float>(static_cast<int8_t>(p[j])); }
#ifdef PAGODA_SMALL_ROWS_SIMD
  static void unpack(const uint8_t* p, __m256* q) {
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  }
#endif
};

template <typename S, typename C, int R>
inline void codes_tile(const typename S::T* const* xr, const uint8_t* q, const float* d,
                       const float* off, int64_t blocks, float* sums) {
#ifdef PAGODA_SMALL_ROWS_SIMD
  constexpr int A = R <= 2 ? 4 : 2;  // accumulators per row
  __m256 acc[R][A];
  for (int m = 0; m < R; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    C::unpack(q + b * C::kBytes, w);
    const __m256 scale = _mm256_broadcast_ss(d + b);
    for (int j = 0; j < 4; ++j)
      w[j] = C::kOffset ? _mm256_fmadd_ps(w[j], scale, _mm256_broadcast_ss(off + b))
                        : _mm256_mul_ps(w[j], scale);
    for (int m = 0; m < R; ++m) {
      const typename S::T* x = xr[m] + b * kCodesBlock;
      for (int j = 0; j < 4; ++j)
        acc[m][j % A] = _mm256_fmadd_ps(w[j], load8_f32(x + 8 * j), acc[m][j % A]);
    }
  }
  for (int m = 0; m < R; ++m) {
    __m256 total = acc[m][0];
    for (int a = 1; a < A; ++a) total = _mm256_add_ps(total, acc[m][a]);
    sums[m] = sum_lanes(total);
  }
#else
  for (int m = 0; m < R; ++m) {
    float s = 0.f;
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < kCodesBlock; ++j) {
        const float code = C::code(q + b * C::kBytes, j);
        const float w = C::kOffset ? std::fma(code, d[b], off[b]) : code * d[b];
        s += w * S::load(xr[m][b * kCodesBlock + j]);
      }
    sums[m] = s;
  }
#endif
}

#if defined(__AVX512F__)
#define PAGODA_CODES_AVX512 1
// With AVX512 the input rows are first converted to float32 (a few KB), and
// a 4-bit block's weights come from a table: its sixteen possible values
// q * d + m (one FMA, the dequantizer's rounding), looked up by each code
// with vpermps, which reads only an index's low 4 bits. A tile is two output
// rows by up to four input rows. The default model's 30 layers at one
// bfloat16 row: 6.9 ms against 12.0 for the AVX2 form, which converts the
// inputs and rebuilds with a convert and an FMA per 8 weights.
constexpr int kCodesTileOut512 = 2;

inline void rebuild_x32(Q4Codes, const uint8_t* p, const float* d, const float* off, __m512* w) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(*d), _mm512_set1_ps(*off));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = _mm512_permutexvar_ps(bytes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

inline void rebuild_x32(Q8Codes, const uint8_t* p, const float* d, const float*, __m512* w) {
  const __m512 scale = _mm512_set1_ps(*d);
  for (int h = 0; h < 2; ++h)
    w[h] = _mm512_mul_ps(
        _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)))),
        scale);
}

// sums[n][m] = x[m] . w[n] for the tile's O output rows (codes q, d, off at
// stride `row` blocks apart) and R float32 input rows of `in` elements.
template <typename C, int O, int R>
inline void codes_tile_512(const float* x, int64_t in, const uint8_t* q, const float* d,
                           const float* off, int64_t blocks, float (*sums)[kCodesTileIn]) {
  __m512 acc[O][R][2];
  for (int n = 0; n < O; ++n)
    for (int m = 0; m < R; ++m) acc[n][m][0] = acc[n][m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 w[O][2];
    for (int n = 0; n < O; ++n)
      rebuild_x32(C{}, q + (n * blocks + b) * C::kBytes, d + n * blocks + b,
                  C::kOffset ? off + n * blocks + b : nullptr, w[n]);
    for (int m = 0; m < R; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * in + b * kCodesBlock);
      const __m512 x1 = _mm512_loadu_ps(x + m * in + b * kCodesBlock + 16);
      for (int n = 0; n < O; ++n) {
        acc[n][m][0] = _mm512_fmadd_ps(w[n][0], x0, acc[n][m][0]);
        acc[n][m][1] = _mm512_fmadd_ps(w[n][1], x1, acc[n][m][1]);
      }
    }
  }
  for (int n = 0; n < O; ++n)
    for (int m = 0; m < R; ++m)
      sums[n][m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[n][m][0], acc[n][m][1]));
}

template <typename S, typename C, int O>
inline void codes_tiles_512(const float* x, int64_t in, int64_t rows, const uint8_t* q,
                            const float* d, const float* off, int64_t blocks,
                            float (*sums)[kCodesTileIn], int64_t m0) {
  const float* xm = x + m0 * in;
  switch (std::min<int64_t>(kCodesTileIn, rows - m0)) {
    case 1: return codes_tile_512<C, O, 1>(xm, in, q, d, off, blocks, sums);
    case 2: return codes_tile_512<C, O, 2>(xm, in, q, d, off, blocks, sums);
    case 3: return codes_tile_512<C, O, 3>(xm, in, q, d, off, blocks, sums);
    default: return codes_tile_512<C, O, 4>(xm, in, q, d, off, blocks, sums);
  }
}

template <typename S, typename C>
void linear_codes_kernel_512(const typename S::T* x, int64_t x_stride, const uint8_t* q,
                             const float* d, const float* off, const typename S::T* bias,
                             typename S::T* out, int64_t rows, int64_t in, int64_t outs) {
  const int64_t blocks = in / kCodesBlock;
  std::vector<float> xf(static_cast<size_t>(rows * in));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; ++k) xf[m * in + k] = S::load(x[m * x_stride + k]);
  const int64_t pairs = (outs + kCodesTileOut512 - 1) / kCodesTileOut512;
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n0 = pair * kCodesTileOut512;
      const int o = static_cast<int>(std::min<int64_t>(kCodesTileOut512, outs - n0));
      const uint8_t* qn = q + n0 * blocks * C::kBytes;
      const float* dn = d + n0 * blocks;
      const float* on = C::kOffset ? off + n0 * blocks : nullptr;
      for (int64_t m0 = 0; m0 < rows; m0 += kCodesTileIn) {
        float sums[kCodesTileOut512][kCodesTileIn];
        if (o == 2)
          codes_tiles_512<S, C, 2>(xf.data(), in, rows, qn, dn, on, blocks, sums, m0);
        else
          codes_tiles_512<S, C, 1>(xf.data(), in, rows, qn, dn, on, blocks, sums, m0);
        for (int n = 0; n < o; ++n) {
          const float b = bias == nullptr ? 0.f : S::load(bias[n0 + n]);
          for (int64_t m = m0; m < std::min<int64_t>(rows, m0 + kCodesTileIn); ++m)
            out[m * outs + n0 + n] = S::store(sums[n][m - m0] + b);
        }
      }
    }
  });
}
#endif

template <typename S, typename C>
void linear_codes_kernel(const typename S::T* x, int64_t x_stride, const uint8_t* q,
                         const float* d, const float* off, const typename S::T* bias,
                         typename S::T* out, int64_t rows, int64_t in, int64_t outs) {
  using T = typename S::T;
#ifdef PAGODA_CODES_AVX512
  return linear_codes_kernel_512<S, C>(x, x_stride, q, d, off, bias, out, rows, in, outs);
#endif
  const int64_t blocks = in / kCodesBlock;
  at::parallel_for(0, outs, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* qn = q + n * blocks * C::kBytes;
      const float* dn = d + n * blocks;
      const float* on = C::kOffset ? off + n * blocks : nullptr;
      const float b = bias == nullptr ? 0.f : S::load(bias[n]);
      for (int64_t m0 = 0; m0 < rows; m0 += kCodesTileIn) {
        const T* xr[kCodesTileIn];
        const int r = static_cast<int>(std::min<int64_t>(kCodesTileIn, rows - m0));
        for (int m = 0; m < r; ++m) xr[m] = x + (m0 + m) * x_stride;
        float sums[kCodesTileIn];
        switch (r) {
          case 1: codes_tile<S, C, 1>(xr, qn, dn, on, blocks, sums); break;
          case 2: codes_tile<S, C, 2>(xr, qn, dn, on, blocks, sums); break;
          case 3: codes_tile<S, C, 3>(xr, qn, dn, on, blocks, sums); break;
          default: codes_tile<S, C, 4>(xr, qn, dn, on, blocks, sums); break;
        }
        for (int m = 0; m < r; ++m) out[(m0 + m) * outs + n] = S::store(sums[m] + b);
      }
    }
  });
}

// Checks, then the kernel for codes C: x [rows, in] (rows may be strided),
// codes [out, in * C::kBytes / 32] of `code_dtype`, scale (and offset)
// [out, in / 32] float32, bias [out] or None; a new [rows, out] tensor in
// x's dtype.
template <typename C>
torch::Tensor linear_codes(const char* op, at::ScalarType code_dtype, const char* code_name,
                           const torch::Tensor& x,
                           const torch::Tensor& codes, const torch::Tensor& scale,
                           const torch::Tensor* offset, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2, op, ": x and codes must be 2-D");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu() &&
                  (offset == nullptr || offset->device().is_cpu()),
              op, ": CPU tensors only");
  const int64_t rows = x.size(0), in = x.size(1), outs = codes.size(0);
  const int64_t blocks = in / kCodesBlock;
  TORCH_CHECK(in % kCodesBlock == 0, op, ": ", in, " input features are not whole ", kCodesBlock,
              "-element blocks");
  TORCH_CHECK(codes.scalar_type() == code_dtype && codes.size(1) == blocks * C::kBytes, op,
              ": codes must be ", code_name, " [out, ", blocks * C::kBytes, "]");
  for (const torch::Tensor* t : {&scale, offset})
    TORCH_CHECK(t == nullptr || (t->scalar_type() == at::kFloat && t->dim() == 2 &&
                                 t->size(0) == outs && t->size(1) == blocks && t->is_contiguous()),
                op, ": scale and offset must be contiguous float32 [", outs, ", ", blocks, "]");
  TORCH_CHECK(codes.is_contiguous(), op, ": codes must be contiguous");
  TORCH_CHECK(x.stride(1) == 1, op, ": x rows must be contiguous");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == outs && b.scalar_type() == x.scalar_type(), op, ": bias must have ",
                outs, " entries of x's dtype");
  }
  auto out = torch::empty({rows, outs}, x.options());
  if (rows == 0 || outs == 0) return out;
  dispatch_storage(x.scalar_type(), op, [&](auto s) {
    using S = decltype(s);
    linear_codes_kernel<S, C>(ptr<S>(x), x.stride(0),
                              reinterpret_cast<const uint8_t*>(codes.data_ptr()),
                              scale.data_ptr<float>(),
                              offset == nullptr ? nullptr : offset->data_ptr<float>(),
                              b.defined() ? ptr<S>(b) : nullptr, ptr<S>(out), rows, in, outs);
  });
  return out;
}

// GGUF Q4_0 / Q4_1 blocks: codes [out, in / 2] uint8, scale and offset [out, in / 32].
torch::Tensor linear_q4_small_rows(const torch::Tensor& x, const torch::Tensor& codes,
                                   const torch::Tensor& scale, const torch::Tensor& offset,
                                   const c10::optional<torch::Tensor>& bias) {
  return linear_codes<Q4Codes>("linear_q4_small_rows", at::kByte, "uint8", x, codes, scale, &offset, bias);
}

// GGUF Q8_0 blocks: codes [out, in] int8, scale [out, in / 32].
torch::Tensor linear_q8_small_rows(const torch::Tensor& x, const torch::Tensor& codes,
                                   const torch::Tensor& scale,
                                   const c10::optional<torch::Tensor>& bias) {
  return linear_codes<Q8Codes>("linear_q8_small_rows", at::kChar, "int8", x, codes, scale, nullptr, bias);
}

}  // namespace
