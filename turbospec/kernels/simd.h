// AVX2 helpers shared by the kernels (gemv.cpp includes attention.cpp and deltanet.cpp as a unity build, so this
// header is guarded and everything in it is inline).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

// float buffers whose values start unset, for buffers that are written whole before they are read (a 32-row step of
// the fused layers zeroed megabytes of std::vector buffers only to overwrite them).
template <typename T>
struct Unset : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Unset<U>;
  };
  Unset() = default;
  template <typename U>
  Unset(const Unset<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(std::forward<A>(a)...); }
};
using Scratch = std::vector<float, Unset<float>>;

// e^x for x <= 0 (scores minus their max): range reduction to 2^n * e^r, |r| <= ln2/2, degree-7 Taylor
// polynomial (relative error ~5e-9, below float rounding). Inputs below -87 flush to ~1e-38.
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606820309417e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 1 / (1 + e^-x) from e^-|x| (no overflow for either sign); within a float rounding or two of the scalar form.
inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 neg_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = exp_nonpos(neg_abs);
  const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));  // x >= 0: 1 / (1 + e^-x); x < 0: e^x / (1 + e^x)
  return _mm256_blendv_ps(_mm256_mul_ps(e, r), r, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}

inline __m256 silu8(__m256 x) { return _mm256_mul_ps(x, sigmoid8(x)); }

// y[i] = silu(x[i]) for n values (in place allowed).
inline void silu_all(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, silu8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// v rounded to T's precision and back (round to nearest even, as static_cast<T> rounds; bfloat16 NaN -> 0x7FC0
// as c10 does), 8 values at a time: the fused blocks round every intermediate like the op-by-op path.
template <typename T>
inline __m256 round8(__m256 v);
template <>
inline __m256 round8<float>(__m256 v) { return v; }
template <>
inline __m256 round8<at::Half>(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
template <>
inline __m256 round8<at::BFloat16>(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// p[i] = T(p[i]) as float, for n values.
template <typename T>
inline void round_all(float* p, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, round8<T>(_mm256_loadu_ps(p + i)));
    for (; i < n; ++i) p[i] = static_cast<float>(static_cast<T>(p[i]));
  }
}
