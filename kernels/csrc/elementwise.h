// Fused elementwise ops. Each keeps the rounding points of the unfused torch
// code (HF's): in half precision every intermediate torch would store is
// rounded to that dtype here too, so results match it; in float32 only the
// order of the row sum differs.
#pragma once

#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

template <typename S>
void add_rms_norm_kernel(typename S::T* __restrict__ x, typename S::T* __restrict__ residual,
                         const typename S::T* __restrict__ weight, int64_t rows, int64_t hidden,
                         float eps) {
  using T = typename S::T;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(hidden);
    float* __restrict__ rf = r.data();
    for (int64_t row = begin; row < end; ++row) {
      T* __restrict__ xr = x + row * hidden;
      T* __restrict__ rr = residual + row * hidden;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        // residual = residual + x, rounded to the activation dtype
        const T sum = S::store(S::load(rr[i]) + S::load(xr[i]));
        rr[i] = sum;
        const float v = S::load(sum);
        rf[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        const float normed = S::load(S::store(rf[i] * inv));
        xr[i] = S::store(S::load(weight[i]) * normed);
      }
    }
  });
}

// exp(x) as Cephes' expf (the constants of exp_x16 in common.h), written
// in scalar code that vectorizes under omp simd; within 2 ulp of expf.
inline float exp_simd(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * (r * r) + (r + 1.f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGODA_SILU_MUL_BF16 1
// bfloat16 rounded to the nearest even (as a float32 -> bfloat16 cast), back in float32.
inline __m512 round_bf16_x16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

// silu(g) * u for 16 bfloat16 values (widened to float32), rounded where
// torch's unfused ops round: silu(g), then the product. silu_and_mul and the
// pairs kernel's fused form (linear_bf16.h) both compute it here.
inline __m256i silu_mul_x16(__m512 g, __m512 u) {
  const __m512 e = exp_x16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16_x16(act), u));
}

inline void silu_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    const auto widen = [&](const uint16_t* p) {
      return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p + i));
    };
    _mm256_mask_storeu_epi16(out + i, m, silu_mul_x16(widen(g), widen(u)));
  }
}
#endif

template <typename S>
void silu_and_mul_kernel(typename S::T* __restrict__ out, const typename S::T* __restrict__ gate_up,
                         int64_t rows, int64_t inter) {
  using T = typename S::T;
  // ~1 us a row: a decode batch of 8 or more rows is worth both threads.
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* __restrict__ g = gate_up + row * 2 * inter;
      const T* __restrict__ u = g + inter;
      T* __restrict__ o = out + row * inter;
#ifdef PAGODA_SILU_MUL_BF16
      if constexpr (std::is_same_v<S, BFloat16Bits>) {
        silu_mul_bf16(g, u, o, inter);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gf = S::load(g[i]);
        const float act = S::load(S::store(gf / (1.f + exp_simd(-gf))));
        o[i] = S::store(act * S::load(u[i]));
      }
    }
  });
}

// Neox rotary embedding in place on one head: the halves x1, x2 become
// x1*cos - x2*sin and x2*cos + x1*sin, each product rounded to the
// activation dtype before the sum, as torch computes it unfused.
template <typename S>
inline void rope_head(typename S::T* __restrict__ x, const typename S::T* __restrict__ cos,
                      const typename S::T* __restrict__ sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = S::load(x[i]), x2 = S::load(x[i + half]);
    const float c = S::load(cos[i]), s = S::load(sin[i]);
    const float a = S::load(S::store(x1 * c)), b = S::load(S::store(x2 * s));
    const float d = S::load(S::store(x2 * c)), e = S::load(S::store(x1 * s));
    x[i] = S::store(a - b);
    x[i + half] = S::store(d + e);
  }
}

template <typename S>
void rope_kernel(typename S::T* q, int64_t q_stride, int64_t q_heads, typename S::T* k,
                 int64_t k_stride, int64_t k_heads, const int64_t* positions, int64_t tokens,
                 const typename S::T* cos, const typename S::T* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  // ~0.5 us a token: split from 8 tokens on, as silu_and_mul.
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto* c = cos + positions[t] * half;
      const auto* sn = sin + positions[t] * half;
      for (int64_t h = 0; h < q_heads; ++h) rope_head<S>(q + t * q_stride + h * head_dim, c, sn, half);
      for (int64_t h = 0; h < k_heads; ++h) rope_head<S>(k + t * k_stride + h * head_dim, c, sn, half);
    }
  });
}

}  // namespace

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  dispatch_storage(x.scalar_type(), "fused_add_rms_norm", [&](auto storage) {
    using S = decltype(storage);
    add_rms_norm_kernel<S>(ptr<S>(x), ptr<S>(residual), ptr<S>(weight), rows, hidden,
                           static_cast<float>(eps));
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  const int64_t inter = out.size(-1), rows = out.numel() / inter;
  dispatch_storage(out.scalar_type(), "silu_and_mul", [&](auto storage) {
    using S = decltype(storage);
    silu_and_mul_kernel<S>(ptr<S>(out), ptr<S>(gate_up), rows, inter);
  });
}

void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                      torch::Tensor cos, torch::Tensor sin) {
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: position ", pos[t],
                " is outside the rotary tables (", cos.size(0), " positions)");
  dispatch_storage(q.scalar_type(), "rotary_embedding", [&](auto storage) {
    using S = decltype(storage);
    rope_kernel<S>(ptr<S>(q), q.stride(0), q.size(1), ptr<S>(k), k.stride(0), k.size(1),
                   pos, q.size(0), ptr<S>(cos), ptr<S>(sin), q.size(2));
  });
}
