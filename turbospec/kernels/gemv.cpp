// Skinny matrix products for decode and short verification steps: y[M, O] = x[M, I] . W[O, I]^T (+ b).
// Weights are streamed once per call; every W row block is used for all M input rows while it sits in L1.
// Accumulation is float32; W may be float32, bfloat16 or float16. Needs AVX2 + FMA + F16C.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <sys/mman.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

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

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(round8<at::BFloat16>(v)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// T row of n values -> float32, and back (rounded to nearest even).
template <typename T>
inline void row_to_floats(const T* p, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, load8(p + i));
  for (; i < n; ++i) v[i] = static_cast<float>(p[i]);
}
template <typename T>
inline void row_from_floats(const float* v, T* p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(p + i, _mm256_loadu_ps(v + i));
  for (; i < n; ++i) p[i] = static_cast<T>(v[i]);
}

// Software prefetch distance: while one block of 4 weight rows is multiplied, the block this many bytes ahead
// is fetched (the hardware prefetcher alone leaves the 0.5-3 MB matrices of a decode step at ~60% of copy
// bandwidth; see docs/speed.md).
constexpr int64_t PREFETCH_BYTES = 6144;

// Prefetch the n bytes at p (whole 64-byte lines) into L2, as every product kernel does ahead of its weight rows:
// into L1 (_MM_HINT_T0) it stalled the products of several input rows on matrices streamed from memory (quant.cpp's
// TS_RANGE; the bf16 real-size chain of products ran 3-5% faster at 1, 4 and 8 rows with L2).
inline void prefetch_l2(const char* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// 4 weight rows (w[r] + ldw * r: a block of a matrix, or with ldw = 0 four rows anywhere) x 2 input rows per
// inner block: 8 independent accumulators.
template <typename W>
void block_4x2(const W* const* w, int64_t ldw, const float* x0, const float* x1, int64_t in, float* out0,
               float* out1, int64_t ldo, bool two, const char* pf, int64_t pf_step) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) { a[r][0] = _mm256_setzero_ps(); a[r][1] = _mm256_setzero_ps(); }
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    // prefetch this pass's share of a later row block, spread over the iterations (pf_step bytes each)
    const char* pp = pf + (i / 8) * pf_step;
    prefetch_l2(pp, pf_step);
    __m256 v0 = _mm256_loadu_ps(x0 + i);
    __m256 v1 = two ? _mm256_loadu_ps(x1 + i) : v0;
    for (int r = 0; r < 4; ++r) {
      __m256 wr = load8(w[r] + r * ldw + i);
      a[r][0] = _mm256_fmadd_ps(wr, v0, a[r][0]);
      if (two) a[r][1] = _mm256_fmadd_ps(wr, v1, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float s0 = hsum(a[r][0]), s1 = two ? hsum(a[r][1]) : 0.f;
    for (int64_t j = i; j < in; ++j) {
      float wv = to_f(w[r][r * ldw + j]);
      s0 += wv * x0[j];
      if (two) s1 += wv * x1[j];
    }
    out0[r] = s0;
    if (two) out1[r] = s1;
  }
}

// 4 weight rows x 4 input rows: each weight chunk is loaded and widened once for four rows (16 accumulators). Every
// output is the same chain of FMAs, sum and tail as in block_4x2, so results do not depend on the blocking.
template <typename W>
void block_4x4(const W* w, int64_t ldw, const float* x, int64_t in, float* out, int64_t ldo, const char* pf,
               int64_t pf_step) {
  __m256 a[4][4];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    const char* pp = pf + (i / 8) * pf_step;
    prefetch_l2(pp, pf_step);
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + in + i);
    const __m256 v2 = _mm256_loadu_ps(x + 2 * in + i), v3 = _mm256_loadu_ps(x + 3 * in + i);
    for (int r = 0; r < 4; ++r) {
      const __m256 wr = load8(w + r * ldw + i);
      a[r][0] = _mm256_fmadd_ps(wr, v0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(wr, v1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(wr, v2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(wr, v3, a[r][3]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float s[4];
    for (int j = 0; j < 4; ++j) s[j] = hsum(a[r][j]);
    for (int64_t t = i; t < in; ++t) {
      const float wv = to_f(w[r * ldw + t]);
      for (int j = 0; j < 4; ++j) s[j] += wv * x[j * in + t];
    }
    for (int j = 0; j < 4; ++j) out[j * ldo + r] = s[j];
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
      const int64_t quads = o + 4 <= out ? m / 4 * 4 : 0;  // rows taken four at a time (full weight blocks)
      if (quads) {
        const int64_t blk_bytes = 4 * in * static_cast<int64_t>(sizeof(W));
        const int64_t ahead = std::max<int64_t>(1, (PREFETCH_BYTES + blk_bytes - 1) / blk_bytes);
        const int64_t passes = (m + 3) / 4, share = blk_bytes / passes;
        const int64_t step = std::max<int64_t>(1, share / std::max<int64_t>(1, in / 8));
        for (int64_t r = 0; r < quads; r += 4) {
          const char* pf = reinterpret_cast<const char*>(w + std::min(o + 4 * ahead, out - 4) * in) + (r / 4) * share;
          block_4x4(w + o * in, in, x + r * in, in, y + r * out + o, out, pf, step);
        }
      }
      for (int64_t r = quads; r < m; r += 2) {
        const bool two = r + 1 < m;
        const float* x0 = x + r * in;
        const float* x1 = two ? x0 + in : x0;
        if (o + 4 <= out) {
          float t0[4], t1[4];
          const int64_t blk_bytes = 4 * in * static_cast<int64_t>(sizeof(W));
          const int64_t ahead = std::max<int64_t>(1, (PREFETCH_BYTES + blk_bytes - 1) / blk_bytes);
          // with several passes over the block (m > 2 rows), each pass prefetches its share of the block ahead,
          // so the memory stream keeps going during every pass
          const int64_t passes = (m + 1) / 2, share = blk_bytes / passes;
          const char* pf = reinterpret_cast<const char*>(w + std::min(o + 4 * ahead, out - 4) * in) + (r / 2) * share;
          const int64_t step = std::max<int64_t>(1, share / std::max<int64_t>(1, in / 8));
          const W* const blk[4] = {w + o * in, w + o * in, w + o * in, w + o * in};
          block_4x2(blk, in, x0, x1, in, t0, t1, 1, two, pf, step);
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

// ---- Shared pieces: dtype dispatch, rounding, products, norms ----

// f(T{}) for T the C++ type of a float32 / bfloat16 / float16 tensor dtype.
template <typename F>
decltype(auto) by_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case torch::kFloat: return f(float{});
    case torch::kBFloat16: return f(at::BFloat16{});
    case torch::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "unsupported dtype ", t);
  }
  return f(float{});  // not reached
}

template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

// Residual add as the op-by-op path rounds it: x[i] = rnd(x[i] + rnd(d[i])).
template <typename T>
void add_residual(float* x, const float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, round8<T>(_mm256_add_ps(_mm256_loadu_ps(x + i), round8<T>(_mm256_loadu_ps(d + i)))));
  for (; i < n; ++i) x[i] = rnd<T>(x[i] + rnd<T>(d[i]));
}

#include "quant.cpp"
#include "bf16dot.cpp"

// Products of bf16 weights with at least `bf16_dot_rows` bf16-valued rows use AVX-512 BF16 dot products
// (turbospec/kernels/bf16dot.cpp; then the fused layers take up to 64 rows). Fewer rows keep the AVX2 path: one
// row streams faster there, and one sequence's decode (1 row) and verification (up to 16) must share their
// arithmetic, so the default is 17. The continuous-batching scheduler lowers it to 2 around its forwards (rows of
// different sequences: only the rows of one call must agree, and dot products are ~2x faster from 2 rows on).
int64_t bf16_dot_rows = 17;
bool bf16_dot() { return bf16dot::available(); }
int64_t set_bf16_dot_rows(int64_t rows) {
  const int64_t old = bf16_dot_rows;
  bf16_dot_rows = std::max<int64_t>(1, rows);
  return old;
}

// y[r, o] += b[o] for every row r (no bias: nothing).
void add_bias(const c10::optional<torch::Tensor>& b, float* y, int64_t m, int64_t out) {
  if (!b.has_value()) return;
  auto bf = b->to(torch::kFloat).contiguous();
  const float* bp = bf.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += bp[o];
}

// y[m, out] = x[m, in] . W^T (+ b), float32 in and out, any supported weight dtype or packed format. `x_bf16`: the
// rows hold bf16 values (a bf16 model's activations), so bf16 weights may use the bf16 dot-product path.
void product(const torch::Tensor& w, const c10::optional<torch::Tensor>& b, const float* x, float* y, int64_t m,
             bool x_bf16) {
  const int64_t in = in_features(w), out = out_features(w);
  if (packed::is_packed(w))
    packed::product(w, x, y, m);
  else if (x_bf16 && m >= bf16_dot_rows && w.scalar_type() == torch::kBFloat16 && bf16dot::available())
    bf16dot::run(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bf16dot::pack(x, m, in).data(),
                 y, m, in, out);
  else
    by_dtype(w.scalar_type(), [&](auto tag) { run(w.data_ptr<decltype(tag)>(), x, y, m, in, out); });
  add_bias(b, y, m, out);
}

// A projection's matrices: one, or parts whose outputs are concatenated (parts in different formats, e.g. a GGUF
// file's Q6_K attn_v beside its Q4_K attn_q and attn_k, which cannot be one packed matrix).
using Parts = std::vector<torch::Tensor>;

int64_t out_rows(const Parts& ws) {
  int64_t n = 0;
  for (const auto& w : ws) n += out_features(w);
  return n;
}

// Every part contiguous, 2-D or packed, with `in` input features.
void check_parts(const Parts& ws, int64_t in) {
  TORCH_CHECK(!ws.empty(), "a projection needs at least one matrix");
  for (const auto& w : ws)
    TORCH_CHECK((w.dim() == 2 || packed::is_packed(w)) && w.is_contiguous() && in_features(w) == in,
                "bad weight (contiguous, ", in, " input features)");
}

// y[m, out_rows] = x . [W_0 | W_1 | ...]^T (+ b): each part's product into its columns.
void product(const Parts& ws, const c10::optional<torch::Tensor>& b, const float* x, float* y, int64_t m,
             bool x_bf16) {
  if (ws.size() == 1) return product(ws[0], b, x, y, m, x_bf16);
  const int64_t out = out_rows(ws);
  std::vector<float> t;
  int64_t off = 0;
  for (const auto& w : ws) {
    const int64_t o = out_features(w);
    t.resize(m * o);
    product(w, c10::nullopt, x, t.data(), m, x_bf16);
    for (int64_t r = 0; r < m; ++r) std::copy(t.begin() + r * o, t.begin() + (r + 1) * o, y + r * out + off);
    off += o;
  }
  add_bias(b, y, m, out);
}

// fn(a, b) over row ranges [a, b) of m rows of `values` each: split between the threads where the rows hold enough
// values (a batched step's 32 rows: the fused layers' per-row work, done on one thread while the other waited), on
// the calling thread for a few rows (one sequence's decode and verification).
template <typename F>
void over_rows(int64_t m, int64_t values, F&& fn) {
  if (m < 2 || m * values < (1 << 13)) return fn(int64_t{0}, m);
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 12) / std::max<int64_t>(values, 1)), fn);
}

// RMSNorm of one row of T-valued floats: y = x / sqrt(mean(x^2) + eps) * w, or * (1 + w) for zero-centred
// weights; float32 math, results rounded to T (non-zero-centred follows transformers: round the normalised value
// to T, then multiply by w in T).
template <typename T>
void rms_row(const float* x, const T* w, float* y, int64_t d, float eps, bool zc) {
  // the sum of squares in 8 lanes (one scalar running sum is latency-bound: ~1 ns per value)
  __m256 ss8 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    ss8 = _mm256_fmadd_ps(v, v, ss8);
  }
  float ss = hsum(ss8);
  for (; k < d; ++k) ss += x[k] * x[k];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv8), wi = load8(w + i);
    _mm256_storeu_ps(y + i, zc ? round8<T>(_mm256_mul_ps(n, _mm256_add_ps(one, wi)))
                               : round8<T>(_mm256_mul_ps(round8<T>(n), wi)));
  }
  for (; i < d; ++i) {
    const float wi = static_cast<float>(w[i]);
    const float n = x[i] * inv;
    y[i] = zc ? rnd<T>(n * (1.0f + wi)) : rnd<T>(rnd<T>(n) * wi);
  }
}

// SwiGLU's middle for one row: h = rnd(rnd(silu(g)) * u) from gu = [g | u] (T-valued floats), as the op-by-op
// path rounds.
template <typename T>
void swiglu_row(const float* gu, float* h, int64_t inter) {
  silu_all(gu, h, inter);
  round_all<T>(h, inter);
  int64_t j = 0;
  for (; j + 8 <= inter; j += 8)
    _mm256_storeu_ps(h + j, round8<T>(_mm256_mul_ps(_mm256_loadu_ps(h + j), _mm256_loadu_ps(gu + inter + j))));
  for (; j < inter; ++j) h[j] = rnd<T>(h[j] * gu[inter + j]);
}

template <typename T>
std::vector<float> to_floats(const torch::Tensor& t) {
  auto c = t.contiguous();
  std::vector<float> v(c.numel());
  row_to_floats(c.data_ptr<T>(), v.data(), c.numel());
  return v;
}

template <typename T>
torch::Tensor from_floats(const std::vector<float>& v, int64_t rows, int64_t cols, const torch::Tensor& like) {
  auto y = torch::empty({rows, cols}, like.options());
  row_from_floats(v.data(), y.data_ptr<T>(), rows * cols);
  return y;
}

// RMSNorm of every row of x [.., d] (rounded to T), then the product with W (float32, not rounded).
template <typename T>
std::vector<float> norm_product(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, bool zc,
                                const Parts& w, const c10::optional<torch::Tensor>& b) {
  const int64_t d = x.size(-1), m = x.numel() / d;
  std::vector<float> xf = to_floats<T>(x), y(m * out_rows(w));
  Scratch xn(m * d);
  over_rows(m, d, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) rms_row<T>(&xf[r * d], norm_w.data_ptr<T>(), &xn[r * d], d, static_cast<float>(eps), zc);
  });
  product(w, b, xn.data(), y.data(), m, std::is_same<T, at::BFloat16>::value);
  return y;
}

// x W^T (+ b) for few rows of x [.., in], as float32 [.., out] (not rounded).
torch::Tensor skinny_floats(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK((w.dim() == 2 || packed::is_packed(w)) && w.is_contiguous(), "weight must be a contiguous 2-D or packed tensor");
  auto xs = x.reshape({-1, x.size(-1)}).to(torch::kFloat).contiguous();
  const int64_t m = xs.size(0), in = xs.size(1), out = out_features(w);
  TORCH_CHECK(in_features(w) == in, "shape mismatch");
  auto y = torch::empty({m, out}, xs.options());
  product(w, bias, xs.data_ptr<float>(), y.data_ptr<float>(), m, x.scalar_type() == torch::kBFloat16);
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.reshape(shape);
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return skinny_floats(x, w, bias).to(x.scalar_type());
}

// skinny_linear(x, w, bias).float() without the copy in x's dtype: the float32 products rounded to x's dtype in place
// (the same values; an LM head's logits over 32 rows of a 32K vocabulary were two 1M-value conversions per step).
torch::Tensor skinny_linear_float(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  auto y = skinny_floats(x, w, bias);
  float* yp = y.data_ptr<float>();
  by_dtype(x.scalar_type(), [&](auto tag) {
    at::parallel_for(0, y.numel(), 1 << 15, [&](int64_t a, int64_t b) { round_all<decltype(tag)>(yp + a, b - a); });
  });
  return y;
}

// x W[rows]^T (+ b[rows]) for few rows of x, without a copy of W's selected rows: each output is the same chain of
// FMAs as `skinny_linear`'s over the gathered matrix (a drafter's head over a reduced vocabulary, shared by every
// sequence: each holds only its row ids). W float32 / bfloat16 / float16, 2-D and contiguous; rows int64.
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor rows, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && !packed::is_packed(w), "weight must be a contiguous 2-D tensor");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "rows must be int64 [R]");
  auto out_dtype = x.scalar_type();
  auto xs = x.reshape({-1, x.size(-1)}).to(torch::kFloat).contiguous();
  const int64_t m = xs.size(0), in = xs.size(1), n = rows.numel(), out = w.size(0);
  TORCH_CHECK(w.size(1) == in, "shape mismatch");
  rows = rows.contiguous();
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ids[j] >= 0 && ids[j] < out, "row id out of range");
  auto y = torch::empty({m, n}, xs.options());
  const float* xp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  by_dtype(w.scalar_type(), [&](auto tag) {
    using W = decltype(tag);
    const W* wp = w.data_ptr<W>();
    at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t o = b * 4, k = std::min<int64_t>(4, n - o);
        const W* blk[4];
        for (int q = 0; q < 4; ++q) blk[q] = wp + ids[o + std::min<int64_t>(q, k - 1)] * in;
        // the next block's rows into L2 while this one is multiplied (scattered rows: no prefetch stream to follow)
        for (int64_t q = o + 4; q < std::min(n, o + 8); ++q)
          prefetch_l2(reinterpret_cast<const char*>(wp + ids[q] * in), in * static_cast<int64_t>(sizeof(W)));
        for (int64_t r = 0; r < m; r += 2) {
          const bool two = r + 1 < m;
          const float* x0 = xp + r * in;
          float t0[4], t1[4];
          block_4x2(blk, 0, x0, two ? x0 + in : x0, in, t0, t1, 1, two, reinterpret_cast<const char*>(wp), 0);
          for (int64_t q = 0; q < k; ++q) {
            yp[r * n + o + q] = t0[q];
            if (two) yp[(r + 1) * n + o + q] = t1[q];
          }
        }
      }
    });
  });
  if (bias.has_value()) add_bias(bias->index_select(0, rows), yp, m, n);
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.to(out_dtype).reshape(shape);
}

// RMSNorm over the last dim in one pass per row (torch's CPU rms_norm decomposes into ~6 ops, ~70 us per call).
// Rows in parallel above this many values (prefill); decode-sized inputs stay on the calling thread.
constexpr int64_t PARALLEL_MIN = 1 << 15;

// Row-parallel map of x [rows, d_in] to y [rows, d_out] (T): fn(const float* in_row, float* out_row).
template <typename T, typename F>
torch::Tensor map_rows(const torch::Tensor& x, int64_t d_out, F&& fn) {
  auto xc = x.contiguous();
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  auto y = torch::empty({rows, d_out}, xc.options());
  const T* xp = xc.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t grain = rows * d >= PARALLEL_MIN ? 1 : rows;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> in(d), out(d_out);
    for (int64_t r = r0; r < r1; ++r) {
      row_to_floats(xp + r * d, in.data(), d);
      fn(in.data(), out.data());
      row_from_floats(out.data(), yp + r * d_out, d_out);
    }
  });
  return y;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool zero_centred) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1), "bad weight");
  const int64_t d = x.size(-1);
  return by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto wc = w.contiguous();
    const T* wp = wc.data_ptr<T>();
    return map_rows<T>(x, d, [&](const float* in, float* out) {
      rms_row<T>(in, wp, out, d, static_cast<float>(eps), zero_centred);
    }).view(x.sizes());
  });
}

// SwiGLU's middle: [g | u] rows [N, 2I] (T) -> rnd(rnd(silu(g)) * u) [N, I], as the op-by-op path rounds.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: [N, 2I] expected");
  const int64_t inter = gu.size(1) / 2;
  return by_dtype(gu.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    return map_rows<T>(gu, inter, [&](const float* g, float* h) { swiglu_row<T>(g, h, inter); });
  });
}

// ---- Fused decode blocks: a decoder layer in one to three calls (see turbospec/layers/block.py) ----
// Every intermediate is rounded to the model dtype T where the Python path rounds (after a norm, a product, an
// activation, a residual add), so 16-bit models see the same values up to the ordering of float32 math.

// Rotate-half RoPE on the first `rot` values of a head: x*cos + roll(x, rot/2)*sin_signed (sin carries the sign).
template <typename T>
void rope_head(float* x, const T* cos, const T* sin, int64_t rot, float* tmp) {
  const int64_t half = rot / 2;
  for (int64_t j = 0; j < rot; ++j) tmp[j] = x[j];
  if (half % 8 == 0) {  // 8 values at a time: the same roundings as below (-mfma contracts its a + b * c)
    for (int64_t j = 0; j < rot; j += 8) {
      const __m256 a = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(tmp + j), load8(cos + j)));
      _mm256_storeu_ps(x + j, round8<T>(_mm256_fmadd_ps(_mm256_loadu_ps(tmp + (j + half) % rot), load8(sin + j), a)));
    }
    return;
  }
  for (int64_t j = 0; j < rot; ++j) {
    const float a = rnd<T>(tmp[j] * static_cast<float>(cos[j]));
    x[j] = rnd<T>(a + tmp[(j + half) % rot] * static_cast<float>(sin[j]));
  }
}

// attn_in's rows [m, out] as floats holding T values (every value rounded to T).
template <typename T>
std::vector<float> attn_in_floats(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, bool zc,
                                  const Parts& w, const c10::optional<torch::Tensor>& b,
                                  const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                                  const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh, int64_t nkv,
                                  int64_t hd, bool gated) {
  const int64_t m = x.numel() / x.size(-1), out = out_rows(w), rot = cos.size(-1);
  std::vector<float> y = norm_product<T>(x, norm_w, eps, zc, w, b);
  auto cc = cos.contiguous(), sc = sin.contiguous();
  const T* qn = q_norm.has_value() ? q_norm->data_ptr<T>() : nullptr;
  const T* kn = k_norm.has_value() ? k_norm->data_ptr<T>() : nullptr;
  const int64_t q_stride = gated ? 2 * hd : hd, q_width = nh * q_stride;
  over_rows(m, out, [&](int64_t a, int64_t e) {
    round_all<T>(&y[a * out], (e - a) * out);
    std::vector<float> nb(hd), tmp(rot);
    for (int64_t r = a; r < e; ++r) {
      const T* cr = cc.data_ptr<T>() + (cc.size(0) == 1 ? 0 : r) * rot;
      const T* sr = sc.data_ptr<T>() + (sc.size(0) == 1 ? 0 : r) * rot;
      for (int64_t h = 0; h < nh + nkv; ++h) {
        float* v = &y[r * out] + (h < nh ? h * q_stride : q_width + (h - nh) * hd);
        const T* nrm = h < nh ? qn : kn;
        if (nrm) {
          rms_row<T>(v, nrm, nb.data(), hd, static_cast<float>(eps), zc);
          std::copy(nb.begin(), nb.end(), v);
        }
        rope_head<T>(v, cr, sr, rot, tmp.data());
      }
    }
  });
  return y;
}

template <typename T>
torch::Tensor attn_in_t(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, bool zc, const Parts& w,
                        const c10::optional<torch::Tensor>& b, const c10::optional<torch::Tensor>& q_norm,
                        const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos, const torch::Tensor& sin,
                        int64_t nh, int64_t nkv, int64_t hd, bool gated) {
  return from_floats<T>(attn_in_floats<T>(x, norm_w, eps, zc, w, b, q_norm, k_norm, cos, sin, nh, nkv, hd, gated),
                        x.numel() / x.size(-1), out_rows(w), x);
}

torch::Tensor attn_in(torch::Tensor x, torch::Tensor norm_w, double eps, bool zc, Parts w,
                      c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> q_norm,
                      c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin, int64_t nh,
                      int64_t nkv, int64_t hd, bool gated) {
  TORCH_CHECK(norm_w.scalar_type() == x.scalar_type() && cos.scalar_type() == x.scalar_type(), "dtype mismatch");
  check_parts(w, x.size(-1));
  TORCH_CHECK(out_rows(w) == nh * hd * (gated ? 2 : 1) + 2 * nkv * hd, "qkv width mismatch");
  return by_dtype(x.scalar_type(), [&](auto tag) {
    return attn_in_t<decltype(tag)>(x, norm_w, eps, zc, w, b, q_norm, k_norm, cos, sin, nh, nkv, hd, gated);
  });
}

// RMSNorm then product: y = norm(x) W^T (+ b), rounded to T (the Gated DeltaNet's input projection).
torch::Tensor norm_linear(torch::Tensor x, torch::Tensor norm_w, double eps, bool zc, Parts w,
                          c10::optional<torch::Tensor> b) {
  TORCH_CHECK(norm_w.scalar_type() == x.scalar_type(), "dtype mismatch");
  check_parts(w, x.size(-1));
  return by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    return from_floats<T>(norm_product<T>(x, norm_w, eps, zc, w, b), x.numel() / x.size(-1), out_rows(w), x);
  });
}

// The MTP block's input: fc([norm_e(e) | norm_h(h)]) for e (embedded next tokens) and h (hidden rows), [N, H] in T.
template <typename T>
torch::Tensor mtp_in_t(const torch::Tensor& e, const torch::Tensor& ne, const torch::Tensor& h, const torch::Tensor& nh,
                       double eps, bool zc, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  const int64_t d = e.size(-1), m = e.numel() / d, out = out_features(w);
  std::vector<float> ef = to_floats<T>(e), hf = to_floats<T>(h), xn(m * 2 * d), y(m * out);
  for (int64_t r = 0; r < m; ++r) {
    rms_row<T>(&ef[r * d], ne.data_ptr<T>(), &xn[r * 2 * d], d, static_cast<float>(eps), zc);
    rms_row<T>(&hf[r * d], nh.data_ptr<T>(), &xn[r * 2 * d + d], d, static_cast<float>(eps), zc);
  }
  product(w, b, xn.data(), y.data(), m, std::is_same<T, at::BFloat16>::value);
  return from_floats<T>(y, m, out, e);
}

torch::Tensor mtp_in(torch::Tensor e, torch::Tensor ne, torch::Tensor h, torch::Tensor nh, double eps, bool zc,
                     torch::Tensor w, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(h.scalar_type() == e.scalar_type() && ne.scalar_type() == e.scalar_type() &&
              nh.scalar_type() == e.scalar_type() && h.sizes() == e.sizes() && e.dim() == 2, "bad MTP input");
  TORCH_CHECK(w.is_contiguous() && in_features(w) == 2 * e.size(1), "bad fc weight");
  return by_dtype(e.scalar_type(), [&](auto tag) { return mtp_in_t<decltype(tag)>(e, ne, h, nh, eps, zc, w, b); });
}

// The rest of a decoder layer after the mixer: x1 = x + o(a * sigmoid(gate)); x2 = x1 + down(silu(g) * u) with
// [g | u] = gate_up(norm(x1)), on raw rows: `af` the attention (or Gated DeltaNet) output [N, A] as floats holding T
// values, `g` (null: no gate) the gate rows [N, A], `gs` values apart. (out_mlp_t takes them as tensors: `gate` an
// optional [N, A] view, any row stride, unit column stride.)
template <typename T>
torch::Tensor out_mlp_core(const torch::Tensor& x, std::vector<float> af, const T* g, int64_t gs,
                           const torch::Tensor& w_o, const c10::optional<torch::Tensor>& b_o,
                           const torch::Tensor& post_w, double eps, bool zc, const torch::Tensor& w_gu,
                           const c10::optional<torch::Tensor>& b_gu, const torch::Tensor& w_dn,
                           const c10::optional<torch::Tensor>& b_dn) {
  const int64_t d = x.size(-1), m = x.numel() / d, aw = in_features(w_o), inter = in_features(w_dn);
  if (g) {
    std::vector<float> s(aw);
    for (int64_t r = 0; r < m; ++r) {  // a = rnd(a * rnd(sigmoid(gate)))
      const T* gr = g + r * gs;
      float* ar = &af[r * aw];
      int64_t j = 0;
      for (; j + 8 <= aw; j += 8) _mm256_storeu_ps(&s[j], sigmoid8(load8(gr + j)));
      for (; j < aw; ++j) s[j] = 1.0f / (1.0f + std::exp(-static_cast<float>(gr[j])));
      round_all<T>(s.data(), aw);
      for (j = 0; j + 8 <= aw; j += 8)
        _mm256_storeu_ps(ar + j, round8<T>(_mm256_mul_ps(_mm256_loadu_ps(ar + j), _mm256_loadu_ps(&s[j]))));
      for (; j < aw; ++j) ar[j] = rnd<T>(ar[j] * s[j]);
    }
  }
  std::vector<float> x1 = to_floats<T>(x);
  Scratch o(m * d), xn(m * d), gu(m * 2 * inter), hbuf(m * inter), dn(m * d);
  product(w_o, b_o, af.data(), o.data(), m, std::is_same<T, at::BFloat16>::value);
  over_rows(m, d, [&](int64_t a, int64_t e) {
    add_residual<T>(&x1[a * d], &o[a * d], (e - a) * d);
    for (int64_t r = a; r < e; ++r) rms_row<T>(&x1[r * d], post_w.data_ptr<T>(), &xn[r * d], d, static_cast<float>(eps), zc);
  });
  product(w_gu, b_gu, xn.data(), gu.data(), m, std::is_same<T, at::BFloat16>::value);
  over_rows(m, 2 * inter, [&](int64_t a, int64_t e) {
    round_all<T>(&gu[a * 2 * inter], (e - a) * 2 * inter);
    for (int64_t r = a; r < e; ++r) swiglu_row<T>(&gu[r * 2 * inter], &hbuf[r * inter], inter);
  });
  product(w_dn, b_dn, hbuf.data(), dn.data(), m, std::is_same<T, at::BFloat16>::value);
  over_rows(m, d, [&](int64_t a, int64_t e) { add_residual<T>(&x1[a * d], &dn[a * d], (e - a) * d); });
  return from_floats<T>(x1, m, d, x);
}

template <typename T>
torch::Tensor out_mlp_t(const torch::Tensor& x, const torch::Tensor& a, const c10::optional<torch::Tensor>& gate,
                        const torch::Tensor& w_o, const c10::optional<torch::Tensor>& b_o, const torch::Tensor& post_w,
                        double eps, bool zc, const torch::Tensor& w_gu, const c10::optional<torch::Tensor>& b_gu,
                        const torch::Tensor& w_dn, const c10::optional<torch::Tensor>& b_dn) {
  return out_mlp_core<T>(x, to_floats<T>(a), gate.has_value() ? gate->data_ptr<T>() : nullptr,
                         gate.has_value() ? gate->stride(0) : 0, w_o, b_o, post_w, eps, zc, w_gu, b_gu, w_dn, b_dn);
}

// out_mlp's checks for x [N, d] and a mixer output of a_numel values.
void check_out_mlp(const torch::Tensor& x, int64_t a_numel, const torch::Tensor& w_o, const torch::Tensor& post_w,
                   const torch::Tensor& w_gu, const torch::Tensor& w_dn) {
  TORCH_CHECK(post_w.scalar_type() == x.scalar_type(), "dtype mismatch");
  TORCH_CHECK(w_o.is_contiguous() && w_gu.is_contiguous() && w_dn.is_contiguous(), "weights must be contiguous");
  TORCH_CHECK(in_features(w_o) * x.size(0) == a_numel && out_features(w_o) == x.size(-1), "o shape mismatch");
  TORCH_CHECK(out_features(w_gu) == 2 * in_features(w_dn) && in_features(w_gu) == x.size(-1) && out_features(w_dn) == x.size(-1),
              "mlp shape mismatch");
}

torch::Tensor out_mlp(torch::Tensor x, torch::Tensor a, c10::optional<torch::Tensor> gate, torch::Tensor w_o,
                      c10::optional<torch::Tensor> b_o, torch::Tensor post_w, double eps, bool zc, torch::Tensor w_gu,
                      c10::optional<torch::Tensor> b_gu, torch::Tensor w_dn, c10::optional<torch::Tensor> b_dn) {
  TORCH_CHECK(a.scalar_type() == x.scalar_type(), "dtype mismatch");
  check_out_mlp(x, a.numel(), w_o, post_w, w_gu, w_dn);
  if (gate.has_value())
    TORCH_CHECK(gate->scalar_type() == x.scalar_type() && gate->stride(1) == 1 && gate->size(1) == in_features(w_o),
                "bad gate");
  return by_dtype(x.scalar_type(), [&](auto tag) {
    return out_mlp_t<decltype(tag)>(x, a, gate, w_o, b_o, post_w, eps, zc, w_gu, b_gu, w_dn, b_dn);
  });
}

// ---- The whole decoder layer for a few causal tokens over a plain cache: attn_in, attention, out_mlp ----
// The attention kernel is compiled into this extension too (a unity build: attention.cpp in its own namespace).
#define TURBOSPEC_EMBED_ATTENTION
namespace attn {
#include "attention.cpp"
}  // namespace attn

// Each head's output gate (the second half of its [q | gate] in qkv rows [n, width]), heads side by side: [n, nh*hd].
template <typename T>
std::vector<T> head_gates(const T* qkv, int64_t n, int64_t width, int64_t nh, int64_t hd) {
  std::vector<T> gate(n * nh * hd);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < nh; ++h)
      std::copy_n(qkv + r * width + h * 2 * hd + hd, hd, gate.data() + (r * nh + h) * hd);
  return gate;
}

template <typename T>
torch::Tensor layer_decode_t(const torch::Tensor& x, const torch::Tensor& in_w, double eps, bool zc, const Parts& w_qkv,
                             const c10::optional<torch::Tensor>& b_qkv, const c10::optional<torch::Tensor>& q_norm,
                             const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
                             const torch::Tensor& sin, int64_t nh, int64_t nkv, int64_t hd, bool gated,
                             torch::Tensor& kc, torch::Tensor& vc, int64_t pos, double scale, const torch::Tensor& w_o,
                             const c10::optional<torch::Tensor>& b_o, const torch::Tensor& post_w,
                             const torch::Tensor& w_gu, const c10::optional<torch::Tensor>& b_gu,
                             const torch::Tensor& w_dn, const c10::optional<torch::Tensor>& b_dn,
                             const std::vector<int64_t>& parents, int64_t keep) {
  const int64_t n = x.numel() / x.size(-1), width = out_rows(w_qkv), aw = nh * hd, skip = n - keep;
  std::vector<float> y = attn_in_floats<T>(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated);
  std::vector<T> qkv(n * width);
  row_from_floats(y.data(), qkv.data(), n * width);
  const std::vector<float> o = attn::qkv_attention<T>(qkv.data(), n, width, kc, vc, pos, nh, nkv, hd, gated, scale,
                                                    parents, skip);
  std::vector<float> af(keep * aw);
  for (int64_t j = 0; j < keep * aw; ++j) af[j] = rnd<T>(o[j]);  // the attention output in T, as decode_step returns it
  const std::vector<T> gate = gated ? head_gates(qkv.data() + skip * width, keep, width, nh, hd) : std::vector<T>();
  return out_mlp_core<T>(skip ? x.narrow(0, skip, keep) : x, std::move(af), gated ? gate.data() : nullptr, aw, w_o, b_o,
                         post_w, eps, zc, w_gu, b_gu, w_dn, b_dn);
}

// attn_in, the attention over a plain cache and out_mlp of a few causal (or tree) tokens in one call, with no torch
// ops between them (a small model's decode step is bound by such overheads).
torch::Tensor layer_decode(torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_qkv,
                           c10::optional<torch::Tensor> b_qkv, c10::optional<torch::Tensor> q_norm,
                           c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin, int64_t nh,
                           int64_t nkv, int64_t hd, bool gated, torch::Tensor kc, torch::Tensor vc, int64_t pos,
                           double scale, torch::Tensor w_o, c10::optional<torch::Tensor> b_o, torch::Tensor post_w,
                           torch::Tensor w_gu, c10::optional<torch::Tensor> b_gu, torch::Tensor w_dn,
                           c10::optional<torch::Tensor> b_dn, std::vector<int64_t> parents, int64_t keep) {
  const int64_t m = x.numel() / x.size(-1);
  TORCH_CHECK(in_w.scalar_type() == x.scalar_type() && cos.scalar_type() == x.scalar_type(), "dtype mismatch");
  check_parts(w_qkv, x.size(-1));
  TORCH_CHECK(out_rows(w_qkv) == nh * hd * (gated ? 2 : 1) + 2 * nkv * hd, "qkv width mismatch");
  attn::check_decode(m, out_rows(w_qkv), kc, vc, pos, nh, nkv, hd, gated, parents);
  check_out_mlp(x, m * nh * hd, w_o, post_w, w_gu, w_dn);
  if (keep <= 0) keep = m;
  TORCH_CHECK(keep <= m && (keep == m || parents.empty()), "keep: up to N rows, fewer only for causal rows");
  return by_dtype(x.scalar_type(), [&](auto tag) {
    return layer_decode_t<decltype(tag)>(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated,
                                         kc, vc, pos, scale, w_o, b_o, post_w, w_gu, b_gu, w_dn, b_dn, parents, keep);
  });
}

// layer_decode's attention half, for layers whose feed-forward is not one SwiGLU MLP (mixture of experts):
// (attention output [N, nh*hd], the qkv rows holding the output gate). Each row equals its single-token step.
std::vector<torch::Tensor> attn_decode(torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_qkv,
                                       c10::optional<torch::Tensor> b_qkv, c10::optional<torch::Tensor> q_norm,
                                       c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin,
                                       int64_t nh, int64_t nkv, int64_t hd, bool gated, torch::Tensor kc,
                                       torch::Tensor vc, int64_t pos, double scale, std::vector<int64_t> parents) {
  auto qkv = attn_in(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated);
  return {attn::decode_step(qkv, kc, vc, pos, nh, nkv, hd, gated, scale, parents), qkv};
}

// ---- One decode token over a packed KV cache (q8_0, q4_0, tbq4_0, turbo*, or a plain type beside one) ----
// The step's K/V go into the cache through the KV encoder, compiled in here too and, as in its own build, without
// fused multiply-adds, so the cache holds the same bytes as QuantKVCache.store writes.
#define TURBOSPEC_EMBED_ENCODE
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif
namespace enc {
#include "encode.cpp"
}  // namespace enc
#ifdef __clang__
#pragma clang fp contract(on)
#endif
#pragma GCC pop_options

// One format's side of a packed cache (QuantKVCache.step_args): ints (kind, index bits, padded width, norm mode),
// tables (centroids, boundaries, rotation signs s1, s2: empty for formats without them), the layer's buffers.
struct PackedSide {
  int64_t kind, bits, width, norm_mode;
  torch::Tensor cent, bounds, s1, s2;
  std::vector<torch::Tensor> fields;
  PackedSide(const std::vector<int64_t>& ints, const std::vector<torch::Tensor>& tabs,
             const std::vector<torch::Tensor>& f)
      : fields(f) {
    TORCH_CHECK(ints.size() == 4 && tabs.size() == 4 && !f.empty(), "packed cache side: 4 ints, 4 tables, fields");
    kind = ints[0], bits = ints[1], width = ints[2], norm_mode = ints[3];
    cent = tabs[0], bounds = tabs[1], s1 = tabs[2], s2 = tabs[3];
  }
  bool rotated() const { return kind == enc::TURBO || kind == enc::TURBO64; }
  // this side's rows x [KVH, N, D] encoded for positions [pos, pos + N) into st (written by enc::scatter)
  bool stage(const torch::Tensor& x, int64_t pos, enc::Staged& st) const {
    return enc::stage(x, kind, bits, width, fields, pos, cent, bounds, s1, s2, norm_mode, st);
  }
};

// The step's K and V rows of qkv [N, W] (after attn_in) as float32 [KVH, N, D] each (for PackedSide::stage).
template <typename T>
std::pair<torch::Tensor, torch::Tensor> step_kv(const torch::Tensor& qkv, int64_t nh, int64_t nkv, int64_t hd,
                                                bool gated) {
  const int64_t n = qkv.size(0), width = qkv.size(1), q_width = nh * (gated ? 2 * hd : hd);
  auto kf = torch::empty({nkv, n, hd}, torch::kFloat), vf = torch::empty({nkv, n, hd}, torch::kFloat);
  float* kp = kf.data_ptr<float>();
  float* vp = vf.data_ptr<float>();
  const T* src = qkv.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t c = 0; c < hd; ++c) {
        kp[(h * n + i) * hd + c] = static_cast<float>(src[i * width + q_width + h * hd + c]);
        vp[(h * n + i) * hd + c] = static_cast<float>(src[i * width + q_width + (nkv + h) * hd + c]);
      }
  return {kf, vf};
}

// The step's q rows of qkv into qp [N, nh, K.width] (zero-filled by the caller, the padding stays zero), rotated
// where K is rotated, then scaled.
template <typename T>
void step_q(const torch::Tensor& qkv, int64_t nh, int64_t hd, bool gated, const PackedSide& K, double scale, float* qp) {
  const int64_t n = qkv.size(0), width = qkv.size(1), q_stride = gated ? 2 * hd : hd, kw = K.width;
  const T* src = qkv.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t c = 0; c < hd; ++c) qp[(i * nh + h) * kw + c] = static_cast<float>(src[i * width + h * q_stride + c]);
  if (K.rotated()) {
    const int64_t blk = K.s1.numel();
    for (int64_t off = 0; off < n * nh * kw; off += blk)
      enc::rotate_block(qp + off, blk, K.s1.data_ptr<float>(), K.s2.data_ptr<float>());
  }
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < n * nh * kw; ++i) qp[i] *= sc;
}

// Attention output rows o [N * nh, V.width] (normalised) rotated back where V is rotated, as [N, nh * hd] in T.
template <typename T>
torch::Tensor step_out(float* o, int64_t n, int64_t nh, int64_t hd, const PackedSide& V, const torch::Tensor& like) {
  auto out = torch::empty({n, nh * hd}, like.options());
  T* op = out.data_ptr<T>();
  for (int64_t r = 0; r < n * nh; ++r) {
    float* a = o + r * V.width;
    if (V.rotated()) {  // the inverse rotation: signs in the other order
      const int64_t blk = V.s1.numel();
      for (int64_t off = 0; off < V.width; off += blk)
        enc::rotate_block(a + off, blk, V.s2.data_ptr<float>(), V.s1.data_ptr<float>());
    }
    for (int64_t c = 0; c < hd; ++c) op[r * hd + c] = static_cast<T>(a[c]);
  }
  return out;
}

// The attention of a decode or verification step (qkv [N, W], after attn_in) over a packed cache: the N tokens'
// K/V encoded at [pos, pos + N), q rotated where K is and scaled, each row attending as the single-token step that
// decodes it (QuantKVCache.attend for one token: [base, its position], tiles from base; a tree's row its
// ancestors, `parents` as layer_decode), the output divided by the softmax sum and rotated back where V is rotated.
// [N, nh * hd] in qkv's dtype; None when a K/V value is not finite or the cache is full (nothing written; the
// caller's general path raises the error).
template <typename T>
c10::optional<torch::Tensor> packed_step_t(const torch::Tensor& qkv, int64_t nh, int64_t nkv, int64_t hd, bool gated,
                                           const PackedSide& K, const PackedSide& V, int64_t pos, int64_t base,
                                           double scale, const std::vector<int64_t>& parents) {
  const int64_t n = qkv.size(0);
  if (pos + n > K.fields[0].size(1) || pos + n > V.fields[0].size(1)) return c10::nullopt;
  const auto [kf, vf] = step_kv<T>(qkv, nh, nkv, hd, gated);
  enc::Staged k_rows, v_rows;  // both sides staged before either is written
  if (!K.stage(kf, pos, k_rows) || !V.stage(vf, pos, v_rows)) return c10::nullopt;
  enc::scatter(k_rows);
  enc::scatter(v_rows);
  std::vector<float> q(n * nh * K.width, 0.0f), o(n * nh * V.width);
  step_q<T>(qkv, nh, hd, gated, K, scale, q.data());
  attn::step_rows(q.data(), n, nh, nkv, K.width, K.kind, K.bits, K.fields, K.cent, V.kind, V.bits, V.width, V.fields,
                  V.cent, pos, base, parents, o.data());
  return step_out<T>(o.data(), n, nh, hd, V, qkv);
}

c10::optional<torch::Tensor> packed_step(const torch::Tensor& qkv, int64_t nh, int64_t nkv, int64_t hd, bool gated,
                                         const PackedSide& K, const PackedSide& V, int64_t pos, int64_t base,
                                         double scale, const std::vector<int64_t>& parents) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be contiguous [N, W]");
  TORCH_CHECK(qkv.size(1) == nh * hd * (gated ? 2 : 1) + 2 * nkv * hd && nh % nkv == 0, "qkv width mismatch");
  TORCH_CHECK(K.width >= hd && V.width >= hd && K.width % 8 == 0 && V.width % 8 == 0, "bad cache widths");
  TORCH_CHECK(!K.rotated() || (K.s1.numel() > 0 && K.width % K.s1.numel() == 0), "bad K rotation");
  TORCH_CHECK(!V.rotated() || (V.s1.numel() > 0 && V.width % V.s1.numel() == 0), "bad V rotation");
  TORCH_CHECK(base >= 0 && base <= pos, "bad base");
  TORCH_CHECK(parents.empty() || static_cast<int64_t>(parents.size()) == qkv.size(0), "one parent per row");
  for (size_t i = 0; i < parents.size(); ++i)
    TORCH_CHECK(parents[i] < static_cast<int64_t>(i), "tree rows must come after their parents");
  TORCH_CHECK(K.fields[0].size(0) == nkv && V.fields[0].size(0) == nkv, "KV heads mismatch");
  return by_dtype(qkv.scalar_type(), [&](auto tag) {
    return packed_step_t<decltype(tag)>(qkv, nh, nkv, hd, gated, K, V, pos, base, scale, parents);
  });
}

// attn_decode over a packed cache: [attention output [N, nh*hd], qkv], or [] (see packed_step).
std::vector<torch::Tensor> attn_packed(torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_qkv,
                                       c10::optional<torch::Tensor> b_qkv, c10::optional<torch::Tensor> q_norm,
                                       c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin,
                                       int64_t nh, int64_t nkv, int64_t hd, bool gated, std::vector<int64_t> k_ints,
                                       std::vector<torch::Tensor> k_tabs, std::vector<torch::Tensor> k_fields,
                                       std::vector<int64_t> v_ints, std::vector<torch::Tensor> v_tabs,
                                       std::vector<torch::Tensor> v_fields, int64_t pos, int64_t base, double scale,
                                       std::vector<int64_t> parents) {
  auto qkv = attn_in(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated);
  auto a = packed_step(qkv, nh, nkv, hd, gated, PackedSide(k_ints, k_tabs, k_fields), PackedSide(v_ints, v_tabs, v_fields),
                       pos, base, scale, parents);
  if (!a.has_value()) return {};
  return {*a, qkv};
}

// layer_decode over a packed cache: x + attention + MLP [N, H], or None (see packed_step).
c10::optional<torch::Tensor> layer_packed(torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_qkv,
                                          c10::optional<torch::Tensor> b_qkv, c10::optional<torch::Tensor> q_norm,
                                          c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin,
                                          int64_t nh, int64_t nkv, int64_t hd, bool gated, std::vector<int64_t> k_ints,
                                          std::vector<torch::Tensor> k_tabs, std::vector<torch::Tensor> k_fields,
                                          std::vector<int64_t> v_ints, std::vector<torch::Tensor> v_tabs,
                                          std::vector<torch::Tensor> v_fields, int64_t pos, int64_t base, double scale,
                                          torch::Tensor w_o, c10::optional<torch::Tensor> b_o, torch::Tensor post_w,
                                          torch::Tensor w_gu, c10::optional<torch::Tensor> b_gu, torch::Tensor w_dn,
                                          c10::optional<torch::Tensor> b_dn, std::vector<int64_t> parents) {
  auto r = attn_packed(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated, k_ints, k_tabs,
                       k_fields, v_ints, v_tabs, v_fields, pos, base, scale, parents);
  if (r.empty()) return c10::nullopt;
  check_out_mlp(x, r[0].numel(), w_o, post_w, w_gu, w_dn);
  return by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const int64_t aw = nh * hd;
    const std::vector<T> gate = gated ? head_gates(r[1].data_ptr<T>(), r[1].size(0), r[1].size(1), nh, hd)
                                      : std::vector<T>();
    return c10::optional<torch::Tensor>(out_mlp_core<T>(x, to_floats<T>(r[0]), gated ? gate.data() : nullptr, aw, w_o,
                                                        b_o, post_w, eps, zc, w_gu, b_gu, w_dn, b_dn));
  });
}

// ---- Decode rows of many sequences over a paged KV pool (continuous batching) ----
// attn_in for S rows (one per sequence), each row's K/V encoded into its sequence's physical position slots[s] of
// the pool's layer buffers (any format the encoder writes: PackedSide), q rotated where K is and scaled, then the
// paged attention (attn::attend_paged: sequence s over its first lens[s] positions in blocks tables[s]) and the
// output rotated back where V is: the attention output [S, nh * hd] in qkv's dtype, the same arithmetic as
// PagedBatch.attend for decode rows (which stores through the same C++ encoder up to encoder.MAX_ROWS vectors);
// None when a K/V value is not finite (nothing written: the caller's general path handles it). attn_paged_rows:
// attn_in, then this: [attention output, qkv], or [].
template <typename T>
c10::optional<torch::Tensor> paged_rows_t(const torch::Tensor& qkv, int64_t nh, int64_t nkv, int64_t hd, bool gated,
                                          const PackedSide& K, const PackedSide& V, const torch::Tensor& slots,
                                          const torch::Tensor& tables, const torch::Tensor& lens, int64_t block,
                                          double scale, const c10::optional<torch::Tensor>& masks) {
  const int64_t n = qkv.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < K.fields[0].size(1) && slot[i] < V.fields[0].size(1), "slot out of range");
  const auto [kf, vf] = step_kv<T>(qkv, nh, nkv, hd, gated);
  enc::Staged k_rows, v_rows;  // staged as positions [0, S), both sides before either is written
  if (!K.stage(kf, 0, k_rows) || !V.stage(vf, 0, v_rows)) return c10::nullopt;
  enc::scatter_slots(k_rows, slot);
  enc::scatter_slots(v_rows, slot);
  auto q = torch::zeros({n, nkv, nh / nkv, K.width}, torch::kFloat);  // [S, KVH, G, Dk]: head h = kv head * G + g
  step_q<T>(qkv, nh, hd, gated, K, scale, q.data_ptr<float>());
  auto o = attn::attend_paged(q, K.kind, K.bits, K.fields, K.cent, V.kind, V.bits, V.width, V.fields, V.cent, tables,
                              lens, block, masks);
  return step_out<T>(o.data_ptr<float>(), n, nh, hd, V, qkv);
}

std::vector<torch::Tensor> attn_paged_rows(torch::Tensor x, torch::Tensor in_w, double eps, bool zc,
                                           Parts w_qkv, c10::optional<torch::Tensor> b_qkv,
                                           c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                           torch::Tensor cos, torch::Tensor sin, int64_t nh, int64_t nkv, int64_t hd,
                                           bool gated, std::vector<int64_t> k_ints, std::vector<torch::Tensor> k_tabs,
                                           std::vector<torch::Tensor> k_fields, std::vector<int64_t> v_ints,
                                           std::vector<torch::Tensor> v_tabs, std::vector<torch::Tensor> v_fields,
                                           torch::Tensor slots, torch::Tensor tables, torch::Tensor lens, int64_t block,
                                           double scale, c10::optional<torch::Tensor> masks) {
  const PackedSide K(k_ints, k_tabs, k_fields), V(v_ints, v_tabs, v_fields);
  TORCH_CHECK(K.width >= hd && V.width >= hd && K.width % 8 == 0 && V.width % 8 == 0, "bad cache widths");
  TORCH_CHECK(!K.rotated() || (K.s1.numel() > 0 && K.width % K.s1.numel() == 0), "bad K rotation");
  TORCH_CHECK(!V.rotated() || (V.s1.numel() > 0 && V.width % V.s1.numel() == 0), "bad V rotation");
  TORCH_CHECK(K.fields[0].size(0) == nkv && V.fields[0].size(0) == nkv && nh % nkv == 0, "KV heads mismatch");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "slots: int64, one per row");
  auto qkv = attn_in(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated);
  TORCH_CHECK(qkv.size(1) == nh * hd * (gated ? 2 : 1) + 2 * nkv * hd, "qkv width mismatch");
  auto a = by_dtype(qkv.scalar_type(), [&](auto tag) {
    return paged_rows_t<decltype(tag)>(qkv, nh, nkv, hd, gated, K, V, slots, tables, lens, block, scale, masks);
  });
  if (!a.has_value()) return {};
  return {*a, qkv};
}

// attn_paged_rows, then out_mlp: x + attention + MLP [S, H] for decode rows over a paged pool, or None (see
// paged_rows_t).
c10::optional<torch::Tensor> layer_paged_rows(
    torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_qkv, c10::optional<torch::Tensor> b_qkv,
    c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, torch::Tensor cos, torch::Tensor sin,
    int64_t nh, int64_t nkv, int64_t hd, bool gated, std::vector<int64_t> k_ints, std::vector<torch::Tensor> k_tabs,
    std::vector<torch::Tensor> k_fields, std::vector<int64_t> v_ints, std::vector<torch::Tensor> v_tabs,
    std::vector<torch::Tensor> v_fields, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens, int64_t block,
    double scale, c10::optional<torch::Tensor> masks, torch::Tensor w_o, c10::optional<torch::Tensor> b_o,
    torch::Tensor post_w, torch::Tensor w_gu, c10::optional<torch::Tensor> b_gu, torch::Tensor w_dn,
    c10::optional<torch::Tensor> b_dn) {
  auto r = attn_paged_rows(x, in_w, eps, zc, w_qkv, b_qkv, q_norm, k_norm, cos, sin, nh, nkv, hd, gated, k_ints, k_tabs,
                           k_fields, v_ints, v_tabs, v_fields, slots, tables, lens, block, scale, masks);
  if (r.empty()) return c10::nullopt;
  c10::optional<torch::Tensor> gate;
  const int64_t n = r[1].size(0);
  if (gated) gate = r[1].narrow(1, 0, nh * 2 * hd).reshape({n, nh, 2 * hd}).narrow(2, hd, hd).reshape({n, nh * hd});
  return out_mlp(x, r[0], gate, w_o, b_o, post_w, eps, zc, w_gu, b_gu, w_dn, b_dn);
}

// ---- A Gated DeltaNet decoder layer for a few tokens: norm + input projection, the mixer, out_mlp ----
#define TURBOSPEC_EMBED_DELTANET
namespace gdn {
#include "deltanet.cpp"
}  // namespace gdn

// gdn_layer's work for checked arguments: `state` the last committed recurrent state, `par` the tree (null: a chain).
template <typename T>
std::vector<torch::Tensor> gdn_layer_t(const torch::Tensor& x, const torch::Tensor& in_w, double eps, bool zc,
                                       const Parts& w_proj, const c10::optional<torch::Tensor>& b_proj,
                                       const torch::Tensor& conv_state, const torch::Tensor& conv_t,
                                       const torch::Tensor& neg_a, const torch::Tensor& dt_bias,
                                       const torch::Tensor& norm_w, const float* state, const int64_t* par, int64_t nk,
                                       int64_t nv, int64_t dk, int64_t dv, double gdn_eps, const torch::Tensor& w_out,
                                       const c10::optional<torch::Tensor>& b_out, const torch::Tensor& post_w,
                                       const torch::Tensor& w_gu, const c10::optional<torch::Tensor>& b_gu,
                                       const torch::Tensor& w_dn, const c10::optional<torch::Tensor>& b_dn) {
  const int64_t n = x.numel() / x.size(-1), c = 2 * nk * dk + nv * dv, vd = nv * dv, width = c + vd + 2 * nv;
  const int64_t kernel = conv_t.size(0), km1 = kernel - 1;
  std::vector<float> proj = norm_product<T>(x, in_w, eps, zc, w_proj, b_proj);  // rounded to T below, as norm_linear
  // the conv window: the committed state's last K-1 rows, then the new rows' conv channels
  auto window = torch::empty({km1 + n, c}, x.options());
  T* wp = window.data_ptr<T>();
  std::copy_n(conv_state.data_ptr<T>() + (conv_state.size(0) - km1) * c, km1 * c, wp);
  std::vector<T> z(n * vd), ba(n * 2 * nv);  // the output gate's rows, then b's and a's (each [n, nv])
  for (int64_t r = 0; r < n; ++r) {
    const float* pr = proj.data() + r * width;
    row_from_floats(pr, wp + (km1 + r) * c, c);
    row_from_floats(pr + c, z.data() + r * vd, vd);
    row_from_floats(pr + c + vd, ba.data() + r * nv, nv);
    row_from_floats(pr + c + vd + nv, ba.data() + (n + r) * nv, nv);
  }
  auto states = torch::empty({n, nv, dk, dv}, torch::TensorOptions().dtype(torch::kFloat));
  std::vector<T> y(n * vd);
  gdn::run<T>(wp, conv_t.data_ptr<T>(), z.data(), ba.data(), ba.data() + n * nv, neg_a.data_ptr<float>(),
              dt_bias.data_ptr<float>(), norm_w.data_ptr<T>(), state, par, states.data_ptr<float>(), y.data(), n,
              kernel, nk, nv, dk, dv, gdn_eps, true);
  std::vector<float> af(n * vd);
  row_to_floats(y.data(), af.data(), n * vd);
  auto out = out_mlp_core<T>(x, std::move(af), nullptr, 0, w_out, b_out, post_w, eps, zc, w_gu, b_gu, w_dn, b_dn);
  return {out, window, states};
}

// x [N, H] -> (x + mixer + MLP [N, H], conv window [K-1+N, C], recurrent states [N, Hv, Dk, Dv]) for the cache's
// stash; conv_state: [>= K-1, C] (its last K-1 rows), ssm_state: [Hv, Dk, Dv] or [T, Hv, Dk, Dv] (its last). The
// same steps as the Python path (norm_linear, gdn_step, out_mlp) in one call with no torch ops between them.
std::vector<torch::Tensor> gdn_layer(torch::Tensor x, torch::Tensor in_w, double eps, bool zc, Parts w_proj,
                                     c10::optional<torch::Tensor> b_proj, torch::Tensor conv_state,
                                     torch::Tensor conv_t, torch::Tensor neg_a, torch::Tensor dt_bias,
                                     torch::Tensor norm_w, torch::Tensor ssm_state, torch::Tensor parents, int64_t nk,
                                     int64_t nv, int64_t dk, int64_t dv, double gdn_eps, torch::Tensor w_out,
                                     c10::optional<torch::Tensor> b_out, torch::Tensor post_w, torch::Tensor w_gu,
                                     c10::optional<torch::Tensor> b_gu, torch::Tensor w_dn,
                                     c10::optional<torch::Tensor> b_dn) {
  const int64_t c = 2 * nk * dk + nv * dv, vd = nv * dv, n = x.numel() / x.size(-1);
  const auto dt = x.scalar_type();
  TORCH_CHECK(in_w.scalar_type() == dt && conv_t.scalar_type() == dt && norm_w.scalar_type() == dt, "gdn_layer: mixed dtypes");
  TORCH_CHECK(neg_a.scalar_type() == torch::kFloat && dt_bias.scalar_type() == torch::kFloat &&
              ssm_state.scalar_type() == torch::kFloat, "gdn_layer: state and gates must be float32");
  TORCH_CHECK(nv % nk == 0, "value heads must be a multiple of key heads");
  check_parts(w_proj, x.size(-1));
  TORCH_CHECK(out_rows(w_proj) == c + vd + 2 * nv, "gdn_layer: input projection width mismatch");
  TORCH_CHECK(conv_t.dim() == 2 && conv_t.size(1) == c && norm_w.numel() == dv && neg_a.numel() == nv &&
              dt_bias.numel() == nv, "gdn_layer: parameter shapes");
  // the committed states may be a whole step's outputs: its conv window (the last K-1 rows are the state) and its
  // per-token states (the last one is), as HybridCache keeps them after a step it committed whole
  const int64_t km1 = conv_t.size(0) - 1;
  TORCH_CHECK(conv_state.dim() == 2 && conv_state.size(0) >= km1 && conv_state.size(1) == c, "gdn_layer: conv state rows");
  if (conv_state.scalar_type() != dt) conv_state = conv_state.to(dt);
  conv_state = conv_state.contiguous();
  ssm_state = ssm_state.contiguous();
  const int64_t state_sz = nv * dk * dv;
  TORCH_CHECK(ssm_state.numel() % state_sz == 0 && ssm_state.numel() > 0, "gdn_layer: recurrent state shape");
  const float* state = ssm_state.data_ptr<float>() + ssm_state.numel() - state_sz;  // the last one
  conv_t = conv_t.contiguous();
  norm_w = norm_w.contiguous();
  neg_a = neg_a.contiguous();
  dt_bias = dt_bias.contiguous();
  const int64_t* par = gdn::tree_parents(parents, n);
  check_out_mlp(x, n * vd, w_out, post_w, w_gu, w_dn);
  return by_dtype(dt, [&](auto tag) {
    return gdn_layer_t<decltype(tag)>(x, in_w, eps, zc, w_proj, b_proj, conv_state, conv_t, neg_a, dt_bias, norm_w,
                                      state, par, nk, nv, dk, dv, gdn_eps, w_out, b_out, post_w, w_gu, b_gu, w_dn, b_dn);
  });
}

// ---- Greedy token choice ----
// Index of the largest value of each row of float32 x [R, V], the lowest index on ties and the first NaN if any
// (torch.argmax's rules), without torch.argmax's ~30 us per 32K-value row on this machine.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) > 0, "argmax_rows: float32 [R, V]");
  x = x.contiguous();
  const int64_t rows = x.size(0), v = x.size(1);
  auto out = torch::empty({rows}, torch::kLong);
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = x.data_ptr<float>() + r * v;
      __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 bad = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= v; i += 8) {
        const __m256 a = _mm256_loadu_ps(p + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, a);
      }
      float best = -std::numeric_limits<float>::infinity();
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      for (float l : lanes) best = std::max(best, l);
      bool nan = _mm256_movemask_ps(bad) != 0;
      for (int64_t j = i; j < v; ++j) {
        nan = nan || std::isnan(p[j]);
        best = std::max(best, p[j]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(p[at])) ++at;
      } else {
        const __m256 b8 = _mm256_set1_ps(best);
        int64_t j = 0;
        for (; j + 8 <= v; j += 8) {
          const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), b8, _CMP_EQ_OQ));
          if (mask) break;
        }
        while (p[j] != best) ++j;
        at = j;
      }
      out.data_ptr<int64_t>()[r] = at;
    }
  });
  return out;
}

// argmax_rows of one float32 row, as a Python int (no tensor round trip per greedy token).
int64_t argmax1(torch::Tensor x) { return argmax_rows(x.reshape({1, -1})).data_ptr<int64_t>()[0]; }

// ---- Weights in transparent huge pages ----
// A decode step streams every weight matrix once; on 4 KB pages TLB misses can cap the 2-core stream (docs/speed.md:
// the chain of all products of the benchmark model ran up to 1.2-1.4x faster from 2 MB pages, depending on the
// machine's state). Matrices are copied into large anonymous mappings advised MADV_HUGEPAGE (bump-allocated, 4 KB
// aligned); a mapping is unmapped when the last tensor in it is freed.
namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;
constexpr size_t ARENA_MIN = size_t(64) << 20;

struct Arena {
  char* base = nullptr;
  size_t size = 0, used = 0;
  ~Arena() {
    if (base) munmap(base, size);
  }
};

std::vector<std::weak_ptr<Arena>>& all_arenas() {
  static std::vector<std::weak_ptr<Arena>> v;
  return v;
}

std::shared_ptr<Arena>& current_arena() {
  static std::shared_ptr<Arena> a;
  return a;
}

std::shared_ptr<Arena> new_arena(size_t need) {
  const size_t size = std::max(need + HUGE_PAGE, ARENA_MIN);  // untouched pages cost nothing
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "cannot map ", size, " bytes for weights");
  madvise(p, size, MADV_HUGEPAGE);
  auto a = std::make_shared<Arena>();
  a->base = static_cast<char*>(p);
  a->size = size;
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  a->used = (b + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE - b;  // start on a huge-page boundary
  all_arenas().push_back(a);
  return a;
}

// n bytes (4 KB aligned) of huge-page memory and the arena that owns them.
std::pair<char*, std::shared_ptr<Arena>> arena_alloc(size_t n) {
  const size_t need = (n + 4095) / 4096 * 4096;
  auto& cur = current_arena();
  std::shared_ptr<Arena> arena;
  if (need > ARENA_MIN / 2) {
    arena = new_arena(need);  // a large matrix gets its own mapping, unmapped when it dies
  } else {
    if (!cur || cur->used + need > cur->size) cur = new_arena(need);
    arena = cur;
  }
  char* dst = arena->base + arena->used;
  arena->used += need;
  return {dst, arena};
}

// The mapping that holds [p, p + n), from /proc/self/maps: its [lo, hi) addresses, and whether it is a private or
// read-only mapping of a file (a memory-mapped checkpoint: safetensors maps files private, numpy / gguf read-only).
struct Mapping {
  uintptr_t lo = 0, hi = 0;
  bool file = false;
};

Mapping find_mapping(const void* p, size_t n) {
  Mapping m;
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return m;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), e = a + n;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0, ino = 0;
    char perms[8] = {0}, path[256] = {0};
    if (std::sscanf(line, "%lx-%lx %7s %*s %*s %lu %255s", &lo, &hi, perms, &ino, path) < 4) continue;
    if (a >= lo && e <= hi) {
      m = {lo, hi, ino != 0 && path[0] == '/' && (perms[1] == '-' || perms[3] == 'p')};
      break;
    }
  }
  std::fclose(f);
  return m;
}

bool in_file_mapping(const void* p, size_t n) { return find_mapping(p, n).file; }

}  // namespace

// Drop the whole pages of `t` from this process when it lies in a file mapping (see in_file_mapping): the file
// still holds them, a later read faults them back in. For weights that were copied or converted elsewhere, so
// that loading holds one copy of the weights, not two. Never for tensors written in place (their private pages
// would revert to the file's bytes). True when pages were dropped.
bool release_file_pages(torch::Tensor t) {
  if (!t.is_contiguous() || t.device().type() != torch::kCPU) return false;
  const size_t n = t.nbytes();
  const char* src = static_cast<const char*>(t.data_ptr());
  if (n < 4096 || !in_file_mapping(src, n)) return false;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(src) + 4095) / 4096 * 4096;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(src) + n) / 4096 * 4096;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  return hi > lo;
}

// The [start, end) addresses of the file mapping (see find_mapping) that holds `t`, (0, 0) when `t` is not in one.
// Reads /proc/self/maps (~0.2 ms): once per MoE layer, for drop_range.
std::vector<int64_t> file_mapping_bounds(torch::Tensor t) {
  if (!t.is_contiguous() || t.device().type() != torch::kCPU || t.nbytes() < 4096) return {0, 0};
  const Mapping m = find_mapping(t.data_ptr(), t.nbytes());
  if (!m.file) return {0, 0};
  return {static_cast<int64_t>(m.lo), static_cast<int64_t>(m.hi)};
}

// Drop the whole 4 KB pages of [lo, hi), a range the caller knows lies in a read-only file mapping (the page-cache
// folios of MoE experts no cached expert uses any more, turbospec/layers/moe.py): one madvise; the file keeps them.
void drop_range(int64_t lo, int64_t hi) {
  const uintptr_t a = (static_cast<uintptr_t>(lo) + 4095) / 4096 * 4096, b = static_cast<uintptr_t>(hi) / 4096 * 4096;
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}

// Map a file-mapped tensor's pages into this process now (MADV_POPULATE_READ, else one read per page): an expert
// loaded on demand costs one call instead of a page fault per 4 KB, and its reads come before the product.
void populate_pages(torch::Tensor t) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = a / 4096 * 4096, hi = a + t.nbytes();
  if (hi <= lo) return;
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_READ) == 0) return;
  volatile uint8_t sink = 0;
  for (uintptr_t p = a; p < hi; p += 4096) sink = sink + *reinterpret_cast<const volatile uint8_t*>(p);
}

// Give the heap's free memory back to the system (after loading: the freed conversion buffers).
void trim_heap() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// A copy of `t` in huge-page memory. When `t` lies in a read-only file mapping (a memory-mapped checkpoint), its
// whole pages are dropped from this process (MADV_DONTNEED: the file still holds them), so loading holds one
// copy of the weights, not two.
torch::Tensor hugepage_copy(torch::Tensor t) {
  auto c = t.contiguous();
  const size_t n = c.nbytes();
  auto [dst, arena] = arena_alloc(n);
  // chunk by chunk, dropping a file-mapped source's pages as they are copied: one copy of the weights at a time
  constexpr size_t CHUNK = size_t(16) << 20;
  const bool mapped = n >= 4096 && in_file_mapping(c.data_ptr(), n);
  const char* src = static_cast<const char*>(c.data_ptr());
  for (size_t off = 0; off < n; off += CHUNK) {
    const size_t len = std::min(CHUNK, n - off);
    std::memcpy(dst + off, src + off, len);
    if (mapped) {
      const uintptr_t lo = (reinterpret_cast<uintptr_t>(src + off) + 4095) / 4096 * 4096;
      const uintptr_t hi = (reinterpret_cast<uintptr_t>(src + off + len)) / 4096 * 4096;
      if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    }
  }
  return torch::from_blob(dst, c.sizes(), [arena](void*) {}, c.options());
}

// An uninitialised tensor in huge-page memory (weights converted or quantized straight into their final place).
torch::Tensor hugepage_empty(std::vector<int64_t> sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (auto d : sizes) numel *= d;
  const size_t n = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (n == 0) return torch::empty(sizes, torch::TensorOptions().dtype(dtype));
  auto [dst, arena] = arena_alloc(n);
  return torch::from_blob(dst, sizes, [arena](void*) {}, torch::TensorOptions().dtype(dtype));
}

// True when t's memory is in a huge-page arena (hugepage_copy / hugepage_empty / hugepage_zeros).
bool in_arena(torch::Tensor t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  auto& v = all_arenas();
  v.erase(std::remove_if(v.begin(), v.end(), [](const std::weak_ptr<Arena>& w) { return w.expired(); }), v.end());
  for (auto& w : v)
    if (auto a = w.lock(); a && p >= a->base && p < a->base + a->size) return true;
  return false;
}

// Zero-filled tensor in its own huge-page mapping (KV caches: attention at depth streams them like weights). The
// memory is touched here, as torch.zeros would, so resident memory is what `turbospec fit` predicts.
torch::Tensor hugepage_zeros(std::vector<int64_t> sizes, at::ScalarType dtype) {
  auto opts = torch::TensorOptions().dtype(dtype);
  int64_t numel = 1;
  for (auto d : sizes) numel *= d;
  const size_t n = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (n < HUGE_PAGE) return torch::zeros(sizes, opts);
  std::shared_ptr<Arena> arena = new_arena(n);
  char* dst = arena->base + arena->used;
  std::memset(dst, 0, n);
  return torch::from_blob(dst, sizes, [arena](void*) {}, opts);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_decode", &layer_decode, "a decoder layer for a few causal or tree tokens over a plain KV cache (the last `keep` rows go on, 0: all)");
  m.def("attn_decode", &attn_decode, "layer_decode's attention half (for mixture-of-experts layers)");
  m.def("layer_packed", &layer_packed, "a decoder layer for a few causal or tree tokens over a packed KV cache");
  m.def("attn_packed", &attn_packed, "layer_packed's attention half");
  m.def("attn_paged_rows", &attn_paged_rows, "attn_in and the attention of decode rows of many sequences over a paged KV pool");
  m.def("layer_paged_rows", &layer_paged_rows, "a decoder layer for decode rows of many sequences over a paged KV pool");
  m.def("gdn_layer", &gdn_layer, "a Gated DeltaNet decoder layer for a few tokens");
  m.def("hugepage_zeros", &hugepage_zeros, "zero-filled tensor in transparent-huge-page memory");
  m.def("hugepage_copy", &hugepage_copy, "copy a tensor into transparent-huge-page memory");
  m.def("hugepage_empty", &hugepage_empty, "uninitialised tensor in transparent-huge-page memory");
  m.def("in_arena", &in_arena, "whether a tensor lies in huge-page memory of this module");
  m.def("release_file_pages", &release_file_pages, "drop a file-mapped tensor's pages from this process");
  m.def("drop_range", &drop_range, "drop the pages of an address range of a read-only file mapping");
  m.def("file_mapping_bounds", &file_mapping_bounds, "the file mapping that holds a tensor, (0, 0) if none");
  m.def("populate_pages", &populate_pages, "map a file-mapped tensor's pages in now");
  m.def("trim_heap", &trim_heap, "malloc_trim(0)");
  m.def("attn_in", &attn_in, "RMSNorm, qkv product, q/k norm and RoPE of a decode step");
  m.def("norm_linear", &norm_linear, "RMSNorm then product");
  m.def("mtp_in", &mtp_in, "the MTP block's normed, concatenated, projected input");
  m.def("out_mlp", &out_mlp, "o-projection + residual, RMSNorm, SwiGLU MLP + residual");
  m.def("skinny_linear", &skinny_linear, "x W^T for few rows");
  m.def("skinny_linear_float", &skinny_linear_float, "skinny_linear(x, w, b).float(), without the copy in x's dtype");
  m.def("rows_linear", &rows_linear, "x W[rows]^T for few rows of x, without a copy of W's rows");
  m.def("bf16_dot", &bf16_dot, "whether bf16 products can use AVX-512 BF16 dot products");
  m.def("set_bf16_dot_rows", &set_bf16_dot_rows, "fewest rows for bf16 dot products; returns the previous value");
  m.def("packed_linear", &packed_linear, "x W^T for a packed (Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K) W, any number of rows");
  m.def("dequantize_packed", &dequantize_packed, "rows of a packed weight as float32");
  m.def("quantize_packed", &quantize_packed, "float rows as ggml blocks (34: Q8_0, 18: Q4_0, 144: Q4_K)");
  m.def("packed_rows", &packed_rows, "rows ids of a packed table as float32");
  m.def("packed_blocks", &packed_blocks, "rows ids of a packed weight as ggml blocks (interleaved ones too)");
  m.def("interleave_", &interleave_, "Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K blocks rearranged in place into 8-row interleaved blocks");
  m.def("interleaved_here", &interleaved_here, "whether Linear interleaves packed weights");
  m.def("moe_experts", &moe_experts, "the routed experts of a MoE layer for a few rows (packed weights)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("silu_mul", &silu_mul, "silu(g) * u of [g | u] rows");
  m.def("argmax_rows", &argmax_rows, "first index of the maximum of each row (NaN wins)");
  m.def("argmax1", &argmax1, "argmax_rows of one row, as an int");
}
