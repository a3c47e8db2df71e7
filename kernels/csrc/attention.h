// Paged attention for the CPU: each query row attends to the first len
// positions of its block table row, keys and values read in place from the
// paged cache (no gather copy). A decode step has one row per sequence; a
// prompt chunk one row per token, all on its sequence's table with lengths
// growing by one (causal). The query heads of a GQA group share each
// key/value row as it is read.
//
// A cache is [NB, BS, KVH, D] with each row of D packed, stored either
// positions first (a block holds BS rows of all KVH heads) or heads first
// (a block holds each kv head's BS rows as one run: the transposed view of
// an [NB, KVH, BS, D] tensor, what the engine allocates on the CPU, so that
// a (row, kv head) work item reads each block in one stretch).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

// Runs body(begin, end) over items [0, n), one contiguous range per thread,
// the ranges cut so that each holds about the same total cost(i). Items of
// a prompt chunk attend to 1, 2, ... n positions: split by count, the thread
// with the second half would do three times the work of the first.
template <typename Cost, typename Body>
void parallel_by_cost(int64_t n, Cost&& cost, Body&& body) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1) {
    body(int64_t{0}, n);
    return;
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  std::vector<int64_t> bounds(T + 1, n);
  bounds[0] = 0;
  for (int64_t t = 1; t < T; ++t)  // the first item whose prefix reaches t / T of the total
    bounds[t] = std::lower_bound(prefix.begin(), prefix.end(), prefix[n] * t / T) - prefix.begin();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (bounds[t] < bounds[t + 1]) body(bounds[t], bounds[t + 1]);
  });
}

// A (query row, kv head) item's cost: the positions it reads, and a fixed part.
inline int64_t item_cost(const int64_t* lens, int64_t b) { return lens[b] + 16; }

// Element strides of a cache's blocks, positions and kv heads.
struct CacheStrides {
  int64_t block, pos, head;
  bool heads_first() const { return pos < head; }
};

// The strides of a key and a value cache of one shape and layout, checked to
// be one of the two layouts above.
CacheStrides cache_strides(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(),
              "caches must be [NB, BS, KVH, D], of one shape and layout");
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), D = k_cache.size(3);
  const CacheStrides st{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const bool positions_first = st.pos == KVH * D && st.head == D;
  const bool heads_first = st.pos == D && st.head == BS * D;
  TORCH_CHECK(k_cache.stride(3) == 1 && (positions_first || heads_first) && st.block == BS * KVH * D,
              "caches must be contiguous [NB, BS, KVH, D] or the transpose(1, 2) of a contiguous "
              "[NB, KVH, BS, D]");
  return st;
}

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
    const scalar_t* __restrict__ q,       // [B, H, D], rows q_stride apart
    const scalar_t* __restrict__ k_cache, // [NB, BS, KVH, D], strides st
    const scalar_t* __restrict__ v_cache, // [NB, BS, KVH, D], strides st
    const int64_t* __restrict__ tables,   // [R, MB]
    const int64_t* __restrict__ rows,     // [B]: each query's table row (null: row b)
    const int64_t* __restrict__ lens,     // [B]: positions each query attends to
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t q_stride,
    CacheStrides st) {
  const int64_t G = H / KVH;
  const auto cost = [&](int64_t item) { return item_cost(lens, item / KVH); };
  parallel_by_cost(B * KVH, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    alignas(64) float row[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      const int64_t* table = tables + (rows ? rows[b] : b) * MB;
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g) {
        load_row<scalar_t, D>(q + b * q_stride + (h * G + g) * D, &qf[g * D]);
        for (int d = 0; d < D; ++d) qf[g * D + d] *= scale;
      }
      // Pass 1: scores = q . k for every cached position, block by block.
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t block = table[t0 / BS];
        const int64_t n = std::min<int64_t>(BS, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          load_row<scalar_t, D>(k_cache + block * st.block + j * st.pos + h * st.head, row);
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
          load_row<scalar_t, D>(v_cache + block * st.block + j * st.pos + h * st.head, row);
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

}  // namespace

// The SIMD forms: AVX512-BF16 for bfloat16, AVX2 for float32.
#include "attention_simd.h"

namespace {

// Calls f(std::integral_constant<int, D>) for a compiled head_dim; false if
// there is none.
template <typename F>
bool with_head_dim(int64_t D, F&& f) {
  switch (D) {
    case 32: f(std::integral_constant<int, 32>{}); return true;
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    case 256: f(std::integral_constant<int, 256>{}); return true;
    default: return false;
  }
}

template <typename scalar_t>
void dispatch_head_dim(int64_t D, scalar_t* out, const scalar_t* q, const scalar_t* k,
                       const scalar_t* v, const int64_t* tables, const int64_t* rows, const int64_t* lens, int64_t B,
                       int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t q_stride,
                       CacheStrides st) {
#ifdef PAGODA_BF16_DECODE
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (with_head_dim(D, [&](auto d) {
          decode_kernel_bf16<d.value>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale, q_stride, st);
        }))
      return;
  }
#endif
#ifdef PAGODA_F32_AVX2_DECODE
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (with_head_dim(D, [&](auto d) {
          decode_kernel_f32_avx2<d.value>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale, q_stride, st);
        }))
      return;
  }
#endif
  const bool done = with_head_dim(D, [&](auto d) {
    decode_kernel<scalar_t, d.value>(out, q, k, v, tables, rows, lens, B, H, KVH, BS, MB, scale, q_stride, st);
  });
  TORCH_CHECK(done, "head_dim must be 32, 64, 128 or 256, got ", D);
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor table_rows, torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  const CacheStrides st = cache_strides(k_cache, v_cache);
  // Query rows may be strided (views of a fused qkv projection); heads packed.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_decode_attention: q's heads must be packed and out contiguous, of q's shape");
  const int64_t* rows = table_rows.numel() ? table_rows.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_head_dim<scalar_t>(D, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<int64_t>(), rows, seq_lens.data_ptr<int64_t>(),
                                B, H, KVH, BS, MB, static_cast<float>(scale), q.stride(0), st);
  });
}

bool has_bf16_attention() {
#ifdef PAGODA_BF16_DECODE
  return true;
#else
  return false;
#endif
}

// Stores a step's keys and values (rows of any row stride, heads packed)
// at their cache slots, every slot checked before anything is written.
// reshape_and_cache: one memcpy per row and cache, over both threads.
void write_kv_slots(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4,
              "expected k and v [T, KVH, D], caches [NB, BS, KVH, D]");
  const int64_t T = k.size(0), BS = k_cache.size(1), KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(1) == KVH && k.size(2) == D,
              "k and v do not match the caches");
  const CacheStrides st = cache_strides(k_cache, v_cache);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "k and v rows must be packed heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "slots must be int64, one per row");
  slots = slots.contiguous();
  const int64_t capacity = k_cache.size(0) * BS;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the cache");
  const int64_t esize = k_cache.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * esize, v_stride = v.stride(0) * esize;
  // Positions first: a row's heads are one run in the cache; heads first: one run a head.
  const int64_t runs = st.heads_first() ? KVH : 1, run_bytes = KVH * D * esize / runs;
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t at = ((slot[t] / BS) * st.block + (slot[t] % BS) * st.pos) * esize;
      for (int64_t r = 0; r < runs; ++r) {
        std::memcpy(kc + at + r * st.head * esize, kp + t * k_stride + r * run_bytes, run_bytes);
        std::memcpy(vc + at + r * st.head * esize, vp + t * v_stride + r * run_bytes, run_bytes);
      }
    }
  });
}

// A decode step's attention in one call: the step's keys and values (rows of
// the fused qkv projection, any row stride) are stored at their cache slots,
// then each query row attends over its block table row. Saves the several
// tensor operations per layer the same work takes from Python.
torch::Tensor write_kv_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                        torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor slots, torch::Tensor block_tables,
                                        torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k_cache.dim() == 4,
              "expected q [B, H, D], k and v [B, KVH, D], caches [NB, BS, KVH, D]");
  const int64_t B = q.size(0), KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.size(0) == B && q.size(2) == D && q.size(1) % KVH == 0 && q.scalar_type() == k_cache.scalar_type(),
              "q does not match k and the caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.numel() == B && block_tables.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == B,
              "slots, seq_lens and block tables must be int64, one row per query");
  write_kv_slots(k, v, k_cache, v_cache, slots);
  if (q.stride(2) != 1 || q.stride(1) != D) q = q.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  paged_decode_attention(out, q, k_cache, v_cache, block_tables.contiguous(),
                         torch::empty({0}, slots.options()), seq_lens.contiguous(), scale);
  return out;
}
