// Skinny matrix products for decode and short verification steps: y[M, O] = x[M, I] . W[O, I]^T (+ b).
// Weights are streamed once per call; every W row block is used for all M input rows while it sits in L1.
// Accumulation is float32; W may be float32, bfloat16 or float16. Needs AVX2 + FMA + F16C.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(at::Half v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// 4 weight rows x 2 input rows per inner block: 8 independent accumulators.
template <typename W>
void block_4x2(const W* w, int64_t ldw, const float* x0, const float* x1, int64_t in, float* out0, float* out1,
               int64_t ldo, bool two) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) { a[r][0] = _mm256_setzero_ps(); a[r][1] = _mm256_setzero_ps(); }
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    __m256 v0 = _mm256_loadu_ps(x0 + i);
    __m256 v1 = two ? _mm256_loadu_ps(x1 + i) : v0;
    for (int r = 0; r < 4; ++r) {
      __m256 wr = load8(w + r * ldw + i);
      a[r][0] = _mm256_fmadd_ps(wr, v0, a[r][0]);
      if (two) a[r][1] = _mm256_fmadd_ps(wr, v1, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float s0 = hsum(a[r][0]), s1 = two ? hsum(a[r][1]) : 0.f;
    for (int64_t j = i; j < in; ++j) {
      float wv = to_f(w[r * ldw + j]);
      s0 += wv * x0[j];
      if (two) s1 += wv * x1[j];
    }
    out0[r] = s0;
    if (two) out1[r] = s1;
  }
}

template <typename W>
void block_1x2(const W* w, const float* x0, const float* x1, int64_t in, float* out0, float* out1, bool two) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    __m256 wr = load8(w + i);
    a0 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x0 + i), a0);
    if (two) a1 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(x1 + i), a1);
  }
  float s0 = hsum(a0), s1 = two ? hsum(a1) : 0.f;
  for (; i < in; ++i) {
    float wv = to_f(w[i]);
    s0 += wv * x0[i];
    if (two) s1 += wv * x1[i];
  }
  *out0 = s0;
  if (two) *out1 = s1;
}

template <typename W>
void run(const W* w, const float* x, float* y, int64_t m, int64_t in, int64_t out) {
  const int64_t nblk = (out + 3) / 4;
  at::parallel_for(0, nblk, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * 4;
      for (int64_t r = 0; r < m; r += 2) {
        const bool two = r + 1 < m;
        const float* x0 = x + r * in;
        const float* x1 = two ? x0 + in : x0;
        if (o + 4 <= out) {
          float t0[4], t1[4];
          block_4x2(w + o * in, in, x0, x1, in, t0, t1, 1, two);
          for (int q = 0; q < 4; ++q) {
            y[r * out + o + q] = t0[q];
            if (two) y[(r + 1) * out + o + q] = t1[q];
          }
        } else {
          for (int64_t q = o; q < out; ++q) {
            float s0, s1;
            block_1x2(w + q * in, x0, x1, in, &s0, &s1, two);
            y[r * out + q] = s0;
            if (two) y[(r + 1) * out + q] = s1;
          }
        }
      }
    }
  });
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous 2-D tensor");
  auto out_dtype = x.scalar_type();
  auto xs = x.reshape({-1, x.size(-1)}).to(torch::kFloat).contiguous();
  const int64_t m = xs.size(0), in = xs.size(1), out = w.size(0);
  TORCH_CHECK(w.size(1) == in, "shape mismatch");
  auto y = torch::empty({m, out}, xs.options());
  const float* xp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case torch::kFloat: run(w.data_ptr<float>(), xp, yp, m, in, out); break;
    case torch::kBFloat16: run(w.data_ptr<at::BFloat16>(), xp, yp, m, in, out); break;
    case torch::kHalf: run(w.data_ptr<at::Half>(), xp, yp, m, in, out); break;
    default: TORCH_CHECK(false, "unsupported weight dtype");
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat));
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.to(out_dtype).reshape(shape);
}

// RMSNorm over the last dim in one pass per row (torch's CPU rms_norm decomposes into ~6 ops, ~70 us per call):
// y = x / sqrt(mean(x^2) + eps) * w, or * (1 + w) for zero-centred weights; float32 math, output in x's dtype.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, double eps, bool zc) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) { float v = static_cast<float>(xr[i]); ss += v * v; }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) {
      const float wi = static_cast<float>(w[i]);
      const float n = static_cast<float>(xr[i]) * inv;
      // non-zero-centred follows transformers: round the normalised value to T, then multiply by w in T
      yr[i] = zc ? static_cast<T>(n * (1.0f + wi)) : static_cast<T>(static_cast<float>(static_cast<T>(n)) * wi);
    }
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool zero_centred) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1), "bad weight");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t d = x.size(-1), rows = xc.numel() / d;
  switch (x.scalar_type()) {
    case torch::kFloat: rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, d, eps, zero_centred); break;
    case torch::kBFloat16: rms_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, d, eps, zero_centred); break;
    case torch::kHalf: rms_rows(xc.data_ptr<at::Half>(), wc.data_ptr<at::Half>(), y.data_ptr<at::Half>(), rows, d, eps, zero_centred); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x W^T for few rows");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
}
