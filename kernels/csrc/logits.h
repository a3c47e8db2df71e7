// Logits: the exact recomputation of half-precision leading logits, and the
// greedy sampler's row argmax.
#pragma once

#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

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

// The first index of a row's maximum, as torch.argmax (a NaN counts as the
// maximum); the sampler's greedy rows share it.
inline int64_t row_argmax(const float* row, int64_t vocab) {
  float top = row[0];
  for (int64_t j = 1; j < vocab; ++j) top = row[j] > top ? row[j] : top;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
  uint32_t nan_seen = 0;
  for (int64_t j = 0; j < vocab; ++j) nan_seen |= (bits[j] & 0x7fffffffu) > 0x7f800000u;
  const bool any_nan = nan_seen != 0;
  for (int64_t j = 0; j < vocab; ++j) {
    if (any_nan ? is_nan_bits(row[j]) : row[j] == top) return j;
  }
  return 0;
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
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(lg + r * vocab, vocab);
  });
  return out;
}
