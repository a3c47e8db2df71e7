// Paged decode attention for the CPU: one query token per sequence, keys and
// values read in place from the paged cache through each sequence's block
// table (no gather copy). One (sequence, kv head) pair per OpenMP work item;
// the query heads of a GQA group share each key/value row as it is read.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: a shift the compiler vectorizes.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
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
    const scalar_t* __restrict__ q,       // [B, H, D]
    const scalar_t* __restrict__ k_cache, // [NB, BS, KVH, D]
    const scalar_t* __restrict__ v_cache, // [NB, BS, KVH, D]
    const int64_t* __restrict__ tables,   // [B, MB]
    const int64_t* __restrict__ lens,     // [B]
    int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    alignas(64) float row[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g) {
        load_row<scalar_t, D>(q + (b * H + h * G + g) * D, &qf[g * D]);
        for (int d = 0; d < D; ++d) qf[g * D + d] *= scale;
      }
      // Pass 1: scores = q . k for every cached position, block by block.
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t block = tables[b * MB + t0 / BS];
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
        const int64_t block = tables[b * MB + t0 / BS];
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

template <typename scalar_t>
void dispatch_head_dim(int64_t D, scalar_t* out, const scalar_t* q, const scalar_t* k,
                       const scalar_t* v, const int64_t* tables, const int64_t* lens, int64_t B,
                       int64_t H, int64_t KVH, int64_t BS, int64_t MB, float scale) {
  switch (D) {
    case 64: return decode_kernel<scalar_t, 64>(out, q, k, v, tables, lens, B, H, KVH, BS, MB, scale);
    case 128: return decode_kernel<scalar_t, 128>(out, q, k, v, tables, lens, B, H, KVH, BS, MB, scale);
    case 32: return decode_kernel<scalar_t, 32>(out, q, k, v, tables, lens, B, H, KVH, BS, MB, scale);
    case 256: return decode_kernel<scalar_t, 256>(out, q, k, v, tables, lens, B, H, KVH, BS, MB, scale);
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, got ", D);
  }
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_head_dim<scalar_t>(D, out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                B, H, KVH, BS, MB, static_cast<float>(scale));
  });
}

// ---------------------------------------------------------------------------
// Fused elementwise ops for half-precision activations. Each keeps the
// rounding points of the unfused torch code (HF's), so results match it.

namespace {

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

template <typename scalar_t>
void add_rms_norm_kernel(scalar_t* __restrict__ x, scalar_t* __restrict__ residual,
                         const scalar_t* __restrict__ weight, int64_t rows, int64_t hidden,
                         float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(hidden);
    for (int64_t row = begin; row < end; ++row) {
      scalar_t* xr = x + row * hidden;
      scalar_t* rr = residual + row * hidden;
      float ss = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        // residual = residual + x, rounded to the activation dtype
        const scalar_t sum = round_to<scalar_t>(to_f(rr[i]) + to_f(xr[i]));
        rr[i] = sum;
        r[i] = to_f(sum);
        ss += r[i] * r[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t normed = round_to<scalar_t>(r[i] * inv);
        xr[i] = round_to<scalar_t>(to_f(weight[i]) * to_f(normed));
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ gate_up,
                         int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* g = gate_up + row * 2 * inter;
      const scalar_t* u = g + inter;
      scalar_t* o = out + row * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gf = to_f(g[i]);
        const scalar_t act = round_to<scalar_t>(gf / (1.f + std::exp(-gf)));
        o[i] = round_to<scalar_t>(to_f(act) * to_f(u[i]));
      }
    }
  });
}

}  // namespace

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                  weight.data_ptr<scalar_t>(), rows, hidden,
                                  static_cast<float>(eps));
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  const int64_t inter = out.size(-1), rows = out.numel() / inter;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), rows,
                                  inter);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention over a block table (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up (CPU)");
}
