// Dense attention in bfloat16 on AVX512-BF16: every query row of a sequence
// against all of that sequence's keys (or the causal prefix), for inputs
// that are not in a paged cache: Whisper's encoder (1500 frames attending to
// each other), and long prompt chunks.
//
// q [N, Sq, D], k and v [N / group, Sk, D] (query heads share their group's
// key/value head), D a multiple of 32. For each key sequence the keys are
// packed once into tiles of 16 keys x D/2
// pairs ([Sk/16][D/2][16][2]: one 64-byte load is 16 keys x 2 dimensions,
// the operand `vdpbf16ps` multiplies by a broadcast pair of a query row) and
// the values into pairs of keys ([Sk/2][D][2]: 16 dimensions x 2 keys). Then
// each block of kDenseBlock query rows computes its scores against every key
// in float32 (kept in a buffer that stays in L2), takes the softmax per row
// (exact max, Cephes' exp), rounds the probabilities to bfloat16 and
// multiplies them by the values with `vdpbf16ps` again, float32 sums divided
// by the row's sum at the end and rounded once. Nothing of size Sq x Sk is
// ever written to memory, which is what makes torch's bfloat16 paths slow
// here (at::bmm's QK^T runs at ~130 GFLOP/s with an inner size of 64, and
// a separate softmax pass over the scores costs as much again).
//
// Causal: key j is seen by query row i when j <= i + Sk - Sq (the queries are
// the last Sq positions of the Sk).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGODA_BF16_DENSE 1

constexpr int64_t kDenseBlock = 32;  // query rows per work item (scores: 32 x Sk floats)
constexpr int64_t kDenseRows = 8;    // query rows per register block of the scores
constexpr int64_t kDensePvRows = 4;  // query rows per register block of P V

// keys [Sk, D] -> [Skp / 16][D / 2][16] pairs (zero past Sk).
inline void pack_dense_keys(const uint16_t* k, int64_t Sk, int64_t Skp, int64_t D, uint32_t* out) {
  const int64_t D2 = D / 2;
  for (int64_t kt = 0; kt < Skp / 16; ++kt)
    for (int64_t d2 = 0; d2 < D2; ++d2)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = kt * 16 + j;
        uint32_t pair = 0;
        if (key < Sk) std::memcpy(&pair, k + key * D + 2 * d2, 4);
        out[(kt * D2 + d2) * 16 + j] = pair;
      }
}

// values [Sk, D] -> [Skp / 2][D] pairs of consecutive keys (zero past Sk).
inline void pack_dense_values(const uint16_t* v, int64_t Sk, int64_t Skp, int64_t D,
                              uint32_t* out) {
  for (int64_t k2 = 0; k2 < Skp / 2; ++k2) {
    const int64_t a = 2 * k2, b = 2 * k2 + 1;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = a < Sk ? v[a * D + d] : 0, hi = b < Sk ? v[b * D + d] : 0;
      out[k2 * D + d] = lo | (hi << 16);
    }
  }
}

// Scores of R rows against KT consecutive key tiles from `kt`:
// s[r][key] = scale * q.k, R x KT accumulators in registers.
template <int R, int KT>
inline void dense_score_tiles(const uint16_t* q, int64_t D, const uint32_t* kp, int64_t kt,
                              __m512 vscale, float* s, int64_t s_stride) {
  const int64_t D2 = D / 2;
  __m512 acc[R][KT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D2; ++d2) {
    __m512i kv[KT];
    for (int t = 0; t < KT; ++t) kv[t] = _mm512_loadu_si512(kp + ((kt + t) * D2 + d2) * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * D + 2 * d2, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int t = 0; t < KT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)kv[t], qb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KT; ++t)
      _mm512_storeu_ps(s + r * s_stride + (kt + t) * 16, _mm512_mul_ps(acc[r][t], vscale));
}

// Scores of rows [0, R) against key tiles [0, tiles), two tiles at a time.
template <int R>
inline void dense_scores(const uint16_t* q, int64_t D, const uint32_t* kp, int64_t tiles,
                         float scale, float* s, int64_t s_stride) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t kt = 0;
  for (; kt + 2 <= tiles; kt += 2) dense_score_tiles<R, 2>(q, D, kp, kt, vscale, s, s_stride);
  if (kt < tiles) dense_score_tiles<R, 1>(q, D, kp, kt, vscale, s, s_stride);
}

// One row's softmax numerators over keys [0, n) into bf16 pairs p (zero from n
// to the padded end pend); returns their sum.
inline float dense_softmax_row(float* s, int64_t n, int64_t pend, uint16_t* p) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(vmax);
  for (; j < n; ++j) m = std::max(m, s[j]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp_x16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    // Sum what is multiplied: the probabilities as rounded to bfloat16.
    const __m256bh eb = _mm512_cvtneps_pbh(e);
    vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(eb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)eb);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; j < n; ++j) {
    const uint16_t b = f_to_bf16_bits(std::exp(s[j] - m));
    p[j] = b;
    sum += bf16_bits_to_f(b);
  }
  for (; j < pend; ++j) p[j] = 0;
  return sum;
}

// out rows [r0, r0 + R), dimensions [d0, d0 + 16 NT) = (p V) / sum over key
// pairs [0, n2): R x NT accumulators held in registers.
template <int R, int NT>
inline void dense_pv_part(const uint16_t* p, int64_t p_stride, const uint32_t* vp, int64_t n2,
                          int64_t D, int64_t d0, const float* sums, uint16_t* out) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < n2; ++k2) {
    __m512i vv[NT];
    for (int t = 0; t < NT; ++t) vv[t] = _mm512_loadu_si512(vp + k2 * D + d0 + t * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, p + r * p_stride + 2 * k2, 4);
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)vv[t], pb);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
    for (int t = 0; t < NT; ++t)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * D + d0 + t * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][t], inv)));
  }
}

// out rows [r0, r0 + R) = (p V) / sum, 64 dimensions a pass (32 for the last
// of a head size that is an odd multiple of 32).
template <int R>
inline void dense_pv(const uint16_t* p, int64_t p_stride, const uint32_t* vp, int64_t n2,
                     int64_t D, const float* sums, uint16_t* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) dense_pv_part<R, 4>(p, p_stride, vp, n2, D, d0, sums, out);
  if (d0 < D) dense_pv_part<R, 2>(p, p_stride, vp, n2, D, d0, sums, out);
}
#endif

bool has_bf16_dense_attention() {
#ifdef PAGODA_BF16_DENSE
  return true;
#else
  return false;
#endif
}

torch::Tensor dense_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                   bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) > 0 &&
                  q.size(0) % k.size(0) == 0 && q.size(2) == k.size(2),
              "dense attention: q [N, Sq, D], k and v [N / group, Sk, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "dense attention: bfloat16 only");
  const int64_t N = q.size(0), NK = k.size(0), Sq = q.size(1), Sk = k.size(1), D = q.size(2);
  const int64_t group = N / NK;  // query sequences (heads) per key sequence (kv head)
  TORCH_CHECK(D % 32 == 0 && D <= 256, "dense attention: head_dim a multiple of 32, up to 256");
  TORCH_CHECK(!causal || Sq <= Sk, "dense attention: causal needs Sq <= Sk");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  auto out = torch::empty_like(q);
#ifdef PAGODA_BF16_DENSE
  if (N == 0 || Sq == 0) return out;
  const int64_t Skp = (Sk + 15) / 16 * 16;
  const int64_t packed = Skp * D / 2;  // uint32s per sequence, keys and values alike
  std::vector<uint32_t> kpack(NK * packed), vpack(NK * packed);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, NK, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      pack_dense_keys(kd + n * Sk * D, Sk, Skp, D, kpack.data() + n * packed);
      pack_dense_values(vd + n * Sk * D, Sk, Skp, D, vpack.data() + n * packed);
    }
  });
  const int64_t blocks = (Sq + kDenseBlock - 1) / kDenseBlock;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, N * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(kDenseBlock * Skp);
    std::vector<uint16_t> p(kDenseBlock * Skp);
    float sums[kDenseBlock];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t n = item / blocks, r0 = item % blocks * kDenseBlock;
      const int64_t rows = std::min(kDenseBlock, Sq - r0);
      const uint16_t* qn = qd + (n * Sq + r0) * D;
      // Keys any row of the block sees, in whole tiles.
      const int64_t seen = causal ? std::min(Sk, r0 + rows + Sk - Sq) : Sk;
      const int64_t tiles = (seen + 15) / 16;
      const uint32_t* kp = kpack.data() + n / group * packed;
      int64_t r = 0;
      for (; r + kDenseRows <= rows; r += kDenseRows)
        dense_scores<kDenseRows>(qn + r * D, D, kp, tiles, fscale, s.data() + r * Skp, Skp);
      for (; r < rows; ++r) dense_scores<1>(qn + r * D, D, kp, tiles, fscale, s.data() + r * Skp, Skp);
      const int64_t pend = tiles * 16;
      for (r = 0; r < rows; ++r) {
        const int64_t len = causal ? std::min(Sk, r0 + r + 1 + Sk - Sq) : Sk;
        sums[r] = dense_softmax_row(s.data() + r * Skp, len, pend, p.data() + r * Skp);
      }
      const uint32_t* vp = vpack.data() + n / group * packed;
      const int64_t n2 = pend / 2;
      uint16_t* on = od + (n * Sq + r0) * D;
      for (r = 0; r + kDensePvRows <= rows; r += kDensePvRows)
        dense_pv<kDensePvRows>(p.data() + r * Skp, Skp, vp, n2, D, sums + r, on + r * D);
      for (; r < rows; ++r) dense_pv<1>(p.data() + r * Skp, Skp, vp, n2, D, sums + r, on + r * D);
    }
  });
#else
  TORCH_CHECK(false, "dense attention needs AVX512-BF16");
#endif
  return out;
}

}  // namespace
