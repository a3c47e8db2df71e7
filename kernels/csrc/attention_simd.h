// SIMD forms of the paged attention kernel (included by attention.h, which
// picks them by dtype and head_dim): bfloat16 with AVX512-BF16, float32
// with AVX2. Each defines PAGODA_*_DECODE when the CPU it is built for has
// the instructions.
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

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

inline __m512 bf16x16_to_f32(const uint16_t* src) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// p . v for NG query heads of a group at once: out[g] = inv[g] * sum_t
// p[g][t] v[t], by vdpbf16ps over pairs of positions. p holds the softmax
// numerators rounded to bfloat16 (as flash attention feeds P to its second
// matmul); the sums are float32. unpack{lo,hi}_epi16 of two positions' rows
// pairs them for vdpbf16ps (a quarter of the instructions of widening every
// value to float32 for an FMA) and leaves the head dims in a lane order
// that is undone once, at the end.
template <int NG, int NQ>
inline void weighted_sum_bf16(const uint16_t* vc, const int64_t* off, int64_t len,
                              const uint16_t* p, int64_t p_stride, const float* inv,
                              uint16_t* out, int64_t out_stride) {
  __m512 acc[NG][2 * NQ];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2 * NQ; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 2) {
    const uint16_t* v0 = vc + off[t];
    const uint16_t* v1 = t + 1 < len ? vc + off[t + 1] : v0;  // its p is 0
    for (int64_t j = t + 16; j < std::min<int64_t>(t + 18, len); ++j)
      for (int c = 0; c < NQ * 32; c += 32)
        _mm_prefetch(reinterpret_cast<const char*>(vc + off[j] + c), _MM_HINT_T0);
    __m512bh lo[NQ], hi[NQ];
    for (int c = 0; c < NQ; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < NG; ++g) {
      uint32_t pair;  // p[g][t] in the low half, p[g][t + 1] in the high
      std::memcpy(&pair, p + g * p_stride + t, sizeof pair);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NQ; ++c) {
        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo[c], w);
        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi[c], w);
      }
    }
  }
  // Of the 32 dims of vector c, acc[g][2c] holds {0-3, 8-11, 16-19, 24-27}
  // and acc[g][2c + 1] the other fours.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < NG; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NQ; ++c) {
      const __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * c], first, acc[g][2 * c + 1]), s);
      const __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * c], second, acc[g][2 * c + 1]), s);
      _mm512_storeu_si512(out + g * out_stride + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(d1, d0));
    }
  }
}

// Walks the cache lines of the next row's blocks (keys and values, all kv
// heads), a few at a time, so that they are fetched into L2 while the
// current row is computed: the blocks are scattered, and the hardware
// prefetchers find little to follow.
struct NextRowFetch {
  std::vector<std::pair<const char*, int64_t>> spans;  // (start, bytes)
  size_t span = 0;
  int64_t at = 0;

  void reset() { spans.clear(), span = 0, at = 0; }
  inline void issue(int n) {
    for (; n > 0 && span < spans.size(); --n) {
      _mm_prefetch(spans[span].first + at, _MM_HINT_T1);
      if ((at += 64) >= spans[span].second) ++span, at = 0;
    }
  }
};

template <int D>
void decode_kernel_bf16(
    c10::BFloat16* __restrict__ out_,
    const c10::BFloat16* __restrict__ q_,
    const c10::BFloat16* __restrict__ k_,
    const c10::BFloat16* __restrict__ v_,
    const int64_t* __restrict__ tables,
    const int64_t* __restrict__ rows,
    const int64_t* __restrict__ lens,
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t q_stride,
    CacheStrides st) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NQ = D / 32;  // bf16 vectors per row
  constexpr int NF = D / 16;  // float vectors per row
  const auto* q = reinterpret_cast<const uint16_t*>(q_);
  const auto* kc = reinterpret_cast<const uint16_t*>(k_);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_);
  auto* out = reinterpret_cast<uint16_t*>(out_);
  const int64_t G = H / KVH;
  const auto cost = [&](int64_t item) { return item_cost(lens, item / KVH); };
  parallel_by_cost(B * KVH, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(G);
    std::vector<uint16_t> probs;  // the softmax numerators in bfloat16, for pass 2
    std::vector<int64_t> off;
    NextRowFetch next;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      if (h == 0 || item == begin) {
        next.reset();
        // Prompt rows of one sequence share their blocks: only a new table is fetched.
        if ((b + 1) * KVH < end && !(rows && rows[b + 1] == rows[b])) {
          const int64_t* nt = tables + (rows ? rows[b + 1] : b + 1) * MB;
          // Each block's used rows: one run (positions first) or one a head.
          const int64_t runs = st.heads_first() ? KVH : 1, row_bytes = KVH * D * 2 / runs;
          for (int64_t t0 = 0, i = 0; t0 < lens[b + 1]; t0 += BS, ++i) {
            const int64_t bytes = std::min<int64_t>(BS, lens[b + 1] - t0) * row_bytes;
            for (int64_t r = 0; r < runs; ++r) {
              const int64_t at = nt[i] * st.block + r * st.head;
              next.spans.emplace_back(reinterpret_cast<const char*>(kc + at), bytes);
              next.spans.emplace_back(reinterpret_cast<const char*>(vc + at), bytes);
            }
          }
        }
      }
      const int64_t padded = (len + 15) / 16 * 16;
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      if (len == 0) {  // nothing to attend to: zeros, as the generic kernel gives
        std::fill(out + (b * H + h * G) * D, out + (b * H + h * G + G) * D, uint16_t{0});
        continue;
      }
      scores.resize(G * padded);
      probs.resize(G * padded);
      // Element offset of each cached position's row for this kv head (the
      // same for keys and values).
      off.resize(len);
      for (int64_t t0 = 0, i = 0; t0 < len; t0 += BS, ++i) {
        const int64_t base = table[i] * st.block + h * st.head;
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) off[t0 + j] = base + j * st.pos;
      }
      // Pass 1: scores = (q . k) * scale, 16 positions at a time.
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = q + b * q_stride + (h * G + g) * D;
        __m512bh qv[NQ];
        for (int c = 0; c < NQ; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
        float* sg = &scores[g * padded];
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, len - t0);
          // The cache rows are scattered by block: fetch the next tile's
          // rows now, the hardware prefetcher does not find them.
          if (g == 0) {
            for (int64_t j = t0 + 16; j < std::min<int64_t>(t0 + 32, len); ++j)
              for (int c = 0; c < D; c += 32) _mm_prefetch(reinterpret_cast<const char*>(kc + off[j] + c), _MM_HINT_T0);
            // The next row holds KVH * D * 4 / 64 lines per position, this row
            // KVH / 16 tiles per position here: D lines a tile spreads them evenly.
            next.issue(D);
          }
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
          __m512 e = exp_x16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
          if (t == padded - 16) e = _mm512_maskz_mov_ps(tail, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(&probs[g * padded + t]),
                              (__m256i)_mm512_cvtneps_pbh(e));
          sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      // Pass 2: out = sum_t p_t * v_t, up to 4 query heads per sweep.
      uint16_t* ob = out + (b * H + h * G) * D;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const uint16_t* p = &probs[g0 * padded];
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: weighted_sum_bf16<4, NQ>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          case 3: weighted_sum_bf16<3, NQ>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          case 2: weighted_sum_bf16<2, NQ>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D); break;
          default: weighted_sum_bf16<1, NQ>(vc, off.data(), len, p, padded, &inv[g0], ob + g0 * D, D);
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
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t q_stride,
    CacheStrides st) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int NF = D / 8;  // vectors per row
  const int64_t G = H / KVH;
  // One query row (all its heads) per work item, so each block is read once
  // for all kv heads: in order when positions come first, as KVH runs when
  // heads do. With fewer rows than threads (a single sequence decoding), one
  // (row, kv head) pair per item instead, so no thread idles.
  const int64_t split = B < at::get_num_threads() ? KVH : 1;  // items per row
  const int64_t heads_per_item = KVH / split;
  const auto cost = [&](int64_t item) { return item_cost(lens, item / split); };
  parallel_by_cost(B * split, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv(H);
    std::vector<int64_t> off;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split;
      const int64_t h0 = (item % split) * heads_per_item, h1 = h0 + heads_per_item;
      const int64_t len = lens[b];
      const int64_t padded = (len + 7) / 8 * 8;
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      if (len == 0) {  // nothing to attend to: zeros, as the generic kernel gives
        std::fill(out + (b * H + h0 * G) * D, out + (b * H + h1 * G) * D, 0.f);
        continue;
      }
      scores.resize(H * padded);
      off.resize(len);
      for (int64_t t0 = 0, i = 0; t0 < len; t0 += BS, ++i) {
        const int64_t base = table[i] * st.block;
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) off[t0 + j] = base + j * st.pos;
      }
      // Pass 1: scores = (q . k) * scale, 8 positions at a time.
      for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, len - t0);
        // Blocks are scattered: fetch the next tile's keys, and its values
        // for pass 2 into L2 (1.3-1.5x faster than leaving it to the
        // hardware prefetcher with the cache cold, as it is every layer).
        for (int64_t j = t0 + 8; j < std::min<int64_t>(t0 + 16, len); ++j)
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t c = h * st.head; c < h * st.head + D; c += 16) {
              _mm_prefetch(reinterpret_cast<const char*>(kc + off[j] + c), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(vc + off[j] + c), _MM_HINT_T1);
            }
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + b * q_stride + (h * G + g) * D;
            // Past len, a lane repeats the tile's first position (masked later).
            __m256 part[8];
            for (int j = 0; j < 8; ++j) {
              const float* kr = kc + off[t0 + (j < n ? j : 0)] + h * st.head;
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
      for (int64_t hg = h0 * G; hg < h1 * G; ++hg) {
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
      for (int64_t h = h0; h < h1; ++h) {
        const float* vh = vc + h * st.head;
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

}  // namespace
