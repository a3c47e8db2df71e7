// Paged decode attention for the CPU: one query token per sequence, keys and
// values read in place from the paged cache through each sequence's block
// table (no gather copy). One (sequence, kv head) pair per OpenMP work item;
// the query heads of a GQA group share each key/value row as it is read.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void decode_kernel(
    scalar_t* __restrict__ out,           // [B, H, D]
    const scalar_t* __restrict__ q,       // [B, H, D]
    const scalar_t* __restrict__ k_cache, // [NB, BS, KVH, D]
    const scalar_t* __restrict__ v_cache, // [NB, BS, KVH, D]
    const int64_t* __restrict__ tables,   // [B, MB]
    const int64_t* __restrict__ lens,     // [B]
    int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = lens[b];
      scores.assign(G * len, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      // Pass 1: scores = q . k for every cached position.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * MB + t / BS];
        const scalar_t* k = k_cache + ((block * BS + t % BS) * KVH + h) * D;
        float kf[256];
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
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
      // Pass 2: out = sum p * v.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * MB + t / BS];
        const scalar_t* v = v_cache + ((block * BS + t % BS) * KVH + h) * D;
        float vf[256];
        for (int64_t d = 0; d < D; ++d) vf[d] = to_f(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* ag = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(D <= 256, "head_dim must be at most 256");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                            k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                            B, H, KVH, D, BS, MB, static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention over a block table (CPU)");
}
