// bf16 weights times bf16-valued rows with AVX-512 BF16 dot products (vdpbf16ps: 32 products per instruction,
// accumulated in float32), for CPUs that have them (Cooper Lake, Sapphire Rapids, Zen 4 and later), used for more
// than 16 rows (continuous batching): the AVX2 path converts every weight to float32 and does 8 products per
// instruction, ~1.2 ms per row of the benchmark model from 4 rows on; this one ~0.3-0.5 ms per row at 32-64 rows.
// (One row streams slower here than through the AVX2 path, measured: that path keeps decode and verification.)
// Every output (o, r) is the same chain of instructions whatever the number of rows in the call: acc = 0, one
// vdpbf16ps per 32 values in order, then a fixed reduction (reduce16 for a tile of 4 weight rows x 4 input rows,
// reduce4 for 4 weight rows, each pairing the lanes as _mm512_reduce_add_ps does); so a row's result does not
// depend on its batch.
// Included by gemv.cpp (after quant.cpp, for use_avx512).

namespace bf16dot {

#define TS_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline bool available() {
  static const bool yes = packed::use_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// The lane sums of 16 vectors v[4q + r] (a tile's 4 weight rows q x 4 input rows r), each added as
// _mm512_reduce_add_ps adds its lanes (halves, quarters, then (0 + 2) + (1 + 3); float addition commutes exactly),
// in 45 full-width operations instead of four reduce4's 88 narrower ones: lane group r (4 floats) of the result
// holds input row r's 4 sums. (With `pack`: 1-4% faster per 32-row product of 512 or 1536 inputs, one thread.)
TS_BF16 inline __m512 reduce16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)  // v[2k]'s and v[2k+1]'s halves added: [v[2k] lo + hi | v[2k+1] lo + hi]
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // quarters: group g of d[j] is v[4j + g]'s 4 partial sums
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // (0 + 2) and (1 + 3) within each group
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// NO weight rows x NR input rows over `in` values (full 32-value chunks, then a masked tail). x holds the NR rows
// chunk by chunk (`pack`): chunk c of row r at x + (c * NR + r) * 32.
// While the tile runs, pf_step bytes per chunk of a later block of weight rows are prefetched from pf (the
// hardware prefetcher alone leaves a one-row product at half the copy bandwidth, as in gemv.cpp's run).
template <int NO, int NR>
TS_BF16 inline void tile(const uint16_t* w, const uint16_t* x, int64_t in, int64_t full, __mmask32 tail,
                         float* y, int64_t out, const char* pf, int64_t pf_step) {
  __m512 acc[NO][NR];
  for (int q = 0; q < NO; ++q)
    for (int r = 0; r < NR; ++r) acc[q][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 32) {
    const char* pp = pf + (i / 32) * pf_step;
    prefetch_l2(pp, pf_step);
    __m512bh wv[NO];
    for (int q = 0; q < NO; ++q) wv[q] = (__m512bh)_mm512_loadu_si512(w + q * in + i);
    for (int r = 0; r < NR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (i / 32 * NR + r) * 32);
      for (int q = 0; q < NO; ++q) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], wv[q], xv);
    }
  }
  if (tail) {
    __m512bh wv[NO];
    for (int q = 0; q < NO; ++q) wv[q] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + q * in + full);
    for (int r = 0; r < NR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (full / 32 * NR + r) * 32);
      for (int q = 0; q < NO; ++q) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], wv[q], xv);
    }
  }
  if constexpr (NO == 4 && NR == 4) {  // all 16 sums at once (reduce16), then each input row's 4
    const __m512 s = reduce16(&acc[0][0]);
    _mm_storeu_ps(y, _mm512_castps512_ps128(s));
    _mm_storeu_ps(y + out, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(y + 2 * out, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(y + 3 * out, _mm512_extractf32x4_ps(s, 3));
  } else if constexpr (NO == 4) {  // the 4 sums of a row in one pass, paired as _mm512_reduce_add_ps pairs them
    for (int r = 0; r < NR; ++r) {
      const __m512 a[4] = {acc[0][r], acc[1][r], acc[2][r], acc[3][r]};
      _mm_storeu_ps(y + r * out, packed::reduce4(a));
    }
  } else {
    for (int q = 0; q < NO; ++q)
      for (int r = 0; r < NR; ++r) y[r * out + q] = _mm512_reduce_add_ps(acc[q][r]);
  }
}

// All m rows against NO weight rows, 4 input rows per pass; each pass prefetches its share of the block at pf.
template <int NO>
TS_BF16 inline void rows(const uint16_t* w, const uint16_t* x, int64_t m, int64_t in, int64_t full, __mmask32 tail,
                         float* y, int64_t out, const char* pf) {
  const int64_t passes = (m + 3) / 4, chunks = std::max<int64_t>(1, full / 32), row = (in + 31) / 32 * 32;
  const int64_t share = NO * in * 2 / passes, step = (share / chunks + 63) / 64 * 64;
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile<NO, 4>(w, x + r * row, in, full, tail, y + r * out, out, pf + (r / 4) * share, step);
  const char* p = pf + (r / 4) * share;
  switch (m - r) {
    case 3: tile<NO, 3>(w, x + r * row, in, full, tail, y + r * out, out, p, step); break;
    case 2: tile<NO, 2>(w, x + r * row, in, full, tail, y + r * out, out, p, step); break;
    case 1: tile<NO, 1>(w, x + r * row, in, full, tail, y + r * out, out, p, step); break;
    default: break;
  }
}

// y[m, out] = x[m, in] . W^T for bf16 W [out, in] and x given as bf16 bits by `pack`: blocks of 4 weight rows in
// parallel, each against all m rows in 4 x 4 tiles.
TS_BF16 void run(const uint16_t* w, const uint16_t* x, float* y, int64_t m, int64_t in, int64_t out) {
  const int64_t full = in / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (in - full)) - 1);
  const int64_t nblk = (out + 3) / 4, blk_bytes = 4 * in * 2;
  const int64_t ahead = std::max<int64_t>(1, (2 * PREFETCH_BYTES + blk_bytes - 1) / blk_bytes);
  at::parallel_for(0, nblk, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o = b * 4;
      const uint16_t* wb = w + o * in;
      const char* pf = reinterpret_cast<const char*>(w + std::max<int64_t>(0, std::min(o + 4 * ahead, out - 4)) * in);
      switch (std::min<int64_t>(4, out - o)) {
        case 4: rows<4>(wb, x, m, in, full, tail, y + o, out, pf); break;
        case 3: rows<3>(wb, x, m, in, full, tail, y + o, out, pf); break;
        case 2: rows<2>(wb, x, m, in, full, tail, y + o, out, pf); break;
        default: rows<1>(wb, x, m, in, full, tail, y + o, out, pf); break;
      }
    }
  });
}

// float32 rows x [m, in] (bf16 values: the fused layers round their products' inputs to the model dtype) as bf16
// bits (rounded to nearest even: exact for bf16 values), laid out as the tiles read them: the rows in groups of 4
// (the last group the m % 4 left), each group chunk by chunk (32 values of its first row, of its second, ...), so a
// tile reads its rows' values in one stream. Row r's group starts at r * ceil(in / 32) * 32; a last chunk's values
// past `in` are zeros (the tiles load no further than `in`).
TS_BF16 inline std::vector<uint16_t> pack(const float* x, int64_t m, int64_t in) {
  const int64_t nc = (in + 31) / 32;
  std::vector<uint16_t> out(m * nc * 32);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = r / 4 * 4, nr = std::min<int64_t>(4, m - g);
    uint16_t* dst = out.data() + g * nc * 32 + (r - g) * 32;
    const float* src = x + r * in;
    for (int64_t c = 0; c < nc; ++c, dst += nr * 32) {
      const int64_t i = c * 32, n = std::min<int64_t>(32, in - i);
      for (int64_t h = 0; h < n; h += 16) {
        const __mmask16 k = static_cast<__mmask16>(n - h >= 16 ? 0xffff : (1u << (n - h)) - 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + i + h)));
      }
    }
  }
  return out;
}

}  // namespace bf16dot
