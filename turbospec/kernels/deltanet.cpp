// Gated DeltaNet token mixer for decode and speculative verification (few tokens, state after every token):
// everything between the input projection and the output projection in one call -- causal depthwise conv +
// SiLU, per-head l2 norm of q/k, beta/decay gates, the gated delta-rule recurrence (float32 state) and the
// gated RMSNorm of the output. Replaces ~40 small torch ops per layer per step (turbospec/layers/gated_deltanet.py
// documents the math; the Python path stays the reference and the prefill path).
//
// 16-bit models: the Python path rounds to the model dtype after the conv multiply-adds, the SiLU, the
// normalised output and the norm weight product; this kernel rounds at the same points so both paths agree.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Window rows feeding node t's conv, oldest first: its root path (row K-1+j for node j), then the committed
// conv state rows K-2, K-3, ... A chain (parents == nullptr) gives rows t .. t+K-1.
void conv_rows(const int64_t* parents, int64_t t, int64_t kernel, int64_t* rows) {
  if (!parents) {
    for (int64_t i = 0; i < kernel; ++i) rows[i] = t + i;
    return;
  }
  int64_t len = 0, u = t, r = kernel - 2;
  while (u >= 0 && len < kernel) { rows[kernel - 1 - len++] = kernel - 1 + u; u = parents[u]; }
  while (len < kernel) rows[kernel - 1 - len++] = r--;
}

// One token of the delta rule from state `src` [dk, dv] into `dst` (the same buffer for an update in place), dv a
// multiple of 32, 32 columns at a time (a column block's delta depends on that block only, so both passes run while
// its 8 KB stay in L1): S = decay src; delta = (v - S^T k) * beta; S += k delta^T; o = S^T q. Multiplies and adds
// are kept apart and in the order of the scalar loop, so the result is the same to the bit. Reading the previous
// state and writing the new one in the first pass saves a copy of the state per token (a verification step keeps
// every token's state).
inline void delta_rule_32(const float* src, float* dst, const float* q, const float* k, const float* v, float decay,
                          float beta, int64_t dk, int64_t dv, float* o) {
  const __m256 dec = _mm256_set1_ps(decay), bet = _mm256_set1_ps(beta);
  for (int64_t c = 0; c < dv; c += 32) {
    __m256 m[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < dk; ++i) {
      const float* in = src + i * dv + c;
      float* row = dst + i * dv + c;
      const __m256 ki = _mm256_set1_ps(k[i]);
      for (int u = 0; u < 4; ++u) {
        const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(in + 8 * u), dec);
        _mm256_storeu_ps(row + 8 * u, r);
        m[u] = _mm256_add_ps(m[u], _mm256_mul_ps(ki, r));
      }
    }
    __m256 d[4], acc[4];
    for (int u = 0; u < 4; ++u) {
      d[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + c + 8 * u), m[u]), bet);
      acc[u] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < dk; ++i) {
      float* row = dst + i * dv + c;
      const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
      for (int u = 0; u < 4; ++u) {
        const __m256 r = _mm256_add_ps(_mm256_loadu_ps(row + 8 * u), _mm256_mul_ps(ki, d[u]));
        _mm256_storeu_ps(row + 8 * u, r);
        acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(qi, r));
      }
    }
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(o + c + 8 * u, acc[u]);
  }
}

template <typename T>
void run(const T* window, const T* conv_t, const T* z, const T* b, const T* a, const float* neg_a,
         const float* dt_bias, const T* norm_w, const float* state0, const int64_t* parents, float* states, T* y,
         int64_t n, int64_t kernel, int64_t nk, int64_t nv, int64_t dk, int64_t dv, double eps, bool all_states) {
  const int64_t key_dim = nk * dk, value_dim = nv * dv, c = 2 * key_dim + value_dim;
  const int64_t rep = nv / nk;
  // conv + SiLU over all channels of the n new tokens, in float (rounded like the Python path)
  std::vector<float> mixed(n * c);
  std::vector<int64_t> rows(kernel);
  for (int64_t t = 0; t < n; ++t) {  // tap by tap over all channels (vectorizes), each channel's sum in tap order
    conv_rows(parents, t, kernel, rows.data());
    float* acc = mixed.data() + t * c;
    const T* w0 = window + rows[0] * c;
    for (int64_t ch = 0; ch < c; ++ch) acc[ch] = rnd<T>(static_cast<float>(w0[ch]) * static_cast<float>(conv_t[ch]));
    for (int64_t i = 1; i < kernel; ++i) {
      const T* wi = window + rows[i] * c;
      const T* ti = conv_t + i * c;
      for (int64_t ch = 0; ch < c; ++ch)
        acc[ch] = rnd<T>(acc[ch] + rnd<T>(static_cast<float>(wi[ch]) * static_cast<float>(ti[ch])));
    }
  }
  silu_all(mixed.data(), mixed.data(), n * c);
  round_all<T>(mixed.data(), n * c);
  // l2-normalised q (scaled) and k per key head
  const float qscale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t part = 0; part < 2; ++part) {
      for (int64_t h = 0; h < nk; ++h) {
        float* x = mixed.data() + t * c + part * key_dim + h * dk;
        float ss = 0.0f;
        for (int64_t i = 0; i < dk; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / std::sqrt(ss + 1e-6f);
        for (int64_t i = 0; i < dk; ++i) x[i] = part == 0 ? x[i] * inv * qscale : x[i] * inv;
      }
    }
  }
  const int64_t state_sz = dk * dv;
  at::parallel_for(0, nv, 1, [&](int64_t h0, int64_t h1) {  // heads in parallel (2 cores: 2 threads)
    std::vector<float> s(all_states ? 0 : state_sz), mem(dv), o(dv), gz(dv);
    for (int64_t h = h0; h < h1; ++h) {
      // each token's state goes straight to its place in `states` (all_states), else to `s` and the last token's
      // to `states`; the previous state is read where it lies (no copies)
      const float* prev = state0 + h * state_sz;
      const int64_t kh = h / rep;
      for (int64_t t = 0; t < n; ++t) {
        if (parents && parents[t] != t - 1)  // a tree node: continue from its parent's state
          prev = parents[t] < 0 ? state0 + h * state_sz : states + (parents[t] * nv + h) * state_sz;
        float* cur = all_states ? states + (t * nv + h) * state_sz : t == n - 1 ? states + h * state_sz : s.data();
        const float* q = mixed.data() + t * c + kh * dk;
        const float* k = mixed.data() + t * c + key_dim + kh * dk;
        const float* v = mixed.data() + t * c + 2 * key_dim + h * dv;
        const float beta = sigmoid(static_cast<float>(b[t * nv + h]));
        const float decay = std::exp(neg_a[h] * softplus(static_cast<float>(a[t * nv + h]) + dt_bias[h]));
        if (dv % 32 == 0) {
          delta_rule_32(prev, cur, q, k, v, decay, beta, dk, dv, o.data());
        } else {
          if (cur != prev) std::copy(prev, prev + state_sz, cur);
          std::fill(mem.begin(), mem.end(), 0.0f);
          for (int64_t i = 0; i < dk; ++i) {
            float* row = cur + i * dv;
            const float ki = k[i];
            for (int64_t j = 0; j < dv; ++j) {
              row[j] *= decay;
              mem[j] += ki * row[j];
            }
          }
          for (int64_t j = 0; j < dv; ++j) mem[j] = (v[j] - mem[j]) * beta;  // delta
          std::fill(o.begin(), o.end(), 0.0f);
          for (int64_t i = 0; i < dk; ++i) {
            float* row = cur + i * dv;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < dv; ++j) {
              row[j] += ki * mem[j];
              o[j] += qi * row[j];
            }
          }
        }
        prev = cur;
        // gated RMSNorm: (w * round(o / rms(o))) * silu(z)
        float ss = 0.0f;
        for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
        const T* zr = z + t * value_dim + h * dv;
        for (int64_t j = 0; j < dv; ++j) gz[j] = static_cast<float>(zr[j]);
        silu_all(gz.data(), gz.data(), dv);
        for (int64_t j = 0; j < dv; ++j) {
          const float on = rnd<T>(o[j] * inv);
          const float wn = rnd<T>(static_cast<float>(norm_w[j]) * on);
          y[t * value_dim + h * dv + j] = static_cast<T>(wn * gz[j]);
        }
      }
    }
  });
}

}  // namespace

// The nodes' parents of a token tree of n tokens (int64 [n], each after its parent, -1 = the committed state),
// checked and made contiguous in place; null for a chain (an empty tensor).
const int64_t* tree_parents(torch::Tensor& parents, int64_t n) {
  if (parents.numel() == 0) return nullptr;
  TORCH_CHECK(parents.numel() == n && parents.scalar_type() == torch::kLong, "parents must be int64 [N]");
  parents = parents.contiguous();
  const int64_t* par = parents.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(par[t] < t && par[t] >= -1, "parents out of order");
  return par;
}

// window [K-1+N, C] (conv state rows then the new projected rows), conv_t [K, C], z [N, Hv*Dv], b/a [N, Hv]
// (model dtype); neg_a, dt_bias [Hv] float32; norm_w [Dv]; state [Hv, Dk, Dv] float32 (not modified); parents
// int64 [N] for a token tree (node i continues from node parents[i], -1 = state), empty for a chain. Writes y
// [N, Hv*Dv] (model dtype, contiguous rows) and returns the states [N or 1, Hv, Dk, Dv] float32.
torch::Tensor step_into(torch::Tensor window, torch::Tensor conv_t, torch::Tensor z, torch::Tensor b, torch::Tensor a,
                        const torch::Tensor& neg_a, const torch::Tensor& dt_bias, torch::Tensor norm_w,
                        torch::Tensor state, torch::Tensor parents, int64_t nk, int64_t nv, int64_t dk, int64_t dv,
                        double eps, bool all_states, torch::Tensor& y, const torch::Tensor& out = torch::Tensor()) {
  const auto dt = window.scalar_type();
  TORCH_CHECK(conv_t.scalar_type() == dt && z.scalar_type() == dt && b.scalar_type() == dt &&
              a.scalar_type() == dt && norm_w.scalar_type() == dt, "gdn_step: mixed dtypes");
  TORCH_CHECK(state.scalar_type() == torch::kFloat && neg_a.scalar_type() == torch::kFloat &&
              dt_bias.scalar_type() == torch::kFloat, "gdn_step: state and gates must be float32");
  TORCH_CHECK(nv % nk == 0, "value heads must be a multiple of key heads");
  window = window.contiguous(); conv_t = conv_t.contiguous(); z = z.contiguous(); b = b.contiguous();
  a = a.contiguous(); norm_w = norm_w.contiguous(); state = state.contiguous();
  const int64_t kernel = conv_t.size(0), n = window.size(0) - (kernel - 1);
  TORCH_CHECK(n >= 1 && window.size(1) == 2 * nk * dk + nv * dv && state.numel() == nv * dk * dv, "gdn_step: shapes");
  TORCH_CHECK(parents.numel() == 0 || all_states, "gdn_step: a token tree needs all_states");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == dt && y.size(0) == n && y.size(1) == nv * dv, "gdn_step: output");
  const int64_t* par = tree_parents(parents, n);
  torch::Tensor states = out;  // (a buffer of the caller's, reused from an earlier step: no fresh pages to fault in)
  if (states.defined() && states.numel() > 0) {
    TORCH_CHECK(states.is_contiguous() && states.scalar_type() == torch::kFloat &&
                states.numel() == (all_states ? n : 1) * nv * dk * dv, "gdn_step: states buffer");
  } else {
    states = torch::empty({all_states ? n : 1, nv, dk, dv}, state.options());
  }
#define GDN_RUN(T)                                                                                              \
  run<T>(window.data_ptr<T>(), conv_t.data_ptr<T>(), z.data_ptr<T>(), b.data_ptr<T>(), a.data_ptr<T>(),     \
         neg_a.data_ptr<float>(), dt_bias.data_ptr<float>(), norm_w.data_ptr<T>(), state.data_ptr<float>(), par, \
         states.data_ptr<float>(), y.data_ptr<T>(), n, kernel, nk, nv, dk, dv, eps, all_states)
  switch (dt) {
    case torch::kFloat: GDN_RUN(float); break;
    case torch::kBFloat16: GDN_RUN(at::BFloat16); break;
    case torch::kHalf: GDN_RUN(at::Half); break;
    default: TORCH_CHECK(false, "gdn_step: unsupported dtype");
  }
#undef GDN_RUN
  return states;
}

// `step_into` with y of its own: (y [N, Hv*Dv] model dtype, states [N or 1, Hv, Dk, Dv] float32).
std::vector<torch::Tensor> gdn_step(torch::Tensor window, torch::Tensor conv_t, torch::Tensor z, torch::Tensor b,
                                    torch::Tensor a, torch::Tensor neg_a, torch::Tensor dt_bias,
                                    torch::Tensor norm_w, torch::Tensor state, torch::Tensor parents, int64_t nk,
                                    int64_t nv, int64_t dk, int64_t dv, double eps, bool all_states) {
  auto y = torch::empty({window.size(0) - (conv_t.size(0) - 1), nv * dv}, window.options());
  auto states = step_into(window, conv_t, z, b, a, neg_a, dt_bias, norm_w, state, parents, nk, nv, dk, dv, eps,
                          all_states, y);
  return {y, states};
}

// gdn_step for every sequence of a batched step in one call: proj [N, C + Hv*Dv + 2 Hv] (the input projection's
// rows: conv channels | z | b | a) holds segment s's rows at [starts[s], starts[s+1]); conv_states[s] [>= K-1, C]
// (its last K-1 rows are the state), ssm_states[s] [Hv, Dk, Dv] or [T, Hv, Dk, Dv] (its last one), parents[s] its
// tree (empty: a chain), outs[s] where its states go (float32 [n, Hv, Dk, Dv], or empty: new ones); every segment
// keeps the state after each of its rows. Returns [y [N, Hv*Dv], then per
// segment its conv window [K-1+n, C] and states [n, Hv, Dk, Dv]]: gdn_step's work per segment (`step_into`, each
// writing its rows of y), over the window of its conv state and its rows -- one call from Python for the batch
// instead of one per sequence.
std::vector<torch::Tensor> gdn_steps(torch::Tensor proj, torch::Tensor conv_t, torch::Tensor neg_a,
                                     torch::Tensor dt_bias, torch::Tensor norm_w, std::vector<torch::Tensor> conv_states,
                                     std::vector<torch::Tensor> ssm_states, std::vector<int64_t> starts,
                                     std::vector<torch::Tensor> parents, std::vector<torch::Tensor> outs, int64_t nk,
                                     int64_t nv, int64_t dk, int64_t dv, double eps) {
  const int64_t segs = static_cast<int64_t>(conv_states.size());
  const int64_t c = 2 * nk * dk + nv * dv, vd = nv * dv, km1 = conv_t.size(0) - 1;
  TORCH_CHECK(proj.dim() == 2 && proj.size(1) == c + vd + 2 * nv, "gdn_steps: projection width mismatch");
  TORCH_CHECK(static_cast<int64_t>(ssm_states.size()) == segs && static_cast<int64_t>(parents.size()) == segs &&
              static_cast<int64_t>(starts.size()) == segs + 1 && starts[0] == 0 && starts[segs] == proj.size(0) &&
              static_cast<int64_t>(outs.size()) == segs, "gdn_steps: one state, tree, start and buffer per segment");
  auto y = torch::empty({proj.size(0), vd}, proj.options());
  std::vector<torch::Tensor> out{y};
  for (int64_t s = 0; s < segs; ++s) {
    const int64_t r0 = starts[s], n = starts[s + 1] - r0;
    TORCH_CHECK(n >= 1, "gdn_steps: an empty segment");
    const torch::Tensor& conv = conv_states[s];
    TORCH_CHECK(conv.dim() == 2 && conv.size(0) >= km1 && conv.size(1) == c, "gdn_steps: conv state rows");
    torch::Tensor state = ssm_states[s];
    if (state.dim() == 4) state = state[state.size(0) - 1];
    const torch::Tensor rows = proj.narrow(0, r0, n);
    auto window = torch::cat({conv.narrow(0, conv.size(0) - km1, km1).to(proj.scalar_type()), rows.narrow(1, 0, c)}, 0);
    auto y_rows = y.narrow(0, r0, n);  // (whole rows of y: contiguous)
    auto states = step_into(window, conv_t, rows.narrow(1, c, vd), rows.narrow(1, c + vd, nv),
                            rows.narrow(1, c + vd + nv, nv), neg_a, dt_bias, norm_w, state, parents[s], nk, nv, dk,
                            dv, eps, true, y_rows, outs[s]);
    out.push_back(window);
    out.push_back(states);
  }
  return out;
}

#ifndef TURBOSPEC_EMBED_DELTANET  // gemv.cpp includes this file for its one-call GDN layer
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdn_step", &gdn_step, "Gated DeltaNet mixer for few tokens (decode / verification)");
  m.def("gdn_steps", &gdn_steps, "gdn_step for every sequence of a batched step in one call");
}
#endif
