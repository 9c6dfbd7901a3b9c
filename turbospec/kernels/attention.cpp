// Fused attention over a KV cache stored in any turbospec KV format, for few query rows (decode and short
// verification steps). Reads the packed cache once: each K/V row is decoded into an L1 buffer (nibbles,
// int8, fp16/bf16 or Lloyd-Max centroid indices -> float32) and consumed at once, never materializing the
// cache. Positions are split into tiles processed in parallel (flash-decoding); each tile returns a partial
// softmax (max, sum, unnormalized accumulator) and the tiles are merged at the end.
// Needs AVX2 + FMA + F16C; AVX-512 VNNI kernels for the packed formats where the CPU has them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

// Format kinds; the Python side (turbospec/kernels/attention.py) uses the same numbers. TURBO: 128-value
// rotation blocks, TURBO64: 64-value blocks (head sizes that are a multiple of 64 but not of 128).
enum Kind : int64_t { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4, TBQ4_0 = 5, TURBO = 6, TURBO64 = 7 };

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
  __m256 cent_lo, cent_hi;  // turbo lookup tables (see make_source)
  float cent[16] = {0};     // turbo: the 2^bits centroids (the AVX-512 kernels' one-register table)
  // 3/4-bit turbo whose centroids lie on an int8 grid (turbospec/kv/formats/turbo.py `int8_grid`): centroid i =
  // (ucode[i] - 128) * unit, for score_turbo_vnni
  bool int_grid = false;
  float unit = 0.0f;
  uint8_t ucode[16] = {0};
};

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i bytes8(const uint8_t* q) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}

struct Row {  // field pointers of one (head, position)
  const uint8_t* a;
  const uint8_t* b;
  const uint8_t* c;
};

inline Row row_of(const Source& s, int64_t h, int64_t t) {
  return {s.f[0].at(h, t), s.f[1].p ? s.f[1].at(h, t) : nullptr, s.f[2].p ? s.f[2].at(h, t) : nullptr};
}

constexpr bool is_turbo(int64_t kind) { return kind == TURBO || kind == TURBO64; }
constexpr int64_t turbo_block(int64_t kind) { return kind == TURBO64 ? 64 : 128; }

// Chunks of 8 values are decoded in pairs (c, c + H) that share their bytes: adjacent chunks of plain and
// q8_0 rows, the low/high nibbles of q4_0 and tbq4_0, the bit fields 4 bits apart of turbo's bit planes.
template <int64_t KIND>
constexpr int64_t pair_dist() {
  if constexpr (KIND == Q4_0) return 2;
  else if constexpr (KIND == TBQ4_0) return 4;
  else if constexpr (is_turbo(KIND)) return turbo_block(KIND) / 16;
  else return 1;
}

// Block formats decode *raw* values (ints, nibbles, centroids) and the callers apply each block's fp16 scale
// (field 0: d or norm) once per block and row: value = scale * (raw - OFFSET). SPAN: chunks per block (0: plain).
template <int64_t KIND>
constexpr int64_t span_chunks() {
  if constexpr (KIND == Q8_0 || KIND == Q4_0) return 4;
  else if constexpr (KIND == TBQ4_0) return 8;
  else if constexpr (is_turbo(KIND)) return turbo_block(KIND) / 8;
  else return 0;
}
template <int64_t KIND>
constexpr float raw_offset() { return KIND == Q4_0 || KIND == TBQ4_0 ? 8.0f : 0.0f; }

inline float block_scale(const Row& r, int64_t blk) { return half_to_float(reinterpret_cast<const uint16_t*>(r.a)[blk]); }

// Values [8c, 8c + 8) of a plain row, as float32.
template <int64_t KIND>
inline __m256 plain8(const Row& r, int64_t c) {
  if constexpr (KIND == F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(r.a) + 8 * c);
  } else if constexpr (KIND == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.a + 16 * c)));
  } else {  // BF16
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.a + 16 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

// Turbo: chunks c and c + H of one row (same block), centroid values. Index planes: bit plane of width w
// stores value j of a block at byte j % P, bit (j / P) * w (P = block * w / 8 bytes).
// vpermps looks up only the low 3 bits of each lane (vpermilps, within each 128-bit half: the low 2 bits), so
// the tables repeat with the plane's period and the remaining index bit (4-bit: bit 3, 3-bit: the qh plane)
// picks between two tables with a blend on the sign.
template <int64_t KIND, int BITS>
inline void turbo_pair(const Source& s, const Row& r, int64_t c, __m256& x0, __m256& x1) {
  constexpr int64_t B = turbo_block(KIND), CH = B / 8;  // values, chunks per block
  constexpr int w = BITS == 3 ? 2 : BITS;
  constexpr int64_t P = B * w / 8;
  const int64_t blk = c / CH, k = c % CH;
  const int sh = static_cast<int>((8 * k / P) * w);
  const __m256i v = bytes8(r.b + blk * P + (8 * k) % P);
  if constexpr (BITS == 4) {  // k < CH / 2: low nibble, partner: high nibble
    const __m256i u = _mm256_srli_epi32(v, 4);
    x0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(s.cent_lo, v), _mm256_permutevar8x32_ps(s.cent_hi, v),
                          _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
    x1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(s.cent_lo, u), _mm256_permutevar8x32_ps(s.cent_hi, u),
                          _mm256_castsi256_ps(_mm256_slli_epi32(v, 24)));
  } else if constexpr (BITS == 3) {
    constexpr int64_t PH = B / 8;  // 1-bit plane
    const int shh = static_cast<int>(8 * k / PH);
    const __m256i hb = bytes8(r.c + blk * PH + (8 * k) % PH);
    const __m256i a = _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh));
    const __m256i b = _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh + 4));
    x0 = _mm256_blendv_ps(_mm256_permutevar_ps(s.cent_lo, a), _mm256_permutevar_ps(s.cent_hi, a),
                          _mm256_castsi256_ps(_mm256_sll_epi32(hb, _mm_cvtsi32_si128(31 - shh))));
    x1 = _mm256_blendv_ps(_mm256_permutevar_ps(s.cent_lo, b), _mm256_permutevar_ps(s.cent_hi, b),
                          _mm256_castsi256_ps(_mm256_sll_epi32(hb, _mm_cvtsi32_si128(27 - shh))));
  } else if constexpr (BITS == 2) {  // in-lane 4-entry lookup (vpermilps reads the low 2 bits)
    x0 = _mm256_permutevar_ps(s.cent_lo, _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh)));
    x1 = _mm256_permutevar_ps(s.cent_lo, _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh + 4)));
  } else {  // 1 bit: periodic table
    x0 = _mm256_permutevar8x32_ps(s.cent_lo, _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh)));
    x1 = _mm256_permutevar8x32_ps(s.cent_lo, _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh + 4)));
  }
}

// Raw values of chunks c and c + H.
template <int64_t KIND, int BITS>
inline void dec_pair(const Source& s, const Row& r, int64_t c, __m256& x0, __m256& x1) {
  if constexpr (is_turbo(KIND)) {
    turbo_pair<KIND, BITS>(s, r, c, x0, x1);
  } else if constexpr (KIND == Q8_0) {  // 32 int8 per block; c even: 16 bytes of two chunks
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.b + (c >> 2) * 32 + (c & 3) * 8));
    x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
  } else if constexpr (KIND == Q4_0 || KIND == TBQ4_0) {  // nibbles: low = chunk c, high = chunk c + H
    constexpr int64_t per = KIND == Q4_0 ? 4 : 8;  // chunks per block
    const __m256i v = bytes8(r.b + (c / per) * (per * 4) + (c % per) * 8);
    x0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    x1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else {
    x0 = plain8<KIND>(r, c);
    x1 = plain8<KIND>(r, c + 1);
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
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
  float lo[8] = {0}, hi[8] = {0};
  if (is_turbo(kind)) {
    TORCH_CHECK(bits >= 1 && bits <= 4 && cent.numel() == (1 << bits) && cent.scalar_type() == torch::kFloat,
                "turbo needs a float32 table of 2^bits centroids");
    TORCH_CHECK(fields.size() == (bits == 3 ? 3u : 2u), "turbo field count");
    TORCH_CHECK(width % turbo_block(kind) == 0, "turbo width must be a multiple of its block");
    auto c = cent.contiguous();
    const float* t = c.data_ptr<float>();
    std::copy(t, t + (1 << bits), s.cent);
    // lookup tables indexed by the low 3 bits of a lane (see turbo_pair)
    const int period = bits == 3 ? 4 : std::min<int>(1 << bits, 8);
    for (int i = 0; i < 8; ++i) {
      lo[i] = t[i % period];
      if (bits == 3) hi[i] = t[4 + i % 4];
      if (bits == 4) hi[i] = t[8 + i];
    }
    if (bits == 3 || bits == 4) {  // on an int8 grid? (within float rounding of the Python side's code * unit)
      const int n = 1 << bits;
      float cmax = 0.0f;
      for (int i = 0; i < n; ++i) cmax = std::max(cmax, std::fabs(t[i]));
      s.unit = cmax / 127.0f;
      s.int_grid = cmax > 0.0f && std::isfinite(cmax);
      for (int i = 0; i < n && s.int_grid; ++i) {
        const float code = std::nearbyint(t[i] / s.unit);
        s.int_grid = std::fabs(code * s.unit - t[i]) <= 1e-6f * cmax && std::fabs(code) <= 127.0f;
        if (s.int_grid) s.ucode[i] = static_cast<uint8_t>(code + 128.0f);
      }
    }
  }
  s.cent_lo = _mm256_loadu_ps(lo);
  s.cent_hi = _mm256_loadu_ps(hi);
  return s;
}

// Sums of 4 vectors at once: lane i of the result = sum of the lanes of a_i.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Visits the chunks of a row (or of one block) as pairs (c, c + H) and, for an odd plain row, a last single
// chunk: fn(c, paired).
template <int64_t H, class Fn>
inline void for_pairs(int64_t c0, int64_t c1, Fn&& fn) {
  for (int64_t g = c0; g < c1; g += 2 * H)
    for (int64_t c = g; c < g + H && c < c1; ++c) fn(c, c + H < c1);
}

#define FMA4(acc, x, w0, w1, w2, w3)            \
  acc##0 = _mm256_fmadd_ps(w0, x, acc##0);      \
  acc##1 = _mm256_fmadd_ps(w1, x, acc##1);      \
  acc##2 = _mm256_fmadd_ps(w2, x, acc##2);      \
  acc##3 = _mm256_fmadd_ps(w3, x, acc##3)

// The query rows of one group of 4 (one KV head) as the score kernels read them: q [4, dk] float32 (for integer
// keys -- q8_0, q4_0, tbq4_0, turbo4 and turbo3 -- rounded to 8 bits per key block, see round_queries); per key block and row
// ([blocks][4]): qsum, the rows' sums of q (the raw-value offset of q4_0 / tbq4_0 keys), and for integer keys the
// int8 rows qi [4, dk] with their scales (q = qi * scale) and integer sums isum.
struct QGroup {
  const float* q;
  const float* qsum;
  const int8_t* qi;
  const float* scale;
  const int32_t* isum;
};

// Scores of 4 query rows (q4: [4, width]) against positions [s0, s1) of head h: sc[i * tile + (t - s0)].
// Two accumulators per row (the two chunks of a pair) keep 8 independent FMA chains in flight. Block formats:
// per block, score += scale * (sum q * raw - OFFSET * sum q), with qsum [blocks][4] the rows' sums of q.
template <int64_t KIND, int BITS>
void score4(const Source& ks, int64_t h, int64_t s0, int64_t s1, const QGroup& qg, float* sc, int64_t tile) {
  const float* q4 = qg.q;
  const float* qsum = qg.qsum;
  constexpr int64_t H = pair_dist<KIND>(), SPAN = span_chunks<KIND>();
  constexpr float OFF = raw_offset<KIND>();
  const int64_t chunks = ks.width / 8, w = ks.width;
  const int64_t span = SPAN ? SPAN : chunks;
  for (int64_t t = s0; t < s1; ++t) {
    const Row row = row_of(ks, h, t);
    __m128 tot = _mm_setzero_ps();
    for (int64_t b0 = 0; b0 < chunks; b0 += span) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      __m256 b0v = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
      for_pairs<H>(b0, b0 + span, [&](int64_t c, bool paired) {
        const float* q = q4 + 8 * c;
        if (paired) {
          __m256 x0, x1;
          dec_pair<KIND, BITS>(ks, row, c, x0, x1);
          const float* p = q + 8 * H;
          b0v = _mm256_fmadd_ps(_mm256_loadu_ps(p), x1, b0v);
          b1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + w), x1, b1);
          b2 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 2 * w), x1, b2);
          b3 = _mm256_fmadd_ps(_mm256_loadu_ps(p + 3 * w), x1, b3);
          FMA4(a, x0, _mm256_loadu_ps(q), _mm256_loadu_ps(q + w), _mm256_loadu_ps(q + 2 * w), _mm256_loadu_ps(q + 3 * w));
        } else {  // plain rows only
          const __m256 x0 = plain8<SPAN ? F32 : KIND>(row, c);
          FMA4(a, x0, _mm256_loadu_ps(q), _mm256_loadu_ps(q + w), _mm256_loadu_ps(q + 2 * w), _mm256_loadu_ps(q + 3 * w));
        }
      });
      __m128 part = hsum4(_mm256_add_ps(a0, b0v), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3));
      if constexpr (SPAN != 0) {
        const int64_t blk = b0 / span;
        if constexpr (OFF != 0.0f) part = _mm_fnmadd_ps(_mm_set1_ps(OFF), _mm_loadu_ps(qsum + 4 * blk), part);
        tot = _mm_fmadd_ps(part, _mm_set1_ps(block_scale(row, blk)), tot);
      } else {
        tot = _mm_add_ps(tot, part);
      }
    }
    alignas(16) float s4[4];
    _mm_store_ps(s4, tot);
    sc[t - s0] = s4[0];
    sc[tile + t - s0] = s4[1];
    sc[2 * tile + t - s0] = s4[2];
    sc[3 * tile + t - s0] = s4[3];
  }
}

// Integer formats (q8_0, q4_0, tbq4_0): values per block; 0 for the other kinds.
constexpr int64_t int_block(int64_t kind) { return kind == Q8_0 || kind == Q4_0 ? 32 : kind == TBQ4_0 ? 64 : 0; }

// The block over which a query row is rounded to 8 bits against keys of (kind, bits): the integer formats' block,
// 3/4-bit turbo's rotation block (its codebook lies on an int8 grid; turbospec/kv/query_rounding.py); 0: not rounded.
constexpr int64_t query_block(int64_t kind, int64_t bits) {
  return is_turbo(kind) ? (bits == 3 || bits == 4 ? turbo_block(kind) : 0) : int_block(kind);
}

// ---- Integer keys (q8_0, q4_0, tbq4_0) with AVX-512 VNNI ----
// 16 positions at a time, one per 32-bit lane: 16 key bytes of each position are transposed (lane i of T[j] =
// dword j of position i) and vpdpbusd multiplies 4 key bytes (unsigned: nibbles, or q8_0's int8 + 128) with 4 int8
// query values broadcast from memory. A lane computes its own position alone: a position's score does not depend on
// which positions share its group (a partial group repeats its last position).
#define TS_ATT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

inline bool att_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                          !std::getenv("TURBOSPEC_NO_AVX512");
  return yes;
}

// Bytes [off, off + 16) of the rows p[0..15] -> T[j]: lane i = dword j of row i.
TS_ATT512 inline void transpose16x4(const uint8_t* const* p, int64_t off, __m512i* T) {
  __m512i A[4];
  for (int k = 0; k < 4; ++k) {  // A[k], 128-bit lane l: row k + 4l
    __m512i a = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k] + off)));
    a = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k + 4] + off)), 1);
    a = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k + 8] + off)), 2);
    A[k] = _mm512_inserti32x4(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k + 12] + off)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
  T[0] = _mm512_unpacklo_epi64(t0, t2);
  T[1] = _mm512_unpackhi_epi64(t0, t2);
  T[2] = _mm512_unpacklo_epi64(t1, t3);
  T[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Block b's fp16 scales (field f, nb per position) of the n <= 16 positions from t0, as float32 (lanes >= n: 0).
// Positions stored back to back with nb in {1, 2, 4}: masked loads and a 16-bit permute; else one at a time.
TS_ATT512 inline __m512 scale16(const Field& f, int64_t h, int64_t t0, int64_t n, int64_t nb, int64_t b) {
  const uint8_t* p = f.at(h, t0);
  if (f.st == 2 * nb && (nb == 1 || nb == 2 || nb == 4)) {
    const auto upto = [](int64_t k) {  // mask of the first k of 32 halves
      return k >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>(k <= 0 ? 0u : (1u << k) - 1);
    };
    const __m512i z0 = _mm512_maskz_loadu_epi16(upto(n * nb), p);
    if (nb == 1) return _mm512_cvtph_ps(_mm512_castsi512_si256(z0));
    const __m512i z1 = nb == 4 ? _mm512_maskz_loadu_epi16(upto(n * nb - 32), p + 64) : _mm512_setzero_si512();
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                          12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_add_epi16(_mm512_mullo_epi16(iota, _mm512_set1_epi16(static_cast<int16_t>(nb))),
                                         _mm512_set1_epi16(static_cast<int16_t>(b)));
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(z0, idx, z1)));
  }
  alignas(32) uint16_t dh[16] = {0};
  for (int64_t i = 0; i < n; ++i) std::memcpy(dh + i, f.at(h, t0 + i) + 2 * b, 2);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
}

// pn[r * tile + i] = p[r * tile + i] * block b's scale at position s0 + i (field f, nb blocks per position) for the
// 4 rows and i < len; sums[r] = the sum of row r's pn.
TS_ATT512 inline void scaled_weights(const Field& f, int64_t h, int64_t s0, int64_t len, int64_t nb, int64_t b,
                                     const float* p, int64_t tile, float* pn, float* sums) {
  __m512 ps[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i0 = 0; i0 < len; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - i0);
    const __m512 d = scale16(f, h, s0 + i0, n, nb, b);
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < 4; ++r) {
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + r * tile + i0), d);
      _mm512_mask_storeu_ps(pn + r * tile + i0, keep, x);
      ps[r] = _mm512_add_ps(ps[r], x);
    }
  }
  for (int r = 0; r < 4; ++r) sums[r] = _mm512_reduce_add_ps(ps[r]);
}

TS_ATT512 inline __m512i bcast4(const int8_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// score4 for integer keys from the rows' int8 values: per key block, sum(qi * stored) - OFFSET * sum(qi) in int32
// (stored = raw + OFFSET: nibbles + 8, q8_0 + 128), then * scale * the block's fp16 scale. The same value as
// score4 over the rounded q (q = qi * scale) up to float rounding.
template <int64_t KIND>
TS_ATT512 void score_vnni(const Source& ks, int64_t h, int64_t s0, int64_t s1, const QGroup& qg, float* sc,
                          int64_t tile) {
  constexpr int64_t BV = int_block(KIND);
  constexpr int64_t BB = KIND == Q8_0 ? 32 : BV / 2;  // key bytes per block
  constexpr int32_t OFF = KIND == Q8_0 ? 128 : 8;
  const int64_t w = ks.width, nb = w / BV;
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* kq[16];
  for (int64_t t0 = s0; t0 < s1; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, s1 - t0);
    for (int i = 0; i < 16; ++i) {
      kq[i] = ks.f[1].at(h, t0 + std::min<int64_t>(i, n - 1));
    }
    __m512 fs[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      const int8_t* qb = qg.qi + b * BV;
      for (int64_t u = 0; u < BB / 16; ++u) {
        __m512i T[4];
        transpose16x4(kq, b * BB + 16 * u, T);
        for (int j = 0; j < 4; ++j) {
          const int64_t v = 16 * u + 4 * j;  // the block's values of T[j] (nibble kinds: low nibbles)
          if constexpr (KIND == Q8_0) {
            const __m512i x = _mm512_xor_si512(T[j], flip);
            for (int r = 0; r < 4; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], x, bcast4(qb + r * w + v));
          } else {  // byte m: value m (low nibble) and m + BV / 2 (high nibble)
            const __m512i lo = _mm512_and_si512(T[j], low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(T[j], 4), low4);
            for (int r = 0; r < 4; ++r) {
              acc[r] = _mm512_dpbusd_epi32(acc[r], lo, bcast4(qb + r * w + v));
              acc[r] = _mm512_dpbusd_epi32(acc[r], hi, bcast4(qb + r * w + v + BV / 2));
            }
          }
        }
      }
      const __m512 d = scale16(ks.f[0], h, t0, n, nb, b);
      for (int r = 0; r < 4; ++r) {
        const __m512i raw = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(OFF * qg.isum[4 * b + r]));
        fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(raw), _mm512_mul_ps(d, _mm512_set1_ps(qg.scale[4 * b + r])), fs[r]);
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < 4; ++r) _mm512_mask_storeu_ps(sc + r * tile + (t0 - s0), keep, fs[r]);
  }
}

// Bytes [off, off + 8) of the rows p[0..15] -> T[0], T[1]: lane i = dword j of row i.
TS_ATT512 inline void transpose16x2(const uint8_t* const* p, int64_t off, __m512i* T) {
  alignas(64) uint32_t w[2][16];
  for (int i = 0; i < 16; ++i) {
    std::memcpy(&w[0][i], p[i] + off, 4);
    std::memcpy(&w[1][i], p[i] + off + 4, 4);
  }
  T[0] = _mm512_load_si512(w[0]);
  T[1] = _mm512_load_si512(w[1]);
}

// score_vnni for 3/4-bit turbo keys on an int8 grid (Source::int_grid). Each index is looked up (vpshufb, a 16-byte
// table) as its code + 128, unsigned for vpdpbusd, and per block sum(qi * (code + 128)) - 128 * sum(qi) is scaled by
// the row's scale, the grid's unit and the block's fp16 norm: score4 over the rounded q and the centroids up to float
// rounding. 4-bit: a block's nibbles are laid out as q4_0's (byte m: value m low, m + B / 2 high). 3-bit: the low two
// bits of value j at byte j % P, bits 2 (j / P) of the qs plane (P = B / 4), its high bit at byte j % P1, bit j / P1
// of the qh plane (P1 = B / 8): qs byte m holds values m + P s (s = 0..3), whose high bits sit in qh byte m % P1 at
// bit m / P1 + 2 s (P = 2 P1).
template <int64_t KIND, int BITS>
TS_ATT512 void score_turbo_vnni(const Source& ks, int64_t h, int64_t s0, int64_t s1, const QGroup& qg, float* sc,
                                int64_t tile) {
  constexpr int64_t BV = turbo_block(KIND);             // values per block
  constexpr int64_t P = BITS == 4 ? BV / 2 : BV / 4;    // qs bytes per block
  constexpr int64_t P1 = BV / 8;                        // 3-bit: qh bytes per block (16 or 8)
  const int64_t w = ks.width, nb = w / BV;
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03), one = _mm512_set1_epi8(0x01);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks.ucode)));
  const uint8_t* kq[16];
  const uint8_t* kh[16];
  for (int64_t t0 = s0; t0 < s1; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, s1 - t0);
    for (int i = 0; i < 16; ++i) {
      kq[i] = ks.f[1].at(h, t0 + std::min<int64_t>(i, n - 1));
      if constexpr (BITS == 3) kh[i] = ks.f[2].at(h, t0 + std::min<int64_t>(i, n - 1));
    }
    __m512 fs[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      const int8_t* qb = qg.qi + b * BV;
      __m512i H[4];
      if constexpr (BITS == 3) {
        if constexpr (P1 == 16) transpose16x4(kh, b * P1, H);
        else transpose16x2(kh, b * P1, H);
      }
      for (int64_t u = 0; u < P / 16; ++u) {
        __m512i T[4];
        transpose16x4(kq, b * P + 16 * u, T);
        for (int j = 0; j < 4; ++j) {
          const int64_t m = 16 * u + 4 * j;  // the qs bytes of T[j]: m .. m + 3
          if constexpr (BITS == 4) {
            const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(T[j], low4));
            const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(T[j], 4), low4));
            for (int r = 0; r < 4; ++r) {
              acc[r] = _mm512_dpbusd_epi32(acc[r], lo, bcast4(qb + r * w + m));
              acc[r] = _mm512_dpbusd_epi32(acc[r], hi, bcast4(qb + r * w + m + P));
            }
          } else {
            const __m512i hw = H[(m % P1) / 4];
            const int hs = static_cast<int>(m / P1);
            for (int k = 0; k < 4; ++k) {  // values m + P k .. + 3
              const __m512i lo2 = _mm512_and_si512(_mm512_srl_epi16(T[j], _mm_cvtsi32_si128(2 * k)), low2);
              const __m512i hi1 = _mm512_and_si512(_mm512_srl_epi16(hw, _mm_cvtsi32_si128(hs + 2 * k)), one);
              const __m512i x = _mm512_shuffle_epi8(lut, _mm512_or_si512(lo2, _mm512_slli_epi16(hi1, 2)));
              for (int r = 0; r < 4; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], x, bcast4(qb + r * w + m + P * k));
            }
          }
        }
      }
      const __m512 d = _mm512_mul_ps(scale16(ks.f[0], h, t0, n, nb, b), _mm512_set1_ps(ks.unit));
      for (int r = 0; r < 4; ++r) {
        const __m512i raw = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * qg.isum[4 * b + r]));
        fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(raw), _mm512_mul_ps(d, _mm512_set1_ps(qg.scale[4 * b + r])), fs[r]);
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < 4; ++r) _mm512_mask_storeu_ps(sc + r * tile + (t0 - s0), keep, fs[r]);
  }
}

// acc4[i, :] = sum_t p[i * tile + (t - s0)] * v_t over positions [s0, s1), for 4 rows (acc4: [4, width]).
// Block formats: per block the weights are first scaled by each position's block scale (pn, scratch of
// 4 * tile floats) and, with an offset, OFFSET * sum(pn) is subtracted from the block's outputs.
template <int64_t KIND, int BITS>
void accumulate4(const Source& vs, int64_t h, int64_t s0, int64_t s1, const float* p, int64_t tile, float* acc4,
                 float* pn) {
  constexpr int64_t H = pair_dist<KIND>(), SPAN = span_chunks<KIND>();
  constexpr float OFF = raw_offset<KIND>();
  const int64_t chunks = vs.width / 8, w = vs.width, len = s1 - s0;
  const int64_t span = SPAN ? SPAN : chunks;
  for (int64_t b0 = 0; b0 < chunks; b0 += span) {
    const float* pw = p;
    __m256 off0 = _mm256_setzero_ps(), off1 = off0, off2 = off0, off3 = off0;
    if constexpr (SPAN != 0) {
      float ps[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t i = 0; i < len; ++i) {
        const float sc = block_scale(row_of(vs, h, s0 + i), b0 / span);
        for (int r = 0; r < 4; ++r) {
          pn[r * tile + i] = p[r * tile + i] * sc;
          ps[r] += pn[r * tile + i];
        }
      }
      pw = pn;
      off0 = _mm256_set1_ps(OFF * ps[0]);
      off1 = _mm256_set1_ps(OFF * ps[1]);
      off2 = _mm256_set1_ps(OFF * ps[2]);
      off3 = _mm256_set1_ps(OFF * ps[3]);
    }
    for_pairs<H>(b0, b0 + span, [&](int64_t c, bool paired) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      __m256 b0v = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
      if (paired) {
        for (int64_t i = 0; i < len; ++i) {
          __m256 x0, x1;
          dec_pair<KIND, BITS>(vs, row_of(vs, h, s0 + i), c, x0, x1);
          const __m256 p0 = _mm256_broadcast_ss(pw + i), p1 = _mm256_broadcast_ss(pw + tile + i);
          const __m256 p2 = _mm256_broadcast_ss(pw + 2 * tile + i), p3 = _mm256_broadcast_ss(pw + 3 * tile + i);
          FMA4(a, x0, p0, p1, p2, p3);
          b0v = _mm256_fmadd_ps(p0, x1, b0v);
          b1 = _mm256_fmadd_ps(p1, x1, b1);
          b2 = _mm256_fmadd_ps(p2, x1, b2);
          b3 = _mm256_fmadd_ps(p3, x1, b3);
        }
        float* o = acc4 + 8 * (c + H);
        _mm256_storeu_ps(o, _mm256_sub_ps(b0v, off0));
        _mm256_storeu_ps(o + w, _mm256_sub_ps(b1, off1));
        _mm256_storeu_ps(o + 2 * w, _mm256_sub_ps(b2, off2));
        _mm256_storeu_ps(o + 3 * w, _mm256_sub_ps(b3, off3));
      } else {  // plain rows only
        for (int64_t i = 0; i < len; ++i) {
          const __m256 x0 = plain8<SPAN ? F32 : KIND>(row_of(vs, h, s0 + i), c);
          FMA4(a, x0, _mm256_broadcast_ss(pw + i), _mm256_broadcast_ss(pw + tile + i),
               _mm256_broadcast_ss(pw + 2 * tile + i), _mm256_broadcast_ss(pw + 3 * tile + i));
        }
      }
      float* o = acc4 + 8 * c;
      _mm256_storeu_ps(o, _mm256_sub_ps(a0, off0));
      _mm256_storeu_ps(o + w, _mm256_sub_ps(a1, off1));
      _mm256_storeu_ps(o + 2 * w, _mm256_sub_ps(a2, off2));
      _mm256_storeu_ps(o + 3 * w, _mm256_sub_ps(a3, off3));
    });
  }
}

// accumulate4 for integer values (q8_0, q4_0, tbq4_0) with AVX-512: per value block, the weights times each
// position's block scale (pn) 16 positions at a time, then one pass over the positions with the block's 4 rows x
// BV / 16 accumulators in registers (a decoded block feeds all 4 rows).
template <int64_t KIND>
TS_ATT512 void accumulate_int512(const Source& vs, int64_t h, int64_t s0, int64_t s1, const float* p, int64_t tile,
                                 float* acc4, float* pn) {
  constexpr int64_t BV = int_block(KIND), NV = BV / 16;  // values, vectors per block
  constexpr int64_t BB = KIND == Q8_0 ? 32 : BV / 2;               // stored bytes per block
  constexpr float OFF = KIND == Q8_0 ? 0.0f : 8.0f;
  const int64_t w = vs.width, nb = w / BV, len = s1 - s0;
  for (int64_t b = 0; b < nb; ++b) {
    float ps[4];
    scaled_weights(vs.f[0], h, s0, len, nb, b, p, tile, pn, ps);
    __m512 a[4][NV];
    for (int r = 0; r < 4; ++r)
      for (int k = 0; k < NV; ++k) a[r][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; ++i) {
      const uint8_t* q = vs.f[1].at(h, s0 + i) + b * BB;
      __m512 x[NV];
      if constexpr (KIND == Q8_0) {
        x[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        x[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
      } else {  // byte m: value m (low nibble), m + BV / 2 (high)
        for (int k = 0; k < NV / 2; ++k) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k)));
          x[k] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
          x[k + NV / 2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
      }
      for (int r = 0; r < 4; ++r) {
        const __m512 wr = _mm512_set1_ps(pn[r * tile + i]);
        for (int k = 0; k < NV; ++k) a[r][k] = _mm512_fmadd_ps(wr, x[k], a[r][k]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      const __m512 off = _mm512_set1_ps(OFF * ps[r]);
      for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc4 + r * w + b * BV + 16 * k, _mm512_sub_ps(a[r][k], off));
    }
  }
}

// Values [16c, 16c + 16) of a plain row, as float32 (the values plain8 gives, 16 at a time).
template <int64_t KIND>
TS_ATT512 inline __m512 plain16(const uint8_t* row, int64_t c) {
  if constexpr (KIND == F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  } else if constexpr (KIND == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  } else {  // BF16
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// Values [16 c0, 16 (c0 + NC)) of the 4 rows' accumulators over positions [s0, s0 + len): NC x 4 sums in registers,
// each position's values read once for the 4 rows.
template <int64_t KIND, int NC>
TS_ATT512 inline void plain_pass(const Field& f, int64_t h, int64_t s0, int64_t len, const float* p, int64_t tile,
                                 float* acc4, int64_t w, int64_t c0) {
  __m512 a[4][NC];
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < NC; ++k) a[r][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    const uint8_t* row = f.at(h, s0 + i);
    __m512 x[NC];
    for (int k = 0; k < NC; ++k) x[k] = plain16<KIND>(row, c0 + k);
    for (int r = 0; r < 4; ++r) {
      const __m512 wr = _mm512_set1_ps(p[r * tile + i]);
      for (int k = 0; k < NC; ++k) a[r][k] = _mm512_fmadd_ps(wr, x[k], a[r][k]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < NC; ++k) _mm512_storeu_ps(acc4 + r * w + 16 * (c0 + k), a[r][k]);
}

// accumulate4 for plain values (float32, float16, bfloat16) with AVX-512: the positions in one pass per 64 values
// (accumulate4 makes one per 16 values, reading each row again from the cache). Every sum is the same chain of
// operations as accumulate4's (from 0, one FMA per position in order), so the same values; rows whose width is not a
// multiple of 16 take accumulate4.
template <int64_t KIND>
TS_ATT512 void accumulate_plain512(const Source& vs, int64_t h, int64_t s0, int64_t s1, const float* p, int64_t tile,
                                   float* acc4, float* pn) {
  const int64_t w = vs.width, len = s1 - s0, nc = w / 16;
  if (w % 16) return accumulate4<KIND, 0>(vs, h, s0, s1, p, tile, acc4, pn);
  int64_t c = 0;
  for (; c + 4 <= nc; c += 4) plain_pass<KIND, 4>(vs.f[0], h, s0, len, p, tile, acc4, w, c);
  switch (nc - c) {
    case 3: plain_pass<KIND, 3>(vs.f[0], h, s0, len, p, tile, acc4, w, c); break;
    case 2: plain_pass<KIND, 2>(vs.f[0], h, s0, len, p, tile, acc4, w, c); break;
    case 1: plain_pass<KIND, 1>(vs.f[0], h, s0, len, p, tile, acc4, w, c); break;
    default: break;
  }
}

// ---- Turbo formats with AVX-512: 16 centroid indices at a time, looked up in one register (vpermps) ----

// Bits [sh, sh + W) of 16 bytes (P >= 16: bytes o .. o + 15) or of 8 bytes twice (P = 8: values 0-7 at bit sh, 8-15
// at bit sh + 1; only W = 1 has P = 8), one 32-bit lane per value.
template <int W>
TS_ATT512 inline __m512i plane16(const uint8_t* plane, int64_t P, int64_t j0) {
  const __m512i mask = _mm512_set1_epi32((1 << W) - 1);
  if (P >= 16) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane + j0 % P)));
    return _mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>((j0 / P) * W)), mask);
  }
  int64_t bytes8;
  std::memcpy(&bytes8, plane, 8);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes8));
  const __m512i sh = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0 / 8)),
                                      _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
  return _mm512_and_si512(_mm512_srlv_epi32(v, sh), mask);
}

// Centroid values of a turbo row's values [j0, j0 + 16) of block blk (j0 a multiple of 16).
template <int64_t KIND, int BITS>
TS_ATT512 inline __m512 turbo16(const Row& r, int64_t blk, int64_t j0, __m512 table) {
  constexpr int64_t B = turbo_block(KIND);
  constexpr int W = BITS == 3 ? 2 : BITS;
  constexpr int64_t P = B * W / 8;
  __m512i idx = plane16<W>(r.b + blk * P, P, j0);
  if constexpr (BITS == 3) idx = _mm512_or_si512(idx, _mm512_slli_epi32(plane16<1>(r.c + blk * (B / 8), B / 8, j0), 2));
  return _mm512_permutexvar_ps(idx, table);
}

// Lane sums of 4 vectors: lane i of the result = sum of a[i]'s 16 lanes.
TS_ATT512 inline __m128 sum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// score4 for turbo keys: per block, the 4 rows' dot products with the centroid values, times the block's norm.
template <int64_t KIND, int BITS>
TS_ATT512 void score_turbo512(const Source& ks, int64_t h, int64_t s0, int64_t s1, const QGroup& qg, float* sc,
                              int64_t tile) {
  constexpr int64_t B = turbo_block(KIND);
  const int64_t w = ks.width, nb = w / B;
  const float* q = qg.q;
  const __m512 table = _mm512_loadu_ps(ks.cent);
  for (int64_t t = s0; t < s1; ++t) {
    const Row row = row_of(ks, h, t);
    __m128 tot = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t j0 = 0; j0 < B; j0 += 16) {
        const __m512 x = turbo16<KIND, BITS>(row, b, j0, table);
        const float* qj = q + b * B + j0;
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qj), x, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qj + w), x, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 2 * w), x, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 3 * w), x, a3);
      }
      tot = _mm_fmadd_ps(sum4x16(a0, a1, a2, a3), _mm_set1_ps(block_scale(row, b)), tot);
    }
    alignas(16) float s4[4];
    _mm_store_ps(s4, tot);
    for (int r = 0; r < 4; ++r) sc[r * tile + t - s0] = s4[r];
  }
}

// accumulate4 for turbo values: per block the weights times each position's norm (pn), then passes of up to 64
// values over the positions with 4 rows x 4 accumulators in registers.
template <int64_t KIND, int BITS>
TS_ATT512 void accumulate_turbo512(const Source& vs, int64_t h, int64_t s0, int64_t s1, const float* p, int64_t tile,
                                   float* acc4, float* pn) {
  constexpr int64_t B = turbo_block(KIND), SPAN = B < 64 ? B : 64, NV = SPAN / 16;
  const int64_t w = vs.width, nb = w / B, len = s1 - s0;
  const __m512 table = _mm512_loadu_ps(vs.cent);
  for (int64_t b = 0; b < nb; ++b) {
    float ps[4];  // unused: turbo values have no offset
    scaled_weights(vs.f[0], h, s0, len, nb, b, p, tile, pn, ps);
    for (int64_t c0 = 0; c0 < B; c0 += SPAN) {
      __m512 a[4][NV];
      for (int r = 0; r < 4; ++r)
        for (int k = 0; k < NV; ++k) a[r][k] = _mm512_setzero_ps();
      for (int64_t i = 0; i < len; ++i) {
        const Row row = row_of(vs, h, s0 + i);
        __m512 x[NV];
        for (int k = 0; k < NV; ++k) x[k] = turbo16<KIND, BITS>(row, b, c0 + 16 * k, table);
        for (int r = 0; r < 4; ++r) {
          const __m512 wr = _mm512_set1_ps(pn[r * tile + i]);
          for (int k = 0; k < NV; ++k) a[r][k] = _mm512_fmadd_ps(wr, x[k], a[r][k]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc4 + r * w + b * B + c0 + 16 * k, a[r][k]);
    }
  }
}

using ScoreFn = void (*)(const Source&, int64_t, int64_t, int64_t, const QGroup&, float*, int64_t);
using AccFn = void (*)(const Source&, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*);

template <template <int64_t, int> class Pick, int64_t KIND>
auto pick_bits(int64_t bits) {
  switch (bits) {
    case 1: return Pick<KIND, 1>::fn;
    case 2: return Pick<KIND, 2>::fn;
    case 3: return Pick<KIND, 3>::fn;
    case 4: return Pick<KIND, 4>::fn;
    default: break;
  }
  TORCH_CHECK(false, "turbo index bits must be 1..4, got ", bits);
  return Pick<KIND, 1>::fn;
}

template <template <int64_t, int> class Pick>
auto pick(int64_t kind, int64_t bits) {
  switch (kind) {
    case F32: return Pick<F32, 0>::fn;
    case F16: return Pick<F16, 0>::fn;
    case BF16: return Pick<BF16, 0>::fn;
    case Q8_0: return Pick<Q8_0, 0>::fn;
    case Q4_0: return Pick<Q4_0, 0>::fn;
    case TBQ4_0: return Pick<TBQ4_0, 0>::fn;
    case TURBO: return pick_bits<Pick, TURBO>(bits);
    case TURBO64: return pick_bits<Pick, TURBO64>(bits);
    default: break;
  }
  TORCH_CHECK(false, "unknown KV kind ", kind, " (bits ", bits, ")");
  return Pick<F32, 0>::fn;
}

template <int64_t K, int B>
struct ScorePick { static constexpr ScoreFn fn = score4<K, B>; };
template <int64_t K, int B>
struct AccPick { static constexpr AccFn fn = accumulate4<K, B>; };
template <int64_t K, int B>  // the AVX-512 turbo kernels (TURBO / TURBO64 kinds)
struct TurboScorePick { static constexpr ScoreFn fn = score_turbo512<K, B>; };
template <int64_t K, int B>
struct TurboAccPick { static constexpr AccFn fn = accumulate_turbo512<K, B>; };

// The score kernel of a K source where the CPU has AVX-512 VNNI: score_vnni (integer keys), score_turbo_vnni
// (3/4-bit turbo on an int8 grid), score_turbo512 (other turbo); score4 otherwise (and for plain keys).
inline ScoreFn pick_score(const Source& ks) {
  const int64_t kind = ks.kind, bits = ks.bits;
  if (att_vnni()) {
    if (ks.int_grid && kind == TURBO) return bits == 4 ? score_turbo_vnni<TURBO, 4> : score_turbo_vnni<TURBO, 3>;
    if (ks.int_grid && kind == TURBO64) return bits == 4 ? score_turbo_vnni<TURBO64, 4> : score_turbo_vnni<TURBO64, 3>;
    if (kind == Q8_0) return score_vnni<Q8_0>;
    if (kind == Q4_0) return score_vnni<Q4_0>;
    if (kind == TBQ4_0) return score_vnni<TBQ4_0>;
    if (kind == TURBO) return pick_bits<TurboScorePick, TURBO>(bits);
    if (kind == TURBO64) return pick_bits<TurboScorePick, TURBO64>(bits);
  }
  return pick<ScorePick>(kind, bits);
}

// The accumulate kernel of a V kind, chosen as pick_score chooses: accumulate_plain512 (plain values),
// accumulate_int512 (integer values), accumulate_turbo512 (turbo), accumulate4.
inline AccFn pick_acc(int64_t kind, int64_t bits) {
  if (att_vnni()) {
    if (kind == F32) return accumulate_plain512<F32>;
    if (kind == F16) return accumulate_plain512<F16>;
    if (kind == BF16) return accumulate_plain512<BF16>;
    if (kind == Q8_0) return accumulate_int512<Q8_0>;
    if (kind == Q4_0) return accumulate_int512<Q4_0>;
    if (kind == TBQ4_0) return accumulate_int512<TBQ4_0>;
    if (kind == TURBO) return pick_bits<TurboAccPick, TURBO>(bits);
    if (kind == TURBO64) return pick_bits<TurboAccPick, TURBO64>(bits);
  }
  return pick<AccPick>(kind, bits);
}

// One row of a source decoded to float32 [width]: plain values, or per block scale * (raw - OFFSET) (turbo: norm *
// centroid, in the rotated domain) -- the float32 operations of the formats' torch decoders, so the same values.
template <int64_t KIND, int BITS>
void decode_row(const Source& s, const Row& row, float* out) {
  constexpr int64_t H = pair_dist<KIND>(), SPAN = span_chunks<KIND>();
  constexpr float OFF = raw_offset<KIND>();
  const int64_t chunks = s.width / 8, span = SPAN ? SPAN : chunks;
  for (int64_t b0 = 0; b0 < chunks; b0 += span) {
    const __m256 d = _mm256_set1_ps(SPAN ? block_scale(row, b0 / span) : 1.0f);
    for_pairs<H>(b0, b0 + span, [&](int64_t c, bool paired) {
      if (!paired) {  // plain rows only
        _mm256_storeu_ps(out + 8 * c, plain8<SPAN ? F32 : KIND>(row, c));
        return;
      }
      __m256 x0, x1;
      dec_pair<KIND, BITS>(s, row, c, x0, x1);
      if constexpr (SPAN != 0) {
        if constexpr (OFF != 0.0f) {
          x0 = _mm256_sub_ps(x0, _mm256_set1_ps(OFF));
          x1 = _mm256_sub_ps(x1, _mm256_set1_ps(OFF));
        }
        x0 = _mm256_mul_ps(d, x0);
        x1 = _mm256_mul_ps(d, x1);
      }
      _mm256_storeu_ps(out + 8 * c, x0);
      _mm256_storeu_ps(out + 8 * (c + H), x1);
    });
  }
}

using DecodeFn = void (*)(const Source&, const Row&, float*);
template <int64_t K, int B>
struct DecodePick { static constexpr DecodeFn fn = decode_row<K, B>; };

}  // namespace

namespace {

// One key block of a query row rounded to 8 bits, in place, with the float32 operations of the Python side's
// turbospec.kv.query_rounding.round_queries: scale = amax / 127, qi = rint(q * (127 / amax)), q <- qi * scale. Writes qi,
// scale and sum(qi); a zero block stays zero (scale 0), a non-finite one stays as it is (scale NaN: NaN scores).
inline void round_block(float* x, int64_t n, int8_t* qi, float* scale, int32_t* isum) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    finite = finite && std::isfinite(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  *isum = 0;
  std::fill(qi, qi + n, 0);
  if (!finite || amax == 0.0f) {
    *scale = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float inv = 127.0f / amax, s = amax / 127.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float v = std::nearbyint(x[j] * inv);
    qi[j] = static_cast<int8_t>(v);
    *isum += qi[j];
    x[j] = v * s;
  }
  *scale = s;
}

// The query rows of a call as the score kernels read them, group by group (QGroup): q [groups * 4, dk] (rounded in
// place for integer keys) and per (group, key block, row) the sums of q, and for integer keys the int8 rows, their
// scales and integer sums.
struct QTable {
  const float* q = nullptr;
  int64_t dk = 0, kblocks = 0;
  std::vector<float> qsum, scale;
  std::vector<int8_t> qi;
  std::vector<int32_t> isum;
  QGroup group(int64_t g) const {
    const int64_t e = g * kblocks * 4;
    if (kblocks == 0) return {q + g * 4 * dk, nullptr, nullptr, nullptr, nullptr};
    return {q + g * 4 * dk, qsum.data() + e, qi.data() + g * 4 * dk, scale.data() + e, isum.data() + e};
  }
};

// q [heads, rows4, dk] float32 (rows padded to groups of 4), rounded in place for integer keys.
QTable prepare_queries(float* q, int64_t heads, int64_t rows4, int64_t dk, int64_t k_kind, int64_t k_bits) {
  QTable t;
  t.q = q;
  t.dk = dk;
  const int64_t kb = query_block(k_kind, k_bits);
  if (kb == 0) return t;
  TORCH_CHECK(dk % kb == 0, "K width is not a multiple of its block");
  t.kblocks = dk / kb;
  const int64_t rows = heads * rows4, entries = rows / 4 * t.kblocks * 4;
  t.qsum.assign(entries, 0.0f);
  t.scale.assign(entries, 0.0f);
  t.isum.assign(entries, 0);
  t.qi.assign(rows * dk, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < t.kblocks; ++b) {
      const int64_t e = ((r / 4) * t.kblocks + b) * 4 + r % 4;
      float* x = q + r * dk + b * kb;
      round_block(x, kb, t.qi.data() + r * dk + b * kb, &t.scale[e], &t.isum[e]);
      float sum = 0.0f;
      for (int64_t j = 0; j < kb; ++j) sum += x[j];
      t.qsum[e] = sum;
    }
  return t;
}

// One tile of the flash-decoding split: scores of rows4 query rows (groups g0, g0 + 1, ... of qt) against positions
// [s0, s1) of head h, softmax partial m / l [rows4] and the unnormalized accumulator acc [rows4, Dv], zeroed here
// first (the callers' partials start unset: zeroed by the parallel task that fills them, not all at once on one
// thread). sc (rows4 * tile) and pn (4 * tile) are scratch.
// `keep` / `back0` (paged tree rows): the tile's position i lies back0 - i positions before the row's own; one
// fewer than 64 back is attended only where that bit of keep is set (~0: every position, the default).
inline void tile_partial(const Source& ks, const Source& vs, ScoreFn score, AccFn accumulate, int64_t h, int64_t s0,
                         int64_t s1, const QTable& qt, int64_t g0, int64_t rows4, int64_t tile, float* sc, float* pn,
                         float* m, float* l, float* acc, uint64_t keep = ~0ull, int64_t back0 = 0) {
  const int64_t len = s1 - s0, dv = vs.width;
  std::fill_n(m, rows4, 0.0f);
  std::fill_n(l, rows4, 0.0f);
  std::fill_n(acc, rows4 * dv, 0.0f);
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) score(ks, h, s0, s1, qt.group(g0 + r0 / 4), sc + r0 * tile, tile);
  // masked positions: no score before the max, no weight after the exponentials
  const int64_t mask_from = keep == ~0ull ? len : std::max<int64_t>(0, back0 - 63);
  auto masked = [&](int64_t i) { return i >= mask_from && !((keep >> (back0 - i)) & 1ull); };
  for (int64_t r = 0; r < rows4; ++r) {
    float* row = sc + r * tile;
    for (int64_t i = mask_from; i < len; ++i)
      if (masked(i)) row[i] = -std::numeric_limits<float>::infinity();
    // the row's max, 8 lanes at a time: _mm256_max_ps(x, m) keeps m when x is NaN, as std::max(m, x) does
    __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(row + j), m8);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float mx = lanes[0];
    for (int k = 1; k < 8; ++k) mx = std::max(mx, lanes[k]);
    for (; j < len; ++j) mx = std::max(mx, row[j]);
    if (mx == -std::numeric_limits<float>::infinity()) {  // every position masked: nothing from this tile
      std::fill(row, row + len, 0.0f);
      m[r] = mx;
      l[r] = 0.0f;
      continue;
    }
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
    if (mask_from < len) {  // masked weights to 0 (exp_nonpos clamps at e^-87), the sum again in the same order
      for (int64_t j = mask_from; j < len; ++j)
        if (masked(j)) row[j] = 0.0f;
      __m256 s8 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= len; j += 8) s8 = _mm256_add_ps(s8, _mm256_loadu_ps(row + j));
      sum = hsum(s8);
      for (; j < len; ++j) sum += row[j];
    }
    m[r] = mx;
    l[r] = sum;
  }
  for (int64_t r0 = 0; r0 < rows4; r0 += 4) accumulate(vs, h, s0, s1, sc + r0 * tile, tile, acc + r0 * dv, pn);
}

// Merges `tiles` partials (m, l [rows4], acc [rows4, Dv] each, `stride` floats apart for m/l and stride * Dv
// for acc) of row r, in tile order, into m_out / l_out / a_out (acc [Dv], unnormalized).
inline void merge_row(const float* pm, const float* pl, const float* pacc, int64_t tiles, int64_t stride, int64_t r,
                      int64_t dv, float* m_out, float* l_out, float* a_out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < tiles; ++j) mx = std::max(mx, pm[j * stride + r]);
  *l_out = 0.0f;
  std::fill(a_out, a_out + dv, 0.0f);
  *m_out = std::isfinite(mx) ? mx : -std::numeric_limits<float>::infinity();
  if (!std::isfinite(mx)) return;
  float sum = 0.0f;
  for (int64_t j = 0; j < tiles; ++j) {
    const float w = std::exp(pm[j * stride + r] - mx);
    sum += w * pl[j * stride + r];
    const float* pa = pacc + (j * stride + r) * dv;
    for (int64_t c = 0; c < dv; ++c) a_out[c] += w * pa[c];
  }
  *l_out = sum;
}

}  // namespace

// The attention of `rows` query rows per KV head over positions [start, end) of two sources, on raw buffers:
// q [KVH, rows, Dk] float32 (already scaled, rotated where K is rotated); writes m_out / l_out [KVH, rows] and
// acc_out [KVH, rows, Dv]: per row the max score, sum of exp(score - m) and sum of exp(score - m) * v.
void attend_core(const float* q, int64_t kvh, int64_t rows, int64_t dk, const Source& ks, int64_t k_kind,
                 int64_t k_bits, const Source& vs, int64_t v_kind, int64_t v_bits, int64_t start, int64_t end,
                 int64_t tile, float* mo, float* lo, float* ao) {
  const int64_t rows4 = (rows + 3) / 4 * 4;  // rows padded to groups of 4 (zero query rows, ignored)
  std::vector<float> qp4(kvh * rows4 * dk, 0.0f);
  for (int64_t h = 0; h < kvh; ++h)
    std::copy(q + h * rows * dk, q + (h + 1) * rows * dk, qp4.begin() + h * rows4 * dk);
  const ScoreFn score = pick_score(ks);
  const AccFn accumulate = pick_acc(v_kind, v_bits);
  const int64_t dv = vs.width;
  const int64_t n = std::max<int64_t>(0, end - start);
  tile = std::max<int64_t>(tile, 1);
  const int64_t tiles = (n + tile - 1) / tile;
  const int64_t tasks = kvh * tiles;
  Scratch pm(tasks * rows4), pl(tasks * rows4), pacc(tasks * rows4 * dv);  // each filled by its tile_partial
  const QTable qt = prepare_queries(qp4.data(), kvh, rows4, dk, k_kind, k_bits);
  const int64_t groups = rows4 / 4;

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    // flush denormals: tiny softmax weights times small values would otherwise hit the slow denormal path
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    std::vector<float> sc(rows4 * tile), pn(4 * tile);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / tiles, s0 = start + (task % tiles) * tile;
      const int64_t s1 = std::min(end, s0 + tile);
      tile_partial(ks, vs, score, accumulate, h, s0, s1, qt, h * groups, rows4, tile, sc.data(), pn.data(),
                   pm.data() + task * rows4, pl.data() + task * rows4, pacc.data() + task * rows4 * dv);
    }
    _mm_setcsr(csr);
  });

  for (int64_t h = 0; h < kvh; ++h)
    for (int64_t r = 0; r < rows; ++r)
      merge_row(pm.data() + h * tiles * rows4, pl.data() + h * tiles * rows4, pacc.data() + h * tiles * rows4 * dv,
                tiles, rows4, r, dv, mo + h * rows + r, lo + h * rows + r, ao + (h * rows + r) * dv);
}

// Paged attention for many sequences in one call: q float32 [S, KVH, R, Dk] (R query rows per KV head of each
// sequence: scaled, rotated where K is rotated); the fields hold positions of fixed-size blocks, [KVH, blocks *
// block, ...]; sequence s attends to its first lens[s] positions, which lie in blocks tables[s, 0..]. One tile per
// block, tiles of all sequences and heads in one parallel loop, each sequence's tiles merged in order: a row's
// result does not depend on the other sequences in the call, and with block = 256 it equals attend_partial's
// over the same positions stored contiguously. `masks` (int64 [S], optional; -1: none): sequence s attends to a
// position k < 64 places before its last one only where bit k of masks[s] is set (a draft tree's row: its
// ancestors among the tree's positions, which end at its own). Returns acc / l, [S, KVH, R, Dv] float32.
torch::Tensor attend_paged(torch::Tensor q, int64_t k_kind, int64_t k_bits, std::vector<torch::Tensor> k_fields,
                           torch::Tensor k_cent, int64_t v_kind, int64_t v_bits, int64_t v_width,
                           std::vector<torch::Tensor> v_fields, torch::Tensor v_cent, torch::Tensor tables,
                           torch::Tensor lens, int64_t block, c10::optional<torch::Tensor> masks) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 4, "q must be float32 [S, KVH, R, D]");
  TORCH_CHECK(tables.scalar_type() == torch::kInt && tables.dim() == 2 && tables.size(0) == q.size(0),
              "tables must be int32 [S, blocks]");
  TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.numel() == q.size(0), "lens must be int64 [S]");
  TORCH_CHECK(block >= 1, "block size must be >= 1");
  TORCH_CHECK(!masks.has_value() || (masks->scalar_type() == torch::kLong && masks->is_contiguous() &&
                                     masks->numel() == q.size(0)), "masks must be int64 [S]");
  const int64_t* mask = masks.has_value() ? masks->data_ptr<int64_t>() : nullptr;
  q = q.contiguous();
  tables = tables.contiguous();
  const int64_t ns = q.size(0), kvh = q.size(1), rows = q.size(2), dk = q.size(3);
  const Source ks = make_source(k_kind, k_bits, dk, k_fields, k_cent);
  const Source vs = make_source(v_kind, v_bits, v_width, v_fields, v_cent);
  const int64_t dv = vs.width, rows4 = (rows + 3) / 4 * 4, groups = rows4 / 4;
  const int64_t capacity = k_fields[0].size(1);
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  // tasks: (sequence, head, tile) in that order; first[s] = index of sequence s's first task
  std::vector<int64_t> first(ns + 1, 0), ntiles(ns);
  for (int64_t s = 0; s < ns; ++s) {
    TORCH_CHECK(len[s] >= 0 && len[s] <= tables.size(1) * block, "a sequence attends past its block table");
    ntiles[s] = (len[s] + block - 1) / block;
    for (int64_t j = 0; j < ntiles[s]; ++j)
      TORCH_CHECK(tab[s * tables.size(1) + j] >= 0 && (tab[s * tables.size(1) + j] + 1) * block <= capacity,
                  "block id out of range");
    first[s + 1] = first[s] + kvh * ntiles[s];
  }
  const int64_t tasks = first[ns];
  std::vector<float> qp4(ns * kvh * rows4 * dk, 0.0f);
  const float* qsrc = q.data_ptr<float>();
  for (int64_t sh = 0; sh < ns * kvh; ++sh)
    std::copy(qsrc + sh * rows * dk, qsrc + (sh + 1) * rows * dk, qp4.begin() + sh * rows4 * dk);
  const ScoreFn score = pick_score(ks);
  const AccFn accumulate = pick_acc(v_kind, v_bits);
  const QTable qt = prepare_queries(qp4.data(), ns * kvh, rows4, dk, k_kind, k_bits);
  Scratch pm(tasks * rows4), pl(tasks * rows4), pacc(tasks * rows4 * dv);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    std::vector<float> sc(rows4 * block), pn(4 * block);
    int64_t s = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
    for (int64_t task = t0; task < t1; ++task) {
      while (task >= first[s + 1]) ++s;
      const int64_t local = task - first[s], h = local / ntiles[s], j = local % ntiles[s];
      const int64_t p0 = static_cast<int64_t>(tab[s * tables.size(1) + j]) * block;
      const int64_t n = std::min(block, len[s] - j * block);
      const int64_t sh = s * kvh + h;
      tile_partial(ks, vs, score, accumulate, h, p0, p0 + n, qt, sh * groups, rows4, block, sc.data(), pn.data(),
                   pm.data() + task * rows4, pl.data() + task * rows4, pacc.data() + task * rows4 * dv,
                   mask ? static_cast<uint64_t>(mask[s]) : ~0ull, len[s] - 1 - j * block);
    }
    _mm_setcsr(csr);
  });
  auto out = torch::empty({ns, kvh, rows, dv}, torch::kFloat);
  float* o = out.data_ptr<float>();
  // (the merge is a few hundred operations per head: in the calling thread for a few sequences, where a parallel
  // region's fork and join cost more than the work)
  at::parallel_for(0, ns * kvh, 64, [&](int64_t a, int64_t b) {
    for (int64_t sh = a; sh < b; ++sh) {
      const int64_t s = sh / kvh, h = sh % kvh, t = first[s] + h * ntiles[s];
      for (int64_t r = 0; r < rows; ++r) {
        float m, l;
        float* dst = o + (sh * rows + r) * dv;
        merge_row(pm.data() + t * rows4, pl.data() + t * rows4, pacc.data() + t * rows4 * dv, ntiles[s], rows4, r, dv,
                  &m, &l, dst);
        (void)m;
        for (int64_t c = 0; c < dv; ++c) dst[c] = l > 0.0f ? dst[c] / l : 0.0f;
      }
    }
  });
  return out;
}

// q: float32 [KVH, R, Dk] (already scaled, rotated where K is rotated). Attends to positions [start, end) of
// the K/V sources (fields [KVH, T, ...]). Returns (m [KVH, R], l [KVH, R], acc [KVH, R, Dv]): per row the
// max score, sum of exp(score - m) and sum of exp(score - m) * v.
std::vector<torch::Tensor> attend_partial(torch::Tensor q, int64_t k_kind, int64_t k_bits,
                                          std::vector<torch::Tensor> k_fields, torch::Tensor k_cent,
                                          int64_t v_kind, int64_t v_bits, int64_t v_width,
                                          std::vector<torch::Tensor> v_fields, torch::Tensor v_cent,
                                          int64_t start, int64_t end, int64_t tile) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 3, "q must be float32 [KVH, R, D]");
  q = q.contiguous();
  const int64_t kvh = q.size(0), rows = q.size(1), dk = q.size(2);
  const Source ks = make_source(k_kind, k_bits, dk, k_fields, k_cent);
  const Source vs = make_source(v_kind, v_bits, v_width, v_fields, v_cent);
  auto m_out = torch::empty({kvh, rows}, torch::kFloat);
  auto l_out = torch::empty({kvh, rows}, torch::kFloat);
  auto acc_out = torch::empty({kvh, rows, v_width}, torch::kFloat);
  attend_core(q.data_ptr<float>(), kvh, rows, dk, ks, k_kind, k_bits, vs, v_kind, v_bits, start, end, tile,
              m_out.data_ptr<float>(), l_out.data_ptr<float>(), acc_out.data_ptr<float>());
  return {m_out, l_out, acc_out};
}

// Positions [start, end) of a (packed) K or V source (fields [heads, T, ...]) decoded to float32 [heads, end - start,
// width], the values of the format's torch decoder (rotated formats left rotated): the blocks of committed positions
// that a prompt chunk's rows read through torch's flash kernel.
torch::Tensor decode_rows(int64_t kind, int64_t bits, int64_t width, std::vector<torch::Tensor> fields,
                          torch::Tensor cent, int64_t start, int64_t end) {
  const Source s = make_source(kind, bits, width, fields, cent);
  TORCH_CHECK(0 <= start && start <= end && end <= fields[0].size(1), "positions out of range");
  const int64_t heads = fields[0].size(0), n = end - start;
  auto out = torch::empty({heads, n, width}, torch::kFloat);
  float* o = out.data_ptr<float>();
  const DecodeFn fn = pick<DecodePick>(kind, bits);
  at::parallel_for(0, heads * n, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) fn(s, row_of(s, i / n, start + i % n), o + i * width);
  });
  return out;
}

namespace {

int64_t plain_kind(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return F32;
    case torch::kHalf: return F16;
    case torch::kBFloat16: return BF16;
    default: TORCH_CHECK(false, "plain caches are float32, float16 or bfloat16");
  }
  return F32;
}

template <typename T, typename C>
void put_row(const T* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
}

template <typename T>
void put_row_any(const T* src, torch::Tensor& cache, int64_t h, int64_t pos, int64_t n) {
  switch (cache.scalar_type()) {
    case torch::kFloat: put_row(src, cache.data_ptr<float>() + h * cache.stride(0) + pos * cache.stride(1), n); break;
    case torch::kHalf: put_row(src, cache.data_ptr<at::Half>() + h * cache.stride(0) + pos * cache.stride(1), n); break;
    default: put_row(src, cache.data_ptr<at::BFloat16>() + h * cache.stride(0) + pos * cache.stride(1), n); break;
  }
}

constexpr int64_t TILE = 256;  // positions per tile of a decode step (as attend_partial's callers use)

// A field's bytes per position (the inner dims of a [heads, positions, ...] buffer).
inline int64_t row_bytes(const torch::Tensor& f) {
  return f.numel() / std::max<int64_t>(1, f.size(0) * f.size(1)) * f.element_size();
}

// The attention rows of a decode or verification step of n tokens whose K/V are already in the cache at
// [pos, pos + n): q float32 [n, nh, kw] (scaled; rotated where K is rotated), fields [KVH, T, ...] of any format
// (plain or packed, as make_source reads them). Row i equals the single-token step that decodes it: attend_core over
// [base, pos + i + 1) in tiles of TILE from `base` (a tree: parents[i] < i, -1 for the context; row i attends to
// [base, pos) and its ancestors, the positions its own step would see). Writes out float32 [n, nh, dv] (acc / l).
// The whole tiles below the step are the same for every token: computed once for all n x g rows (the cache read
// once, not n times); each token's last tile(s) on their own, merged in the single step's order.
void step_rows(const float* q, int64_t n, int64_t nh, int64_t nkv, int64_t kw, int64_t k_kind, int64_t k_bits,
               const std::vector<torch::Tensor>& k_fields, const torch::Tensor& k_cent, int64_t v_kind, int64_t v_bits,
               int64_t dv, const std::vector<torch::Tensor>& v_fields, const torch::Tensor& v_cent, int64_t pos,
               int64_t base, const std::vector<int64_t>& parents, float* out) {
  const int64_t g = nh / nkv;
  const Source ks = make_source(k_kind, k_bits, kw, k_fields, k_cent), vs = make_source(v_kind, v_bits, dv, v_fields, v_cent);
  const bool tree = !parents.empty();
  if (n == 1 && !tree) {  // decode: one call over [base, pos]
    std::vector<float> m(nh), l(nh), acc(nh * dv);
    attend_core(q, nkv, g, kw, ks, k_kind, k_bits, vs, v_kind, v_bits, base, pos + 1, TILE, m.data(), l.data(),
                acc.data());
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t j = 0; j < dv; ++j) out[h * dv + j] = acc[h * dv + j] / l[h];
    return;
  }
  std::vector<int64_t> depth(n, 0);
  for (int64_t i = 0; i < n && tree; ++i) {
    TORCH_CHECK(parents[i] < i, "tree rows must come after their parents");
    depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
  }
  auto end_of = [&](int64_t i) { return pos + (tree ? depth[i] : i) + 1; };  // keys of row i's single step
  const int64_t shared = base + ((tree ? pos : pos + 1) - base) / TILE * TILE, st = (shared - base) / TILE;
  const int64_t rows = n * g, rows4 = (rows + 3) / 4 * 4, g4 = (g + 3) / 4 * 4;
  // tree: row i's keys/values from `shared` on as its single step sees them (the context's tail, then its
  // ancestors root first), copied field by field into head i * nkv + h of scratch buffers
  std::vector<torch::Tensor> tail_kf, tail_vf;
  Source tail_k, tail_v;
  if (tree) {
    const int64_t ctx_tail = pos - shared;
    const int64_t len = ctx_tail + *std::max_element(depth.begin(), depth.end()) + 1;
    std::vector<int64_t> anc;
    for (const std::vector<torch::Tensor>* side : {&k_fields, &v_fields}) {
      std::vector<torch::Tensor>& dst_fields = side == &k_fields ? tail_kf : tail_vf;
      for (const torch::Tensor& src : *side) {
        const int64_t rb = row_bytes(src), es = src.element_size();
        torch::Tensor dst = torch::empty({n * nkv, len, rb}, torch::kByte);
        for (int64_t i = 0; i < n; ++i) {
          anc.clear();
          for (int64_t a = i; a >= 0; a = parents[a]) anc.push_back(pos + a);
          std::reverse(anc.begin(), anc.end());
          for (int64_t h = 0; h < nkv; ++h) {
            const char* from = static_cast<const char*>(src.data_ptr()) + h * src.stride(0) * es;
            char* to = static_cast<char*>(dst.data_ptr()) + (i * nkv + h) * len * rb;
            for (int64_t s = shared; s < pos; ++s) std::memcpy(to + (s - shared) * rb, from + s * src.stride(1) * es, rb);
            for (size_t d = 0; d < anc.size(); ++d)
              std::memcpy(to + (ctx_tail + d) * rb, from + anc[d] * src.stride(1) * es, rb);
          }
        }
        dst_fields.push_back(dst);
      }
    }
    tail_k = make_source(k_kind, k_bits, kw, tail_kf, k_cent);
    tail_v = make_source(v_kind, v_bits, dv, tail_vf, v_cent);
  }
  const ScoreFn score = pick_score(ks);
  const AccFn accumulate = pick_acc(v_kind, v_bits);
  // qa: the shared tiles' rows [nkv, rows4, kw] (row i * g + j: token i, query head j of the group); qt: each
  // token's own rows [nkv, n, g4, kw]
  std::vector<float> qa(nkv * rows4 * kw, 0.0f), qt(nkv * n * g4 * kw, 0.0f);
  for (int64_t h = 0; h < nkv; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = q + (i * nh + h * g) * kw;
      std::copy(src, src + g * kw, qa.begin() + (h * rows4 + i * g) * kw);
      std::copy(src, src + g * kw, qt.begin() + ((h * n + i) * g4) * kw);
    }
  const QTable tab_a = prepare_queries(qa.data(), nkv, rows4, kw, k_kind, k_bits);
  const QTable tab_t = prepare_queries(qt.data(), nkv * n, g4, kw, k_kind, k_bits);
  // tail tiles of token i: [shared, end_of(i)) in tiles of TILE (1 or 2)
  std::vector<int64_t> tail_first(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) tail_first[i + 1] = tail_first[i] + (end_of(i) - shared + TILE - 1) / TILE;
  const int64_t tails = tail_first[n];
  Scratch sm(nkv * st * rows4), sl(nkv * st * rows4), sa(nkv * st * rows4 * dv);  // each filled by its tile_partial
  Scratch tm(nkv * tails * g4), tl(nkv * tails * g4), ta(nkv * tails * g4 * dv);
  at::parallel_for(0, nkv * (st + tails), 1, [&](int64_t t0, int64_t t1) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ, as attend_core
    std::vector<float> scr(std::max(rows4, g4) * TILE), pn(4 * TILE);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / (st + tails), j = task % (st + tails);
      if (j < st) {
        const int64_t at = h * st + j;
        tile_partial(ks, vs, score, accumulate, h, base + j * TILE, base + (j + 1) * TILE, tab_a, h * (rows4 / 4),
                     rows4, TILE, scr.data(), pn.data(), sm.data() + at * rows4, sl.data() + at * rows4,
                     sa.data() + at * rows4 * dv);
      } else {
        const int64_t u = j - st;
        int64_t i = 0;
        while (tail_first[i + 1] <= u) ++i;
        const int64_t s0 = shared + (u - tail_first[i]) * TILE, s1 = std::min(end_of(i), s0 + TILE);
        const int64_t at = h * tails + u, off = tree ? shared : 0;  // tree tails are gathered from `shared` on
        tile_partial(tree ? tail_k : ks, tree ? tail_v : vs, score, accumulate, tree ? i * nkv + h : h, s0 - off,
                     s1 - off, tab_t, (h * n + i) * (g4 / 4), g4, TILE, scr.data(), pn.data(), tm.data() + at * g4,
                     tl.data() + at * g4, ta.data() + at * g4 * dv);
      }
    }
    _mm_setcsr(csr);
  });
  // merge each row's tiles in order: its partials gathered into one table, as attend_core merges them
  std::vector<float> pm, pl, pa, acc(dv);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t nt = st + tail_first[i + 1] - tail_first[i];
    pm.assign(nt, 0.0f);
    pl.assign(nt, 0.0f);
    pa.assign(nt * dv, 0.0f);
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t jg = 0; jg < g; ++jg) {
        for (int64_t t = 0; t < nt; ++t) {
          const float *m_src, *l_src, *a_src;
          if (t < st) {
            const int64_t idx = (h * st + t) * rows4 + i * g + jg;
            m_src = sm.data() + idx, l_src = sl.data() + idx, a_src = sa.data() + idx * dv;
          } else {
            const int64_t idx = (h * tails + tail_first[i] + t - st) * g4 + jg;
            m_src = tm.data() + idx, l_src = tl.data() + idx, a_src = ta.data() + idx * dv;
          }
          pm[t] = *m_src, pl[t] = *l_src;
          std::copy(a_src, a_src + dv, pa.begin() + t * dv);
        }
        float m, l;
        merge_row(pm.data(), pl.data(), pa.data(), nt, 1, 0, dv, &m, &l, acc.data());
        (void)m;
        float* o = out + (i * nh + h * g + jg) * dv;
        for (int64_t c = 0; c < dv; ++c) o[c] = acc[c] / l;
      }
  }
}

// decode_step's work on raw qkv rows [n, width] (T): each token's K/V written at pos + i, its attention rows
// returned as float32 [n - skip, nh * hd] (acc / l), not yet rounded to T. The first `skip` rows (causal rows only)
// only store their K/V: rows whose output nobody reads (an MTP drafter catching up on earlier positions).
template <typename T>
std::vector<float> qkv_attention(const T* qkv, int64_t n, int64_t width, torch::Tensor& kc, torch::Tensor& vc,
                               int64_t pos, int64_t nh, int64_t nkv, int64_t hd, bool gated, double scale,
                               const std::vector<int64_t>& parents, int64_t skip = 0) {
  const int64_t q_stride = gated ? 2 * hd : hd, q_width = nh * q_stride, m = n - skip;
  std::vector<float> q(m * nh * hd);
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = qkv + i * width;
    for (int64_t h = 0; h < nkv; ++h) {
      put_row_any(row + q_width + h * hd, kc, h, pos + i, hd);
      put_row_any(row + q_width + (nkv + h) * hd, vc, h, pos + i, hd);
    }
    if (i < skip) continue;
    for (int64_t h = 0; h < nh; ++h)  // token i's query heads, scaled
      for (int64_t c = 0; c < hd; ++c)
        q[((i - skip) * nh + h) * hd + c] = static_cast<float>(row[h * q_stride + c]) * sc;
  }
  static const torch::Tensor& none = *new torch::Tensor(torch::empty({0}));  // no centroids: plain fields (kept
  // for the process's life: no tensor destroyed at exit)
  std::vector<float> o(m * nh * hd);
  step_rows(q.data(), m, nh, nkv, hd, plain_kind(kc.scalar_type()), 0, {kc}, none, plain_kind(vc.scalar_type()), 0, hd,
            {vc}, none, pos + skip, 0, parents, o.data());
  return o;
}

template <typename T>
torch::Tensor decode_step_t(const torch::Tensor& qkv, torch::Tensor& kc, torch::Tensor& vc, int64_t pos, int64_t nh,
                            int64_t nkv, int64_t hd, bool gated, double scale, const std::vector<int64_t>& parents) {
  const int64_t n = qkv.size(0);
  const std::vector<float> o = qkv_attention<T>(qkv.data_ptr<T>(), n, qkv.size(1), kc, vc, pos, nh, nkv, hd, gated,
                                              scale, parents);
  auto out = torch::empty({n, nh * hd}, qkv.options());
  T* op = out.data_ptr<T>();
  for (int64_t j = 0; j < n * nh * hd; ++j) op[j] = static_cast<T>(o[j]);
  return out;
}

}  // namespace

// decode_step's shape checks for n qkv rows of `width` values.
void check_decode(int64_t n, int64_t width, const torch::Tensor& kc, const torch::Tensor& vc, int64_t pos, int64_t nh,
                  int64_t nkv, int64_t hd, bool gated, const std::vector<int64_t>& parents) {
  TORCH_CHECK(width == nh * hd * (gated ? 2 : 1) + 2 * nkv * hd && nh % nkv == 0, "qkv width mismatch");
  TORCH_CHECK(kc.dim() == 3 && kc.size(0) == nkv && kc.size(2) == hd && kc.stride(2) == 1 && pos + n <= kc.size(1),
              "bad K cache");
  TORCH_CHECK(vc.sizes() == kc.sizes() && vc.stride(2) == 1, "bad V cache");
  TORCH_CHECK(parents.empty() || static_cast<int64_t>(parents.size()) == n, "one parent per row");
}

// Causal attention of N new tokens over a plain cache (used by gemv.cpp's layer_decode): k/v are read from the
// fused qkv rows [N, W] (per head [q | gate] when gated), written at [pos, pos + N) of the layer's caches
// [KVH, L, D], and token i attends to positions [0, pos + i]. Returns [N, H*D] in qkv's dtype; each row equals a
// single-token step at its position, so verifying a chain gives the logits of decoding it token by token. With
// `parents` (a draft tree: parents[i] < i, -1 for the context) row i attends to [0, pos) and its ancestors, and
// equals the single-token step that decodes its branch.
torch::Tensor decode_step(torch::Tensor qkv, torch::Tensor kc, torch::Tensor vc, int64_t pos, int64_t nh, int64_t nkv,
                          int64_t hd, bool gated, double scale, const std::vector<int64_t>& parents = {}) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be contiguous [N, W]");
  check_decode(qkv.size(0), qkv.size(1), kc, vc, pos, nh, nkv, hd, gated, parents);
  switch (qkv.scalar_type()) {
    case torch::kFloat: return decode_step_t<float>(qkv, kc, vc, pos, nh, nkv, hd, gated, scale, parents);
    case torch::kBFloat16: return decode_step_t<at::BFloat16>(qkv, kc, vc, pos, nh, nkv, hd, gated, scale, parents);
    case torch::kHalf: return decode_step_t<at::Half>(qkv, kc, vc, pos, nh, nkv, hd, gated, scale, parents);
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

#ifndef TURBOSPEC_EMBED_ATTENTION  // gemv.cpp includes this file for its one-call decoder layer
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_partial", &attend_partial, "partial softmax attention over a (packed) KV cache");
  m.def("attend_paged", &attend_paged, "attention of many sequences over a paged (packed) KV cache");
  m.def("decode_rows", &decode_rows, "positions of a (packed) KV source decoded to float32");
}
#endif
