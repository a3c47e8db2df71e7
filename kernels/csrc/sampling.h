// Sampling: each row's token from its float32 logits without a noise
// tensor the size of the vocabulary and without a sort.
//
// A row's probabilities relative to its maximum, p = exp((logit - max) / T)
// in (0, 1], are written once with per-block sums (256 entries a block).
// The token is the winner of an exponential race, argmax p_i / E_i with
// E_i ~ Exp(1), which draws i with probability p_i / sum(p), run in two
// levels: blocks race with their sums (the winner of a race among entries
// is in block b with probability S_b / S, and which entry wins inside the
// block does not depend on it), then the winning block's entries race. A
// race, unlike an inverse CDF walked over the vocabulary, only changes its
// winner when two contenders' scores nearly tie, so logits that differ in
// their last bits (another kernel path for another batch) almost never
// change a seeded request's token. Every E comes from Philox4x32-10 keyed
// by the row's seed at (tokens sampled so far, round, block or token id):
// a seeded request's draws do not depend on the batch, and a request
// resumed after preemption continues without replaying them.
//
// Top-k keeps the candidates at or above a floor under the k-th largest p
// (the k-th largest block maximum), selects among only those, and the same
// two-level race runs over what top-k, top-p and min-p keep. Top-p without top-k is drawn by rejection: a
// draw with top_p of the mass or more above it lies outside the nucleus,
// and so does everything at or below it, which the next round leaves out.
// min-p keeps p >= min_p (the maximum is 1). Filters follow transformers'
// order: temperature, top-k (ties with the k-th value kept), top-p over what
// top-k kept (a token stays while the mass before it is below top_p), min-p.
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "logits.h"

namespace {

// ---------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").

inline void philox4x32_10(uint32_t ctr[4], uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ ctr[1] ^ key0, n2 = hi0 ^ ctr[3] ^ key1;
    ctr[0] = n0;
    ctr[1] = lo1;
    ctr[2] = n2;
    ctr[3] = lo0;
    key0 += kW0;
    key1 += kW1;
  }
}

// A uniform double in [0, 1): the top 53 bits of Philox's first two output
// words, keyed by the 64-bit seed, at counter (a 64-bit count, a round, an
// index).
inline double philox_uniform(int64_t seed, int64_t counter, uint32_t round, uint32_t index) {
  const uint64_t s = static_cast<uint64_t>(seed), c = static_cast<uint64_t>(counter);
  uint32_t ctr[4] = {static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), round, index};
  philox4x32_10(ctr, static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  const uint64_t bits = (static_cast<uint64_t>(ctr[0]) << 32) | ctr[1];
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// ---------------------------------------------------------------------------
// One row.

constexpr int64_t kSampleBlock = 256;  // entries per block of the two-level race
// exp of anything below this is 0 here (float32's smallest normal is e^-87.3).
constexpr float kExpFloor = -87.0f;
// Top-p draws rejected before the row's kept set is worked out in full.
constexpr int kMaxRejections = 32;

inline bool finite_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x7f800000u) != 0x7f800000u;
}

using Entry = std::pair<float, int32_t>;  // (p, token id)

inline bool by_p_descending(const Entry& a, const Entry& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// What one thread reuses from row to row (kept between calls: the same
// OpenMP threads serve every step).
struct SampleScratch {
  std::vector<float> p;          // [vocab rounded up to 16]: each entry's p
  std::vector<double> blocks;    // [blocks]: sums of the p being drawn from
  std::vector<float> maxima;     // [blocks]: maxima of p
  std::vector<float> work;       // maxima being selected from
  std::vector<Entry> entries;    // candidates of an exact selection
  std::vector<double> sums;      // [blocks]: sums of the kept candidates

  void reserve(int64_t vocab) {
    const int64_t padded = (vocab + 15) / 16 * 16;
    if (static_cast<int64_t>(p.size()) < padded) p.resize(padded);
    const int64_t nblocks = (vocab + kSampleBlock - 1) / kSampleBlock;
    if (static_cast<int64_t>(blocks.size()) < nblocks) blocks.resize(nblocks);
  }
};

inline float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float top = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + j));
  top = _mm512_reduce_max_ps(acc);
#endif
  for (; j < n; ++j) top = x[j] > top ? x[j] : top;
  return top;
}

// p[j] = exp((x[j] - top) * inv_t), 0 where that is below kExpFloor (a -inf
// logit included) or below keep_min. blocks gets each block's sum, maxima
// its largest p. Returns the total.
inline double exp_pass(const float* x, int64_t n, float top, float inv_t, float keep_min,
                       float* p, double* blocks, float* maxima) {
  double total = 0.0;
  for (int64_t b0 = 0, blk = 0; b0 < n; b0 += kSampleBlock, ++blk) {
    const int64_t b1 = std::min(n, b0 + kSampleBlock);
    int64_t j = b0;
    float sum = 0.0f, big = 0.0f;
#if defined(__AVX512F__)
    const __m512 vtop = _mm512_set1_ps(top), vinv = _mm512_set1_ps(inv_t);
    const __m512 vfloor = _mm512_set1_ps(kExpFloor), vmin = _mm512_set1_ps(keep_min);
    __m512 acc = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (; j < b1; j += 16) {
      const __mmask16 live = j + 16 <= b1 ? __mmask16(0xffff) : __mmask16((1u << (b1 - j)) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(live, x + j);
      const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(v, vtop), vinv);
      // Ordered compares: false for NaN, and for -inf's argument.
      __mmask16 keep = _mm512_mask_cmp_ps_mask(live, arg, vfloor, _CMP_GE_OQ);
      const __m512 e = exp_x16(arg);
      keep = _mm512_mask_cmp_ps_mask(keep, e, vmin, _CMP_GE_OQ);
      const __m512 kept = _mm512_maskz_mov_ps(keep, e);
      _mm512_storeu_ps(p + j, kept);  // p is padded to a multiple of 16
      acc = _mm512_add_ps(acc, kept);
      hi = _mm512_max_ps(hi, kept);
    }
    sum = _mm512_reduce_add_ps(acc);
    big = _mm512_reduce_max_ps(hi);
#else
    for (; j < b1; ++j) {
      const float arg = (x[j] - top) * inv_t;
      float e = arg >= kExpFloor ? std::exp(arg) : 0.0f;
      if (!(e >= keep_min)) e = 0.0f;
      p[j] = e;
      sum += e;
      big = e > big ? e : big;
    }
#endif
    blocks[blk] = sum;
    maxima[blk] = big;
    total += sum;
  }
  for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) p[j] = 0.0f;  // the padding reads as 0
  return total;
}

// The sum of p over entries with p > above, in total; per block into blocks if given.
inline double mass_above(const float* p, int64_t n, float above, double* blocks) {
  double total = 0.0;
  for (int64_t b0 = 0, blk = 0; b0 < n; b0 += kSampleBlock, ++blk) {
    const int64_t b1 = std::min(n, b0 + kSampleBlock);
    float sum = 0.0f;
    int64_t j = b0;
#if defined(__AVX512F__)
    const __m512 va = _mm512_set1_ps(above);
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= b1; j += 16) {
      const __m512 v = _mm512_loadu_ps(p + j);
      acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, va, _CMP_GT_OQ), acc, v);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < b1; ++j) sum += p[j] > above ? p[j] : 0.0f;
    if (blocks) blocks[blk] = sum;
    total += sum;
  }
  return total;
}

struct RowParams {
  float temperature;
  int64_t top_k;    // 0: off
  float top_p;      // 1: off
  float min_p;      // 0: off
  int64_t seed;     // the row's Philox key ...
  int64_t counter;  // ... and counter: the tokens its request has sampled
};

// Block indices are told apart from token ids (< 2^31) by the top bit.
constexpr uint32_t kBlockIndex = 0x80000000u;

// Exp(1) for (round, index) of the row's Philox stream.
inline double exponential(const RowParams& rp, uint32_t round, uint32_t index) {
  return -std::log1p(-philox_uniform(rp.seed, rp.counter, round, index));
}

// The block whose sum wins the race among blocks. -1 if every sum is 0.
inline int64_t race_blocks(const double* sums, int64_t nblocks, const RowParams& rp,
                           uint32_t round) {
  int64_t winner = -1;
  double best = -1.0;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    if (!(sums[blk] > 0.0)) continue;
    const double score = sums[blk] / exponential(rp, round, kBlockIndex | uint32_t(blk));
    if (score > best) {
      best = score;
      winner = blk;
    }
  }
  return winner;
}

// The winner of the race among entries with p > above (blocks: their block
// sums): first among blocks, then inside the winning block. -1 if none.
inline int64_t race(const float* p, int64_t n, float above, const double* blocks,
                    const RowParams& rp, uint32_t round) {
  const int64_t blk = race_blocks(blocks, (n + kSampleBlock - 1) / kSampleBlock, rp, round);
  if (blk < 0) return -1;
  int64_t winner = -1;
  double best = -1.0;
  for (int64_t j = blk * kSampleBlock; j < std::min(n, (blk + 1) * kSampleBlock); ++j) {
    if (!(p[j] > above)) continue;
    const double score = p[j] / exponential(rp, round, static_cast<uint32_t>(j));
    if (score > best) {
      best = score;
      winner = j;
    }
  }
  return winner;
}

// The same two-level race among entries (p, token id): their block sums
// race, then the winning block's entries. -1 if none.
inline int64_t race(const std::vector<Entry>& entries, int64_t nblocks, const RowParams& rp,
                    uint32_t round, std::vector<double>& sums) {
  sums.assign(nblocks, 0.0);
  for (const auto& [v, j] : entries) sums[j / kSampleBlock] += v;
  const int64_t blk = race_blocks(sums.data(), nblocks, rp, round);
  int64_t winner = -1;
  double best = -1.0;
  for (const auto& [v, j] : entries) {  // in any order: ties go to the lower id
    if (j / kSampleBlock != blk || !(v > 0.0f)) continue;
    const double score = v / exponential(rp, round, static_cast<uint32_t>(j));
    if (score > best || (score == best && j < winner)) {
      best = score;
      winner = j;
    }
  }
  return winner;
}

// The exact filters over candidates that hold every token top-k and top-p
// could keep (an upper set of p): cands is left holding what is kept.
// total: the mass of the whole row (top-p's base without top-k).
inline void keep_exact(std::vector<Entry>& cands, const RowParams& rp, bool top_k,
                       double total) {
  if (top_k && static_cast<size_t>(rp.top_k) < cands.size()) {
    // The k-th largest, then everything at or above it (ties stay).
    std::nth_element(cands.begin(), cands.begin() + (rp.top_k - 1), cands.end(),
                     by_p_descending);
    const float kth = cands[rp.top_k - 1].first;
    cands.erase(std::partition(cands.begin(), cands.end(),
                               [kth](const Entry& e) { return e.first >= kth; }),
                cands.end());
  }
  double base = total;
  if (top_k) {
    base = 0.0;
    for (const auto& e : cands) base += e.first;
  }
  if (rp.top_p < 1.0f) {
    std::sort(cands.begin(), cands.end(), by_p_descending);
    const double target = static_cast<double>(rp.top_p) * base;
    double before = 0.0;
    size_t keep = 0;
    for (; keep < cands.size() && before < target; ++keep) before += cands[keep].first;
    cands.resize(std::max<size_t>(keep, 1));
  }
  // min-p; the maximum (p = 1 >= min_p) always stays.
  cands.erase(std::remove_if(cands.begin(), cands.end(),
                             [&rp](const Entry& e) { return !(e.first >= rp.min_p); }),
              cands.end());
}

// Every entry with p >= at_least (and p > 0) as a candidate, skipping the
// blocks whose maximum is below at_least.
inline void gather(const float* p, int64_t n, float at_least, const float* block_maxima,
                   std::vector<Entry>& out) {
  out.clear();
  for (int64_t b0 = 0, blk = 0; b0 < n; b0 += kSampleBlock, ++blk) {
    if (!(block_maxima[blk] >= at_least && block_maxima[blk] > 0.0f)) continue;
    for (int64_t j = b0; j < std::min(n, b0 + kSampleBlock); ++j)
      if (p[j] >= at_least && p[j] > 0.0f) out.emplace_back(p[j], static_cast<int32_t>(j));
  }
}

// A floor under the k-th largest p: the k-th largest of the block maxima
// (k distinct entries reach it), or of the maxima of 16 entries when k is
// larger than the number of blocks; 0 past that.
inline float kth_floor(const float* p, int64_t n, int64_t k, const float* block_maxima,
                       int64_t nblocks, std::vector<float>& work) {
  if (k <= nblocks) {
    work.assign(block_maxima, block_maxima + nblocks);
  } else {
    const int64_t m = (n + 15) / 16;
    if (k > m) return 0.0f;
    work.resize(m);
    for (int64_t v = 0; v < m; ++v) {  // p is padded with zeros to a multiple of 16
#if defined(__AVX512F__)
      work[v] = _mm512_reduce_max_ps(_mm512_loadu_ps(p + v * 16));
#else
      float big = 0.0f;
      for (int64_t j = v * 16; j < v * 16 + 16; ++j) big = p[j] > big ? p[j] : big;
      work[v] = big;
#endif
    }
  }
  std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<float>());
  return work[k - 1];
}

// Top-p (with min-p) without top-k, by rejection: race among the entries
// above a pivot; a winner with top_p of the whole mass or more above it is
// outside the nucleus, and so is everything at or below it, so it becomes
// the pivot. The winner of a round that is kept is from the nucleus in
// proportion to p. After kMaxRejections rounds, the nucleus in full.
inline int64_t top_p_by_rejection(const float* p, int64_t n, double total, const RowParams& rp,
                                  SampleScratch& s) {
  double* blocks = s.blocks.data();
  const double target = static_cast<double>(rp.top_p) * total;
  float above = 0.0f;
  if (rp.min_p > 0.0f) {
    above = std::nextafter(rp.min_p, 0.0f);
    mass_above(p, n, above, blocks);
  }
  for (uint32_t round = 0; round < kMaxRejections; ++round) {
    const int64_t t = race(p, n, above, blocks, rp, round);
    if (t < 0) return -1;
    if (mass_above(p, n, p[t], nullptr) < target) return t;
    above = p[t];
    mass_above(p, n, above, blocks);
  }
  gather(p, n, std::nextafter(above, 1.0f), s.maxima.data(), s.entries);
  keep_exact(s.entries, rp, false, total);
  return race(s.entries, (n + kSampleBlock - 1) / kSampleBlock, rp, kMaxRejections, s.sums);
}

// The token of one row; probs (if not null) receives the kept, normalized
// distribution, worked out in full (slower: for tests).
inline int64_t sample_row(const float* x, int64_t n, const RowParams& rp, SampleScratch& s,
                          float* probs) {
  const float top = rp.temperature == 0.0f ? 0.0f : row_max(x, n);
  if (rp.temperature == 0.0f || !finite_bits(top)) {
    const int64_t j = row_argmax(x, n);
    if (probs) {
      std::fill(probs, probs + n, 0.0f);
      probs[j] = 1.0f;
    }
    return j;
  }
  float* p = s.p.data();
  double* blocks = s.blocks.data();
  const int64_t nblocks = (n + kSampleBlock - 1) / kSampleBlock;
  s.maxima.resize(nblocks);
  const float* maxima = s.maxima.data();
  const bool top_k = rp.top_k > 0 && rp.top_k < n, top_p = rp.top_p < 1.0f;
  // min-p folds into the weights unless top-p needs the whole row's mass first.
  const float keep_min = top_p ? 0.0f : rp.min_p;
  const double total =
      exp_pass(x, n, top, 1.0f / rp.temperature, keep_min, p, blocks, s.maxima.data());
  // Top-k (and top-p over it) exactly, over the candidates at or above a floor under the k-th p.
  const float floor = top_k ? kth_floor(p, n, rp.top_k, maxima, nblocks, s.work) : 0.0f;
  if (probs) {
    gather(p, n, floor, maxima, s.entries);
    keep_exact(s.entries, rp, top_k, total);
    std::fill(probs, probs + n, 0.0f);
    double sum = 0.0;
    for (const auto& e : s.entries) sum += e.first;
    for (const auto& e : s.entries) probs[e.second] = static_cast<float>(e.first / sum);
  }
  int64_t j = -1;
  if (top_k) {
    gather(p, n, floor, maxima, s.entries);
    keep_exact(s.entries, rp, true, total);
    j = race(s.entries, nblocks, rp, 0, s.sums);
  } else if (top_p) {
    j = top_p_by_rejection(p, n, total, rp, s);
  } else {
    j = race(p, n, 0.0f, blocks, rp, 0);
  }
  return j < 0 ? row_argmax(x, n) : j;  // nothing kept: cannot happen, the maximum always is
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

// uniforms[i] = Philox4x32-10 keyed by seeds[i] at (counters[i], 0, 0), in [0, 1).
torch::Tensor philox_uniforms(torch::Tensor seeds, torch::Tensor counters) {
  TORCH_CHECK(seeds.scalar_type() == at::kLong && counters.scalar_type() == at::kLong &&
                  seeds.dim() == 1 && seeds.sizes() == counters.sizes(),
              "seeds and counters must be int64 [rows]");
  seeds = seeds.contiguous();
  counters = counters.contiguous();
  auto out = torch::empty({seeds.size(0)}, torch::kFloat64);
  const int64_t* s = seeds.data_ptr<int64_t>();
  const int64_t* c = counters.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < seeds.size(0); ++i) o[i] = philox_uniform(s[i], c[i], 0, 0);
  return out;
}

// One token per row of float32 logits [rows, vocab]; per row temperature
// (0: the argmax), top_k (0: off), top_p, min_p, and the Philox seed and
// counter of its draws. probs, if not empty, receives each row's kept
// normalized distribution.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                          torch::Tensor top_p, torch::Tensor min_p, torch::Tensor seeds,
                          torch::Tensor counters, torch::Tensor probs) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "vocab must be in [1, 2^31)");
  auto check = [&](const torch::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(),
                name, " must be contiguous [rows] of ", dtype);
  };
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kFloat, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(seeds, at::kLong, "seeds");
  check(counters, at::kLong, "counters");
  const bool want_probs = probs.numel() > 0;
  if (want_probs)
    TORCH_CHECK(probs.sizes() == logits.sizes() && probs.scalar_type() == at::kFloat &&
                    probs.is_contiguous(),
                "probs must be empty or contiguous float32 like logits");
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lg = logits.data_ptr<float>();
  const float* tt = temperature.data_ptr<float>();
  const int64_t* tk = top_k.data_ptr<int64_t>();
  const float* tp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* sd = seeds.data_ptr<int64_t>();
  const int64_t* ct = counters.data_ptr<int64_t>();
  float* pr = want_probs ? probs.data_ptr<float>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local SampleScratch scratch;
    scratch.reserve(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const RowParams rp{tt[r], tk[r], tp[r], mp[r], sd[r], ct[r]};
      o[r] = sample_row(lg + r * vocab, vocab, rp, scratch, pr ? pr + r * vocab : nullptr);
    }
  });
  return out;
}

// Repetition (prompt and output tokens), frequency and presence (output
// tokens) penalties on logits [rows, vocab] in place. Row i of the
// penalized rows is logits row rows[i]; its tokens are history[slots[i],
// :lens[i]], the first prompt_lens[i] of them its prompt. Ids outside the
// vocabulary are skipped.
void apply_penalties(torch::Tensor logits, torch::Tensor rows, torch::Tensor history,
                     torch::Tensor slots, torch::Tensor prompt_lens, torch::Tensor lens,
                     torch::Tensor repetition, torch::Tensor frequency, torch::Tensor presence) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(history.dim() == 2 && history.scalar_type() == at::kInt && history.is_contiguous(),
              "history must be contiguous int32 [slots, width]");
  const int64_t n = rows.numel(), vocab = logits.size(1), width = history.size(1);
  for (const auto* t : {&rows, &slots, &prompt_lens, &lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->numel() == n &&
                    t->is_contiguous(),
                "rows, slots, prompt_lens and lens must be contiguous int64 [n]");
  for (const auto* t : {&repetition, &frequency, &presence})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->numel() == n &&
                    t->is_contiguous(),
                "penalties must be contiguous float32 [n]");
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* pl = prompt_lens.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rw[i] >= 0 && rw[i] < logits.size(0) && sl[i] >= 0 && sl[i] < history.size(0) &&
                    ln[i] >= 0 && ln[i] <= width && pl[i] >= 0 && pl[i] <= ln[i],
                "penalty row ", i, " is out of range");
  const float* rep = repetition.data_ptr<float>();
  const float* freq = frequency.data_ptr<float>();
  const float* pres = presence.data_ptr<float>();
  float* lg = logits.data_ptr<float>();
  const int32_t* hist = history.data_ptr<int32_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    // Output counts, and a mark per token: 1 seen, 2 penalized. Reset after
    // each row by walking its tokens again, so no row pays for the vocabulary.
    thread_local std::vector<int32_t> counts;
    thread_local std::vector<uint8_t> marks;
    if (static_cast<int64_t>(counts.size()) < vocab) {
      counts.assign(vocab, 0);
      marks.assign(vocab, 0);
    }
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* ids = hist + sl[i] * width;
      float* row = lg + rw[i] * vocab;
      const int64_t len = ln[i];
      for (int64_t t = 0; t < len; ++t) {
        const int32_t id = ids[t];
        if (id < 0 || id >= vocab) continue;
        marks[id] = 1;
        if (t >= pl[i]) counts[id] += 1;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int32_t id = ids[t];
        if (id < 0 || id >= vocab || marks[id] != 1) continue;
        marks[id] = 2;
        float v = row[id];
        v = v > 0.0f ? v / rep[i] : v * rep[i];
        const int32_t c = counts[id];
        if (c > 0) v -= freq[i] * static_cast<float>(c) + pres[i];
        row[id] = v;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int32_t id = ids[t];
        if (id < 0 || id >= vocab) continue;
        marks[id] = 0;
        counts[id] = 0;
      }
    }
  });
}
