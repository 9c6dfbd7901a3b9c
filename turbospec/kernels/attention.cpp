// Fused attention over a KV cache stored in any turbospec KV format, for few query rows (decode and short
// verification steps). Reads the packed cache once: each K/V row is decoded into an L1 buffer (nibbles,
// int8, fp16/bf16 or Lloyd-Max centroid indices -> float32) and consumed at once, never materializing the
// cache. Positions are split into tiles processed in parallel (flash-decoding); each tile returns a partial
// softmax (max, sum, unnormalized accumulator) and the tiles are merged at the end.
// Needs AVX2 + FMA + F16C.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Format kinds; the Python side (turbospec/kernels/attention.py) uses the same numbers.
enum Kind : int64_t { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4, TBQ4_0 = 5, TURBO = 6 };

struct Field {
  const uint8_t* p = nullptr;
  int64_t sh = 0, st = 0;  // byte strides per head and per position
  const uint8_t* at(int64_t h, int64_t t) const { return p + h * sh + t * st; }
};

struct Source {
  int64_t kind = F32;
  int64_t bits = 0;   // TURBO: index bits (1..4)
  int64_t width = 0;  // decoded (padded) values per row, multiple of 8
  Field f[3];         // plain: data | ggml-like: d, qs | turbo: norm, qs[, qh]
  __m256 cent_lo, cent_hi;
};

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline __m256 nibbles8(const uint8_t* q, bool high) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  if (high) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

inline __m256i codes8(const uint8_t* q, int shift, int mask) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  v = _mm256_srlv_epi32(v, _mm256_set1_epi32(shift));
  return _mm256_and_si256(v, _mm256_set1_epi32(mask));
}

struct Row {  // field pointers of one (head, position)
  const uint8_t* a;
  const uint8_t* b;
  const uint8_t* c;
};

inline Row row_of(const Source& s, int64_t h, int64_t t) {
  return {s.f[0].at(h, t), s.f[1].p ? s.f[1].at(h, t) : nullptr, s.f[2].p ? s.f[2].at(h, t) : nullptr};
}

// Values [8c, 8c + 8) of one row, as float32. KIND is the format, BITS the TurboQuant index bits.
template <int64_t KIND, int BITS>
inline __m256 dec8(const Source& s, const Row& r, int64_t c) {
  if constexpr (KIND == F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(r.a) + 8 * c);
  } else if constexpr (KIND == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.a + 16 * c)));
  } else if constexpr (KIND == BF16) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.a + 16 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (KIND == Q8_0) {  // 32 values: fp16 d, int8 qs[32]
    const int64_t blk = c >> 2;
    const float d = half_to_float(reinterpret_cast<const uint16_t*>(r.a)[blk]);
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.b + blk * 32 + (c & 3) * 8));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d));
  } else if constexpr (KIND == Q4_0 || KIND == TBQ4_0) {
    // q4_0: 32 values in 16 bytes (low nibbles 0..15, high 16..31); tbq4_0: 64 values in 32 bytes
    constexpr int64_t per = KIND == Q4_0 ? 4 : 8;  // chunks of 8 per block
    const int64_t blk = c / per, k = c % per;
    const float d = half_to_float(reinterpret_cast<const uint16_t*>(r.a)[blk]);
    __m256 v = nibbles8(r.b + blk * (per * 4) + (k % (per / 2)) * 8, k >= per / 2);
    return _mm256_fmadd_ps(v, _mm256_set1_ps(d), _mm256_set1_ps(-8.0f * d));  // d * (q - 8)
  } else {  // TURBO: 128 values per block, fp16 scale, BITS-bit Lloyd-Max indices in bit planes
    constexpr int plane = BITS == 3 ? 2 : BITS;  // width of the qs plane (3 bits: + a 1-bit plane qh)
    constexpr int plane_bytes = 128 * plane / 8;
    constexpr int group = 16 / (8 / plane);     // chunks of 8 sharing one byte range
    const int64_t blk = c >> 4, k = c & 15;
    __m256i idx = codes8(r.b + blk * plane_bytes + (k % group) * 8, static_cast<int>((k / group) * plane),
                         (1 << plane) - 1);
    if constexpr (BITS == 3) {
      __m256i hi = codes8(r.c + blk * 16 + (k & 1) * 8, static_cast<int>(k >> 1), 1);
      idx = _mm256_or_si256(idx, _mm256_slli_epi32(hi, 2));
    }
    __m256 v = _mm256_permutevar8x32_ps(s.cent_lo, idx);
    if constexpr (BITS == 4) {
      __m256 vh = _mm256_permutevar8x32_ps(s.cent_hi, idx);
      v = _mm256_blendv_ps(v, vh, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
    }
    return _mm256_mul_ps(v, _mm256_set1_ps(half_to_float(reinterpret_cast<const uint16_t*>(r.a)[blk])));
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

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

Source make_source(int64_t kind, int64_t bits, int64_t width, const std::vector<torch::Tensor>& fields,
                   const torch::Tensor& cent) {
  Source s;
  s.kind = kind;
  s.bits = bits;
  s.width = width;
  TORCH_CHECK(width % 8 == 0, "decoded width must be a multiple of 8");
  TORCH_CHECK(!fields.empty() && fields.size() <= 3, "1..3 fields expected");
  for (size_t i = 0; i < fields.size(); ++i) {
    const auto& t = fields[i];
    TORCH_CHECK(t.dim() >= 2, "fields are [heads, positions, ...]");
    int64_t inner = 1;
    for (int64_t d = t.dim() - 1; d >= 2; --d) {
      TORCH_CHECK(t.stride(d) == inner, "inner dims of a field must be contiguous");
      inner *= t.size(d);
    }
    const int64_t isz = t.element_size();
    s.f[i].p = static_cast<const uint8_t*>(t.data_ptr());
    s.f[i].sh = t.stride(0) * isz;
    s.f[i].st = t.stride(1) * isz;
  }
  float table[16] = {0};
  if (kind == TURBO) {
    TORCH_CHECK(bits >= 1 && bits <= 4 && cent.numel() == (1 << bits) && cent.scalar_type() == torch::kFloat,
                "turbo needs a float32 table of 2^bits centroids");
    TORCH_CHECK(fields.size() == (bits == 3 ? 3u : 2u), "turbo field count");
    auto c = cent.contiguous();
    std::copy(c.data_ptr<float>(), c.data_ptr<float>() + c.numel(), table);
  }
  s.cent_lo = _mm256_loadu_ps(table);
  s.cent_hi = _mm256_loadu_ps(table + 8);
  return s;
}

// Scores of 4 query rows (q4: [4, width]) against positions [s0, s1) of head h: sc[i * tile + (t - s0)].
template <int64_t KIND, int BITS>
void score4(const Source& ks, int64_t h, int64_t s0, int64_t s1, const float* q4, float* sc, int64_t tile) {
  const int64_t chunks = ks.width / 8, w = ks.width;
  for (int64_t t = s0; t < s1; ++t) {
    const Row row = row_of(ks, h, t);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 kv = dec8<KIND, BITS>(ks, row, c);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q4 + 8 * c), kv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q4 + w + 8 * c), kv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q4 + 2 * w + 8 * c), kv, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q4 + 3 * w + 8 * c), kv, a3);
    }
    sc[t - s0] = hsum(a0);
    sc[tile + t - s0] = hsum(a1);
    sc[2 * tile + t - s0] = hsum(a2);
    sc[3 * tile + t - s0] = hsum(a3);
  }
}

// acc4[i, :] = sum_t p[i * tile + (t - s0)] * v_t over positions [s0, s1), for 4 rows (acc4: [4, width]).
template <int64_t KIND, int BITS>
void accumulate4(const Source& vs, int64_t h, int64_t s0, int64_t s1, const float* p, int64_t tile, float* acc4) {
  const int64_t chunks = vs.width / 8, w = vs.width;
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t t = s0; t < s1; ++t) {
      const __m256 vv = dec8<KIND, BITS>(vs, row_of(vs, h, t), c);
      const int64_t i = t - s0;
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), vv, a0);
      a1 = _mm256_fmadd_ps(_mm256_set1_ps(p[tile + i]), vv, a1);
      a2 = _mm256_fmadd_ps(_mm256_set1_ps(p[2 * tile + i]), vv, a2);
      a3 = _mm256_fmadd_ps(_mm256_set1_ps(p[3 * tile + i]), vv, a3);
    }
    _mm256_storeu_ps(acc4 + 8 * c, a0);
    _mm256_storeu_ps(acc4 + w + 8 * c, a1);
    _mm256_storeu_ps(acc4 + 2 * w + 8 * c, a2);
    _mm256_storeu_ps(acc4 + 3 * w + 8 * c, a3);
  }
}

using ScoreFn = void (*)(const Source&, int64_t, int64_t, int64_t, const float*, float*, int64_t);
using AccFn = void (*)(const Source&, int64_t, int64_t, int64_t, const float*, int64_t, float*);

template <template <int64_t, int> class Pick>
auto pick(int64_t kind, int64_t bits) {
  switch (kind) {
    case F32: return Pick<F32, 0>::fn;
    case F16: return Pick<F16, 0>::fn;
    case BF16: return Pick<BF16, 0>::fn;
    case Q8_0: return Pick<Q8_0, 0>::fn;
    case Q4_0: return Pick<Q4_0, 0>::fn;
    case TBQ4_0: return Pick<TBQ4_0, 0>::fn;
    case TURBO:
      switch (bits) {
        case 1: return Pick<TURBO, 1>::fn;
        case 2: return Pick<TURBO, 2>::fn;
        case 3: return Pick<TURBO, 3>::fn;
        case 4: return Pick<TURBO, 4>::fn;
        default: break;
      }
      break;
    default: break;
  }
  TORCH_CHECK(false, "unknown KV kind ", kind, " (bits ", bits, ")");
  return Pick<F32, 0>::fn;
}

template <int64_t K, int B>
struct ScorePick { static constexpr ScoreFn fn = score4<K, B>; };
template <int64_t K, int B>
struct AccPick { static constexpr AccFn fn = accumulate4<K, B>; };

}  // namespace

// q: float32 [KVH, R, Dk] (already scaled, rotated where K is rotated). Attends to positions [start, end) of
// the K/V sources (fields [KVH, T, ...]). Returns (m [KVH, R], l [KVH, R], acc [KVH, R, Dv]): per row the
// max score, sum of exp(score - m) and sum of exp(score - m) * v.
std::vector<torch::Tensor> attend_partial(torch::Tensor q, int64_t k_kind, int64_t k_bits,
                                          std::vector<torch::Tensor> k_fields, torch::Tensor k_cent,
                                          int64_t v_kind, int64_t v_bits, int64_t v_width,
                                          std::vector<torch::Tensor> v_fields, torch::Tensor v_cent,
                                          int64_t start, int64_t end, int64_t tile) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 3, "q must be float32 [KVH, R, D]");
  const int64_t kvh = q.size(0), rows = q.size(1), dk = q.size(2);
  const int64_t rows4 = (rows + 3) / 4 * 4;  // rows padded to groups of 4 (zero query rows, ignored)
  auto qp4 = torch::zeros({kvh, rows4, dk}, torch::kFloat);
  qp4.narrow(1, 0, rows).copy_(q);
  const Source ks = make_source(k_kind, k_bits, dk, k_fields, k_cent);
  const Source vs = make_source(v_kind, v_bits, v_width, v_fields, v_cent);
  const ScoreFn score = pick<ScorePick>(k_kind, k_bits);
  const AccFn accumulate = pick<AccPick>(v_kind, v_bits);
  const int64_t dv = v_width;
  const int64_t n = std::max<int64_t>(0, end - start);
  tile = std::max<int64_t>(tile, 1);
  const int64_t tiles = (n + tile - 1) / tile;
  const int64_t tasks = kvh * tiles;
  std::vector<float> pm(tasks * rows4), pl(tasks * rows4), pacc(tasks * rows4 * dv);
  const float* qp = qp4.data_ptr<float>();

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    // flush denormals: tiny softmax weights times small values would otherwise hit the slow denormal path
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    std::vector<float> sc(rows4 * tile);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / tiles, s0 = start + (task % tiles) * tile;
      const int64_t s1 = std::min(end, s0 + tile), len = s1 - s0;
      const float* qh = qp + h * rows4 * dk;
      for (int64_t r0 = 0; r0 < rows4; r0 += 4) score(ks, h, s0, s1, qh + r0 * dk, sc.data() + r0 * tile, tile);
      float* m = pm.data() + task * rows4;
      float* l = pl.data() + task * rows4;
      for (int64_t r = 0; r < rows4; ++r) {
        float* row = sc.data() + r * tile;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < len; ++i) mx = std::max(mx, row[i]);
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 mx8 = _mm256_set1_ps(mx);
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
          __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(row + i), mx8));
          _mm256_storeu_ps(row + i, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        for (; i < len; ++i) {
          row[i] = std::exp(row[i] - mx);
          sum += row[i];
        }
        m[r] = mx;
        l[r] = sum;
      }
      float* acc = pacc.data() + task * rows4 * dv;
      for (int64_t r0 = 0; r0 < rows4; r0 += 4) accumulate(vs, h, s0, s1, sc.data() + r0 * tile, tile, acc + r0 * dv);
    }
    _mm_setcsr(csr);
  });

  auto m_out = torch::full({kvh, rows}, -std::numeric_limits<float>::infinity(), torch::kFloat);
  auto l_out = torch::zeros({kvh, rows}, torch::kFloat);
  auto acc_out = torch::zeros({kvh, rows, dv}, torch::kFloat);
  float* mo = m_out.data_ptr<float>();
  float* lo = l_out.data_ptr<float>();
  float* ao = acc_out.data_ptr<float>();
  for (int64_t h = 0; h < kvh; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < tiles; ++j) mx = std::max(mx, pm[(h * tiles + j) * rows4 + r]);
      if (!std::isfinite(mx)) continue;
      float sum = 0.0f;
      float* a = ao + (h * rows + r) * dv;
      for (int64_t j = 0; j < tiles; ++j) {
        const int64_t task = h * tiles + j;
        const float w = std::exp(pm[task * rows4 + r] - mx);
        sum += w * pl[task * rows4 + r];
        const float* pa = pacc.data() + (task * rows4 + r) * dv;
        for (int64_t c = 0; c < dv; ++c) a[c] += w * pa[c];
      }
      mo[h * rows + r] = mx;
      lo[h * rows + r] = sum;
    }
  }
  return {m_out, l_out, acc_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_partial", &attend_partial, "partial softmax attention over a (packed) KV cache");
}
