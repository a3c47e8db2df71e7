// Paged attention for the CPU: each query row attends to the first len
// positions of its block table row, keys and values read in place from the
// paged cache (no gather copy). A decode step has one row per sequence; a
// prompt chunk one row per token, all on its sequence's table with lengths
// growing by one (causal). One (query row, kv head) pair per OpenMP work
// item; the query heads of a GQA group share each key/value row as it is read.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
// bfloat16 is the top half of a float32: a shift the compiler vectorizes.
inline float bf16_bits_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_f(c10::BFloat16 x) { return bf16_bits_to_f(x.x); }

template <typename scalar_t, int D>
inline void load_row(const scalar_t* __restrict__ src, float* __restrict__ dst) {
#pragma omp simd
  for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]);
}

template <int D>
inline float dot(const float* __restrict__ a, const float* __restrict__ b) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename scalar_t, int D>
void decode_kernel(
    scalar_t* __restrict__ out,           // [B, H, D]
    const scalar_t* __restrict__ q,       // [B, H, D]
    const scalar_t* __restrict__ k_cache, // [NB, BS, KVH, D]
    const scalar_t* __restrict__ v_cache, // [NB, BS, KVH, D]
    const int64_t* __restrict__ tables,   // [R, MB]
    const int64_t* __restrict__ rows,     // [B]: each query's table row (null: row b)
    const int64_t* __restrict__ lens,     // [B]: positions each query attends to
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    alignas(64) float row[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g) {
        load_row<scalar_t, D>(q + (b * H + h * G + g) * D, &qf[g * D]);
        for (int d = 0; d < D; ++d) qf[g * D + d] *= scale;
      }
      // Pass 1: scores = q . k for every cached position, block by block.
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t block = table[t0 / BS];
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          load_row<scalar_t, D>(k_cache + ((block * BS + j) * KVH + h) * D, row);
          for (int64_t g = 0; g < G; ++g) scores[g * len + t0 + j] = dot<D>(&qf[g * D], row);
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * len];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      // Pass 2: out = sum_t p_t * v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t block = table[t0 / BS];
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          load_row<scalar_t, D>(v_cache + ((block * BS + j) * KVH + h) * D, row);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * len + t0 + j];
            float* __restrict__ ag = &acc[g * D];
#pragma omp simd
            for (int d = 0; d < D; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bfloat16 decode with AVX512-BF16: q . k by vdpbf16ps (exact bf16 products,
// float32 sums), a vectorized exp, and p * v in float32. The generic kernel
// above spends most of its time on one horizontal sum per (key, head) and a
// scalar exp per score; here 16 keys' partial sums are reduced together.
#define PAGODA_BF16_DECODE 1

// Lane j of the result: the sum of the 16 lanes of v[j].
inline __m512 sum_lanes_x16(const __m512* v) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // c[i]'s 128-bit lane L holds the partial sums of v[4i..4i+3] over lane L.
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), Cephes' expf
// polynomial, within 2 ulp of expf; underflows to 0 below -87.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 bf16x16_to_f32(const uint16_t* src) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// p . v for NG query heads of a group at once: out[g] = sum_t p[g][t] v[t].
template <int NG, int NF>
inline void weighted_sum_bf16(const uint16_t* vc, const int64_t* off, int64_t len,
                              const float* p, int64_t p_stride, const float* inv,
                              uint16_t* out, int64_t out_stride) {
  __m512 acc[NG][NF];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NF; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const uint16_t* vr = vc + off[t];
    if (t + 16 < len)
      for (int c = 0; c < NF * 16; c += 32)
        _mm_prefetch(reinterpret_cast<const char*>(vc + off[t + 16] + c), _MM_HINT_T0);
    __m512 vf[NF];
    for (int c = 0; c < NF; ++c) vf[c] = bf16x16_to_f32(vr + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * p_stride + t]);
      for (int c = 0; c < NF; ++c) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NF; ++c) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], s));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * out_stride + 16 * c), (__m256i)r);
    }
  }
}

template <int D>
void decode_kernel_bf16(
    c10::BFloat16* __restrict__ out_,
    const c10::BFloat16* __restrict__ q_,
    const c10::BFloat16* __restrict__ k_,
    const c10::BFloat16* __restrict__ v_,
    const int64_t* __restrict__ tables,
    const int64_t* __restrict__ rows,
    const int64_t* __restrict__ lens,
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NQ = D / 32;  // bf16 vectors per row
  constexpr int NF = D / 16;  // float vectors per row
  const auto* q = reinterpret_cast<const uint16_t*>(q_);
  const auto* kc = reinterpret_cast<const uint16_t*>(k_);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_);
  auto* out = reinterpret_cast<uint16_t*>(out_);
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(G);
    std::vector<int64_t> off;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      const int64_t padded = (len + 15) / 16 * 16;
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      if (len == 0) {  // nothing to attend to: zeros, as the generic kernel gives
        std::fill(out + (b * H + h * G) * D, out + (b * H + h * G + G) * D, uint16_t{0});
        continue;
      }
      scores.resize(G * padded);
      // Element offset of each cached position's row for this kv head (the
      // same for keys and values).
      off.resize(len);
      for (int64_t t0 = 0, i = 0; t0 < len; t0 += BS, ++i) {
        const int64_t base = (table[i] * BS * KVH + h) * D;
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) off[t0 + j] = base + j * KVH * D;
      }
      // Pass 1: scores = (q . k) * scale, 16 positions at a time.
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = q + (b * H + h * G + g) * D;
        __m512bh qv[NQ];
        for (int c = 0; c < NQ; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
        float* sg = &scores[g * padded];
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, len - t0);
          // The cache rows are scattered by block: fetch the next tile's
          // rows now, the hardware prefetcher does not find them.
          if (g == 0)
            for (int64_t j = t0 + 16; j < std::min<int64_t>(t0 + 32, len); ++j)
              for (int c = 0; c < D; c += 32) _mm_prefetch(reinterpret_cast<const char*>(kc + off[j] + c), _MM_HINT_T0);
          // Past len, a lane repeats the tile's first position (masked later).
          __m512 part[16];
          for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps();
            const uint16_t* kr = kc + off[t0 + (j < n ? j : 0)];
            for (int c = 0; c < NQ; ++c)
              a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            part[j] = a;
          }
          _mm512_storeu_ps(sg + t0, _mm512_mul_ps(sum_lanes_x16(part), _mm512_set1_ps(scale)));
        }
      }
      // Softmax per query head. Lanes past len in the last 16 repeat that
      // tile's first score, so they leave the max alone; their exps are
      // masked out of the sum. The 1 / sum is applied to the output.
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - (padded - 16))) - 1u);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * padded];
        __m512 mx = _mm512_loadu_ps(sg);
        for (int64_t t = 16; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 16) {
          __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
          if (t == padded - 16) e = _mm512_maskz_mov_ps(tail, e);
          _mm512_storeu_ps(sg + t, e);
          sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      // Pass 2: out = sum_t p_t * v_t in float32, up to 4 query heads per sweep.
      uint16_t* ob = out + (b * H + h * G) * D;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const float* p = &scores[g0 * padded];
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: weighted_sum_bf16<4, NF>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          case 3: weighted_sum_bf16<3, NF>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          case 2: weighted_sum_bf16<2, NF>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          default: weighted_sum_bf16<1, NF>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D);
        }
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float32 decode with AVX2 (CPUs without AVX512-BF16, where float32 is the
// default dtype): the bfloat16 kernel's scheme at 8 lanes. Scores for 8
// positions at a time (their partial sums reduced together), a vectorized
// exp, and p * v over 4 vectors of a row at a time so a GQA group's
// accumulators stay in registers. A work item is a whole query row (all its
// heads), so each cached position's keys for all kv heads are read together.
// Per decode step of the default model at batch 64 and ~200 positions, with
// the cache cold: 48-58 ms over 30 layers against 68-82 for the generic
// kernel; the step reads ~570 MB of float32 keys and values, which bounds it.
#define PAGODA_F32_AVX2_DECODE 1

// Lane j of the result: the sum of the 8 lanes of v[j].
inline __m256 sum_lanes_x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: [v0..v3 over lanes 0-3 | v0..v3 over lanes 4-7], b likewise for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// exp(x) for x <= 0, as exp_nonpositive: Cephes' expf polynomial times 2^n.
inline __m256 exp_nonpositive_x8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n from its exponent bits; n >= -126 after the clamp, so it is normal.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out[g][c*8 ..] = inv[g] * sum_t p[g][t] v[t][c*8 ..] for NG heads and the
// NC vectors of a row starting at vector c0.
template <int NG, int NC>
inline void weighted_sum_f32(const float* vc, const int64_t* off, int64_t len, int c0,
                             const float* p, int64_t p_stride, const float* inv,
                             float* out, int64_t out_stride) {
  __m256 acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const float* vr = vc + off[t] + 8 * c0;
    __m256 vf[NC];
    for (int c = 0; c < NC; ++c) vf[c] = _mm256_loadu_ps(vr + 8 * c);
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * p_stride + t);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm256_fmadd_ps(w, vf[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 s = _mm256_set1_ps(inv[g]);
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(out + g * out_stride + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], s));
  }
}

template <int D>
void decode_kernel_f32_avx2(
    float* __restrict__ out,
    const float* __restrict__ q,
    const float* __restrict__ kc,
    const float* __restrict__ vc,
    const int64_t* __restrict__ tables,
    const int64_t* __restrict__ rows,
    const int64_t* __restrict__ lens,
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NF = D / 8;  // vectors per row
  const int64_t G = H / KVH;
  const int64_t row_floats = KVH * D;  // one cached position, all kv heads
  // One query row (all its heads) per work item: a position's keys for all
  // kv heads are adjacent, so reading them together walks each block in order.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(H);
    std::vector<int64_t> off;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t padded = (len + 7) / 8 * 8;
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      if (len == 0) {  // nothing to attend to: zeros, as the generic kernel gives
        std::fill(out + b * H * D, out + (b + 1) * H * D, 0.f);
        continue;
      }
      scores.resize(H * padded);
      off.resize(len);
      for (int64_t t0 = 0, i = 0; t0 < len; t0 += BS, ++i) {
        const int64_t base = table[i] * BS * row_floats;
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) off[t0 + j] = base + j * row_floats;
      }
      // Pass 1: scores = (q . k) * scale, 8 positions at a time.
      for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, len - t0);
        // Blocks are scattered: fetch the next tile's keys, and its values
        // for pass 2 into L2 (1.3-1.5x faster than leaving it to the
        // hardware prefetcher with the cache cold, as it is every layer).
        for (int64_t j = t0 + 8; j < std::min<int64_t>(t0 + 16, len); ++j)
          for (int64_t c = 0; c < row_floats; c += 16) {
            _mm_prefetch(reinterpret_cast<const char*>(kc + off[j] + c), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vc + off[j] + c), _MM_HINT_T1);
          }
        for (int64_t h = 0; h < KVH; ++h) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + (b * H + h * G + g) * D;
            // Past len, a lane repeats the tile's first position (masked later).
            __m256 part[8];
            for (int j = 0; j < 8; ++j) {
              const float* kr = kc + off[t0 + (j < n ? j : 0)] + h * D;
              __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kr));
              for (int c = 1; c < NF; ++c)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kr + 8 * c), a);
              part[j] = a;
            }
            _mm256_storeu_ps(&scores[(h * G + g) * padded + t0],
                             _mm256_mul_ps(sum_lanes_x8(part), _mm256_set1_ps(scale)));
          }
        }
      }
      // Softmax per query head; lanes past len are zeroed after the exp.
      const int tail = static_cast<int>(len - (padded - 8));
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      for (int64_t hg = 0; hg < H; ++hg) {
        float* sg = &scores[hg * padded];
        __m256 mx = _mm256_loadu_ps(sg);
        for (int64_t t = 8; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        const __m256 m = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < padded; t += 8) {
          __m256 e = exp_nonpositive_x8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
          if (t == padded - 8) e = _mm256_and_ps(e, keep);
          _mm256_storeu_ps(sg + t, e);
          sum = _mm256_add_ps(sum, e);
        }
        _mm256_store_ps(lanes, sum);
        float total = 0.f;
        for (float x : lanes) total += x;
        inv[hg] = 1.f / total;
      }
      // Pass 2: out = sum_t p_t * v_t, up to 3 query heads and 4 vectors per sweep.
      for (int64_t h = 0; h < KVH; ++h) {
        const float* vh = vc + h * D;
        float* oh = out + (b * H + h * G) * D;
        for (int c0 = 0; c0 < NF; c0 += 4) {
          for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float* p = &scores[(h * G + g0) * padded];
            const float* iv = &inv[h * G + g0];
            switch (std::min<int64_t>(3, G - g0)) {
              case 3: weighted_sum_f32<3, 4>(vh, off.data(), len, c0, p, padded, iv, oh + g0 * D, D); break;
              case 2: weighted_sum_f32<2, 4>(vh, off.data(), len, c0, p, padded, iv, oh + g0 * D, D); break;
              default: weighted_sum_f32<1, 4>(vh, off.data(), len, c0, p, padded, iv, oh + g0 * D, D);
            }
          }
        }
      }
    }
  });
}
#endif

template <typename scalar_t>
void dispatch_head_dim(int64_t D, scalar_t* out, const scalar_t* q, const scalar_t* k,
                       const scalar_t* v, const int64_t* tables, const int64_t* rows, const int64_t* lens, int64_t B,
                       int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
#ifdef PAGODA_BF16_DECODE
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (D) {
      case 64: return decode_kernel_bf16<64>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 128: return decode_kernel_bf16<128>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 32: return decode_kernel_bf16<32>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 256: return decode_kernel_bf16<256>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      default: break;
    }
  }
#endif
#ifdef PAGODA_F32_AVX2_DECODE
  if constexpr (std::is_same_v<scalar_t, float>) {
    switch (D) {
      case 64: return decode_kernel_f32_avx2<64>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 128: return decode_kernel_f32_avx2<128>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 32: return decode_kernel_f32_avx2<32>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      case 256: return decode_kernel_f32_avx2<256>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
      default: break;
    }
  }
#endif
  switch (D) {
    case 64: return decode_kernel<scalar_t, 64>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
    case 128: return decode_kernel<scalar_t, 128>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
    case 32: return decode_kernel<scalar_t, 32>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
    case 256: return decode_kernel<scalar_t, 256>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale);
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, got ", D);
  }
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor table_rows, torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  const int64_t* rows = table_rows.numel() ? table_rows.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_head_dim<scalar_t>(D, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<int64_t>(), rows, seq_lens.data_ptr<int64_t>(),
                                B, H, KVH, BS, MB, static_cast<float>(scale));
  });
}

bool has_bf16_attention() {
#ifdef PAGODA_BF16_DECODE
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------
// Fused elementwise ops. Each keeps the rounding points of the unfused torch
// code (HF's): in half precision every intermediate torch would store is
// rounded to that dtype here too, so results match it; in float32 only the
// order of the row sum differs.

namespace {

// float -> bfloat16 on raw bits, rounding to nearest even with NaN kept
// quiet: integer operations only, so loops over a row vectorize (c10's
// conversion branches and does not).
inline uint16_t f_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// How an activation dtype is stored: T, load to float, store (rounding).
struct Float32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct BFloat16Bits {
  using T = uint16_t;
  static float load(uint16_t x) { return bf16_bits_to_f(x); }
  static uint16_t store(float x) { return f_to_bf16_bits(x); }
};
struct Float16 {
  using T = c10::Half;
  static float load(c10::Half x) { return static_cast<float>(x); }
  static c10::Half store(float x) { return static_cast<c10::Half>(x); }
};

// Calls f(Storage{}) for the tensor's dtype, with its data pointers cast to
// Storage::T by the caller through `ptr`.
template <typename F>
void dispatch_storage(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(Float32{});
    case at::kBFloat16: return f(BFloat16Bits{});
    case at::kHalf: return f(Float16{});
    default: TORCH_CHECK(false, op, ": expected float32, bfloat16 or float16, got ", dtype);
  }
}

template <typename S>
typename S::T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<typename S::T*>(t.data_ptr());
}

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

// exp(x) as Cephes' expf (the polynomial of exp_nonpositive above), written
// in scalar code that vectorizes under omp simd; within 2 ulp of expf.
inline float exp_simd(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename S>
void silu_and_mul_kernel(typename S::T* __restrict__ out, const typename S::T* __restrict__ gate_up,
                         int64_t rows, int64_t inter) {
  using T = typename S::T;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* __restrict__ g = gate_up + row * 2 * inter;
      const T* __restrict__ u = g + inter;
      T* __restrict__ o = out + row * inter;
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
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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
  dispatch_storage(q.scalar_type(), "rotary_embedding", [&](auto storage) {
    using S = decltype(storage);
    rope_kernel<S>(ptr<S>(q), q.stride(0), q.size(1), ptr<S>(k), k.stride(0), k.size(1),
                   positions.data_ptr<int64_t>(), q.size(0), ptr<S>(cos), ptr<S>(sin), q.size(2));
  });
}

// ---------------------------------------------------------------------------
// Half-precision logits are rounded to that dtype by the head's matmul. Each
// row's logits within one rounding step of its maximum are recomputed here in
// float32 from the same bfloat16 hidden state and weights (exact products,
// float32 sums), so that rounding does not decide between leading tokens.

void refine_leading_logits(torch::Tensor logits, torch::Tensor hidden, torch::Tensor weight,
                           torch::Tensor bias, int64_t mantissa_bits, int64_t max_per_row) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && hidden.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16, "float32 logits, bfloat16 hidden and weight");
  const int64_t rows = logits.size(0), vocab = logits.size(1), dim = hidden.size(1);
  float* lg = logits.data_ptr<float>();
  const c10::BFloat16* hs = hidden.data_ptr<c10::BFloat16>();
  const c10::BFloat16* ws = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bs = bias.numel() ? bias.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim);
    std::vector<int64_t> picked;
    for (int64_t r = begin; r < end; ++r) {
      float* row = lg + r * vocab;
      float top = -std::numeric_limits<float>::max();
      for (int64_t j = 0; j < vocab; ++j) top = row[j] > top ? row[j] : top;
      if (!(std::fabs(top) < std::numeric_limits<float>::max())) continue;
      const float mag = std::max(std::fabs(top), 1e-30f);
      const float step = std::ldexp(1.f, static_cast<int>(std::floor(std::log2(mag))) - static_cast<int>(mantissa_bits));
      const float threshold = top - step;
      picked.clear();
      for (int64_t j = 0; j < vocab; ++j)
        if (row[j] >= threshold) picked.push_back(j);
      if (static_cast<int64_t>(picked.size()) > max_per_row) continue;
      for (int64_t i = 0; i < dim; ++i) h[i] = to_f(hs[r * dim + i]);
      for (const int64_t j : picked) {
        const c10::BFloat16* w = ws + j * dim;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) sum += h[i] * to_f(w[i]);
        row[j] = bs ? sum + to_f(bs[j]) : sum;
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Greedy sampling: the first index of each row's maximum, as torch.argmax
// (a NaN counts as the maximum). torch's CPU argmax runs one row at a time
// through a scalar index-tracking loop; here the maximum is found with a
// vectorized pass, then its first index.

namespace {
inline bool is_nan_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0;
}
}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "expected contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "empty rows");
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lg = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lg + r * vocab;
      float top = row[0];
      for (int64_t j = 1; j < vocab; ++j) top = row[j] > top ? row[j] : top;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
      uint32_t nan_seen = 0;
      for (int64_t j = 0; j < vocab; ++j) nan_seen |= (bits[j] & 0x7fffffffu) > 0x7f800000u;
      const bool any_nan = nan_seen != 0;
      int64_t found = 0;
      for (int64_t j = 0; j < vocab; ++j) {
        if (any_nan ? is_nan_bits(row[j]) : row[j] == top) {
          found = j;
          break;
        }
      }
      o[r] = found;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU, float32)");
  m.def("refine_leading_logits", &refine_leading_logits,
        "recompute each row's near-maximal logits in float32, in place (CPU, bfloat16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "attention of one query row per entry over its block table row (CPU)");
  m.def("has_bf16_attention", &has_bf16_attention,
        "whether bfloat16 attention runs on AVX512-BF16 instructions");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k in place (CPU)");
}
