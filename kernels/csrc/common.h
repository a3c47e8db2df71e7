// Helpers shared by the CPU kernels (included by cpu_ops.cpp, the one
// translation unit): float views of the activation dtypes, and the storage
// traits the elementwise kernels are templated over.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// Cephes' expf: exp(x) = 2^n * p(r), n = round(x * log2 e), r = x - n ln 2
// (ln 2 in two parts), p a degree-7 polynomial whose last two terms are
// 1 + r; kExpPoly holds the rest, highest degree first.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
// exp(x) for 16 floats, within 2 ulp of expf; x is clamped to [-87, 88] (0
// below, finite above).
inline __m512 exp_x16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for 8 floats with x <= 0, as exp_x16 (x clamped below at -87).
inline __m256 exp_nonpositive_x8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n from its exponent bits; n >= -126 after the clamp, so it is normal.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

}  // namespace
