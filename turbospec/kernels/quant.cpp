// Packed ggml weight blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) multiplied without unpacking the matrix (included by
// gemv.cpp).
//
// A packed weight is a uint8 tensor [out, blocks per row, block bytes], each row the blocks of one output row in
// ggml's layout; the block size names the format (34: Q8_0, 18: Q4_0, 144: Q4_K, 176: Q5_K, 210: Q6_K; 1088 / 576 /
// 1152 / 1408 / 1680: the same with 8 rows interleaved, made at load, see `interleave_`). Products for
// few rows quantize the input rows to int8 (per 32 values for Q8_0 / Q4_0, per 256 for the K formats, as
// llama.cpp's Q8_0 / Q8_K) and sum
// int8 x int8 / uint4 x int8 products in int32 (maddubs), scaling once per block in float32: a row's result
// depends on that row alone, so a batch's rows equal the same rows multiplied one at a time. Larger inputs
// (prefill) dequantize tiles of weight rows to float32 and use torch's GEMM, but where the int8 kernels are the
// faster ones at any row count (`int8_rows_any`). `dequantize_packed` equals the gguf
// package's dequantization bit for bit (no fused multiply-add where it multiplies then subtracts).

namespace packed {

enum class Fmt { Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0X8, Q4_0X8, Q4_KX8, Q5_KX8, Q6_KX8 };

inline bool is_packed(const torch::Tensor& w) { return w.scalar_type() == torch::kByte && w.dim() == 3; }

inline Fmt fmt_of(const torch::Tensor& w) {
  switch (w.size(2)) {
    case 34: return Fmt::Q8_0;
    case 18: return Fmt::Q4_0;
    case 144: return Fmt::Q4_K;
    case 176: return Fmt::Q5_K;
    case 210: return Fmt::Q6_K;
    case 576: return Fmt::Q4_0X8;
    case 1088: return Fmt::Q8_0X8;
    case 1152: return Fmt::Q4_KX8;
    case 1408: return Fmt::Q5_KX8;
    case 1680: return Fmt::Q6_KX8;
    default: TORCH_CHECK(false, "packed weight: unknown block size ", w.size(2));
  }
  return Fmt::Q8_0;
}

inline int64_t block_values(Fmt f) {
  return f == Fmt::Q8_0 || f == Fmt::Q4_0 ? 32 : f == Fmt::Q8_0X8 || f == Fmt::Q4_0X8 ? 128 : 256;
}

inline bool interleaved(Fmt f) {
  return f == Fmt::Q8_0X8 || f == Fmt::Q4_0X8 || f == Fmt::Q4_KX8 || f == Fmt::Q5_KX8 || f == Fmt::Q6_KX8;
}

// The format of an interleaved format's rows (Q4_0X8 -> Q4_0, ...); any other format itself.
inline Fmt row_fmt(Fmt f) {
  switch (f) {
    case Fmt::Q8_0X8: return Fmt::Q8_0;
    case Fmt::Q4_0X8: return Fmt::Q4_0;
    case Fmt::Q4_KX8: return Fmt::Q4_K;
    case Fmt::Q5_KX8: return Fmt::Q5_K;
    case Fmt::Q6_KX8: return Fmt::Q6_K;
    default: return f;
  }
}

// Weight rows per row of the tensor: 8 for the interleaved formats ([out / 8, blocks, bytes]), else 1.
inline int64_t rows_per(Fmt f) { return interleaved(f) ? 8 : 1; }

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One input row quantized to int8: q[in], one float scale per `qk` values, and the sum of q per 32 values.
struct QRow {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum32;
  std::vector<int16_t> sum16;  // the same sums as int16 (|sum| <= 32 * 127)
  std::vector<int16_t> half16;  // the sum of each 16 q (Q6_K's 16-value scales)
  std::vector<int8_t> qp;      // on AVX-512: q reordered as the nibbles unpack (q4_0_layout, q4_k_layout)
  std::vector<int32_t> off;    // ... and -8 x the input sum of each product lane
  std::vector<int32_t> off8;   // Q8_0 on AVX-512: -128 x the sum of each 4 q (q8_0_layout)
};

// The AVX-512 Q4_0 input layout of a quantized row (rows_q4_0_avx512), for whole groups of 8 blocks: per 4
// blocks, values 0..15 of each block, then values 16..31 of each (as the nibbles unpack), and per 4-byte lane of
// those 128 bytes -8 x the lane's input sum (low and high part), the weights' q - 8.
inline void q4_0_layout(QRow& r, int64_t in) {
  const int64_t groups = in / 256;
  r.qp.assign(groups * 256, 0);
  r.off.assign(groups * 64, 0);
  for (int64_t h = 0; h < groups * 2; ++h) {  // 4-block halves
    int8_t* dst = &r.qp[h * 128];
    for (int k = 0; k < 4; ++k) {
      std::memcpy(dst + 16 * k, &r.q[(4 * h + k) * 32], 16);
      std::memcpy(dst + 64 + 16 * k, &r.q[(4 * h + k) * 32 + 16], 16);
    }
    for (int lane = 0; lane < 16; ++lane) {
      int32_t t = 0;
      for (int i = 0; i < 4; ++i) t += dst[4 * lane + i] + dst[64 + 4 * lane + i];
      r.off[h * 16 + lane] = -8 * t;
    }
  }
}

// The AVX-512 Q8_0 input offsets (rows_q8_0_avx512): per 4 values, -128 x their sum (the weights go in + 128).
inline void q8_0_layout(QRow& r, int64_t in) {
  r.off8.resize(in / 4);
  for (int64_t i = 0; i < in / 4; ++i) r.off8[i] = -128 * (r.q[4 * i] + r.q[4 * i + 1] + r.q[4 * i + 2] + r.q[4 * i + 3]);
}

// The AVX-512 Q4_K input layout (rows_q4k_avx512): in each 128 values, the 32-value sub-blocks in the order 0, 2,
// 1, 3 (a 64-byte load of the weights holds sub-blocks 0 and 2 in its low nibbles, 1 and 3 in its high ones).
inline void q4_k_layout(QRow& r, int64_t in) {
  r.qp.resize(in);
  static constexpr int order[4] = {0, 2, 1, 3};
  for (int64_t c = 0; c < in; c += 128)
    for (int k = 0; k < 4; ++k) std::memcpy(&r.qp[c + 32 * k], &r.q[c + 32 * order[k]], 32);
}

inline int32_t hsum_i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline int32_t hsum4(__m128i s) {
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline __m128i load_sums(const int16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// x (in values) -> int8 q with one scale per `qk` values (amax / 127, round to nearest even: llama.cpp's
// Q8_0 / Q8_K rounding), and the int sum of each 32 q.
inline void quantize_row(const float* x, int64_t in, int64_t qk, QRow& r) {
  r.q.resize(in);
  r.d.resize(in / qk);
  r.sum32.resize(in / 32);
  r.sum16.resize(in / 32);
  r.half16.resize(in / 16);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < in / qk; ++b) {
    const float* xb = x + b * qk;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < qk; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    const float amax = hmax8(mx), d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    r.d[b] = d;
    const __m256 idv = _mm256_set1_ps(id);
    for (int64_t i = 0; i < qk; i += 32) {
      __m256i v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), idv));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&r.q[b * qk + i]), packed);
      const int32_t t = hsum_i(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
      r.sum32[(b * qk + i) / 32] = t;
      r.sum16[(b * qk + i) / 32] = static_cast<int16_t>(t);
      r.half16[(b * qk + i) / 16] = static_cast<int16_t>(hsum_i(_mm256_add_epi32(v[0], v[1])));
      r.half16[(b * qk + i) / 16 + 1] = static_cast<int16_t>(hsum_i(_mm256_add_epi32(v[2], v[3])));
    }
  }
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 int32 lanes summing u[i] * s[i] (u unsigned bytes, s signed bytes, |u * s| pairs within int16).
inline __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// 32 4-bit values of 16 bytes: low nibbles then high nibbles (Q4_0's element order).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

inline void unpack_scales(const uint8_t* s, uint32_t u[4]);

// Q6_K: the 4 x 32 six-bit values (0..63) of one 128-value half from its 64 low-nibble bytes and 32 high-bit bytes,
// in value order (ggml's layout: values 0..31 low nibbles of ql[0..32) + bits 0-1 of qh, 32..63 low nibbles of
// ql[32..64) + bits 2-3, 64..95 high nibbles of ql[0..32) + bits 4-5, 96..127 high nibbles of ql[32..64) + bits 6-7).
inline void q6_unpack(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const auto hi = [&](int shift) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift), m2), 4);
  };
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), hi(0));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), hi(2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hi(4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hi(6));
}

// Lane k of the result = the sum of the 8 lanes of v[k].
inline __m256i sum_lanes8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// Bit `bit` (0..7) of each byte of h moved to bit 4, the other bits 0 (Q5_K's fifth bits; a 16-bit shift's
// spill from the neighbouring byte never reaches bit 4).
inline __m256i bit_at4(__m256i h, int bit) {
  const __m256i at = bit <= 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
  return _mm256_and_si256(at, _mm256_set1_epi8(16));
}

// int32 products of one Q8_0 / Q4_0 block (at w) with 32 int8 inputs; Q4_0's are of q (0..15), its -8 comes later.
template <Fmt F>
inline __m256i block_int(const uint8_t* w, const int8_t* x) {
  if constexpr (F == Fmt::Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    return dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(load32(x), q));
  } else {
    return dot_us(nibbles(w + 2), load32(x));
  }
}

// t plus the products of blocks [b, nb) of a Q8_0 / Q4_0 row with input row x, one block at a time (the blocks
// after a row's last whole group of 8).
template <Fmt F>
inline float tail_blocks(const uint8_t* w, int64_t b, int64_t nb, const QRow* x, float t) {
  constexpr int64_t BB = F == Fmt::Q8_0 ? 34 : 18;
  for (; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    const int32_t off = F == Fmt::Q4_0 ? 8 * x->sum32[b] : 0;
    t += f16(blk) * x->d[b] * static_cast<float>(hsum_i(block_int<F>(blk, &x->q[b * 32])) - off);
  }
  return t;
}

// out[j] = w_row . x_j for j < nx (1 or 2) input rows; w_row holds `nb` blocks. Q8_0 / Q4_0 go 8 blocks at a
// time: the 8 blocks' int32 sums in one vector, scaled by the 8 products of scales in one multiply-add.
template <Fmt F>
void row_dot(const uint8_t* w, int64_t nb, const QRow* x0, const QRow* x1, int nx, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float c0 = 0.f, c1 = 0.f;  // terms outside the int8 products (Q4_K's mins)
  if constexpr (F == Fmt::Q8_0 || F == Fmt::Q4_0) {
    constexpr int64_t BB = F == Fmt::Q8_0 ? 34 : 18;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      __m256i s0[8], s1[8];
      alignas(16) uint16_t dh[8];
      for (int k = 0; k < 8; ++k) {
        const uint8_t* blk = w + (b + k) * BB;
        std::memcpy(&dh[k], blk, 2);
        s0[k] = block_int<F>(blk, &x0->q[(b + k) * 32]);
        if (nx > 1) s1[k] = block_int<F>(blk, &x1->q[(b + k) * 32]);
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
      __m256i i0 = sum_lanes8(s0);
      if constexpr (F == Fmt::Q4_0)  // q - 8: subtract 8 x the block's input sum
        i0 = _mm256_sub_epi32(i0, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x0->sum32[b])), 3));
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(dw, _mm256_loadu_ps(&x0->d[b])), acc0);
      if (nx > 1) {
        __m256i i1 = sum_lanes8(s1);
        if constexpr (F == Fmt::Q4_0)
          i1 = _mm256_sub_epi32(i1, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x1->sum32[b])), 3));
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(dw, _mm256_loadu_ps(&x1->d[b])), acc1);
      }
    }
    c0 = -tail_blocks<F>(w, b, nb, x0, 0.f);
    if (nx > 1) c1 = -tail_blocks<F>(w, b, nb, x1, 0.f);
  } else if constexpr (F == Fmt::Q6_K) {  // 256 values: weight d * sc_j * (q - 32), 16 values per int8 scale
    float t0 = 0.f, t1 = 0.f;
    for (int64_t b = 0; b < nb; ++b, w += 210) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      const float d = f16(w + 208);
      __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i q[4];
        q6_unpack(w + 64 * h, w + 128 + 32 * h, q);
        for (int g = 0; g < 4; ++g) {
          const int v0 = 128 * h + 32 * g;
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[v0 / 16 + 1]), _mm_set1_epi16(sc[v0 / 16]));
          i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], load32(&x0->q[b * 256 + v0])), s));
          if (nx > 1)
            i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], load32(&x1->q[b * 256 + v0])), s));
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      const auto half = [&](const QRow* x) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x->half16[b * 16]));
      };
      t0 += d * x0->d[b] * static_cast<float>(hsum_i(i0) - 32 * hsum_i(_mm256_madd_epi16(sc16, half(x0))));
      if (nx > 1)
        t1 += d * x1->d[b] * static_cast<float>(hsum_i(i1) - 32 * hsum_i(_mm256_madd_epi16(sc16, half(x1))));
    }
    c0 = -t0;
    c1 = -t1;
  } else {  // Q4_K / Q5_K: 256 values = 8 sub-blocks of 32, weight d * sc_j * q - dmin * m_j
    constexpr bool Q5 = F == Fmt::Q5_K;  // q's fifth bit: bit j of qh[value % 32] for sub-block j
    constexpr int64_t BB = Q5 ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b, w += BB) {
      const float d = f16(w), dmin = f16(w + 2);
      uint32_t u[4];
      unpack_scales(w + 4, u);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(u);
      const uint8_t* qs = w + (Q5 ? 48 : 16);
      const __m256i qh = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : low;
      __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {  // 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high ones
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (Q5) {
          lo = _mm256_or_si256(lo, bit_at4(qh, 2 * j));
          hi = _mm256_or_si256(hi, bit_at4(qh, 2 * j + 1));
        }
        const __m256i s_lo = _mm256_set1_epi16(sc[2 * j]), s_hi = _mm256_set1_epi16(sc[2 * j + 1]);
        const int8_t* q0 = &x0->q[b * 256 + 64 * j];
        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(q0)), s_lo));
        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(q0 + 32)), s_hi));
        if (nx > 1) {
          const int8_t* q1 = &x1->q[b * 256 + 64 * j];
          i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(q1)), s_lo));
          i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(q1 + 32)), s_hi));
        }
      }
      const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)));
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d * x0->d[b]), acc0);
      c0 += dmin * x0->d[b] * static_cast<float>(hsum4(_mm_madd_epi16(mins, load_sums(&x0->sum16[b * 8]))));
      if (nx > 1) {
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d * x1->d[b]), acc1);
        c1 += dmin * x1->d[b] * static_cast<float>(hsum4(_mm_madd_epi16(mins, load_sums(&x1->sum16[b * 8]))));
      }
    }
  }
  out[0] = hsum(acc0) - c0;
  if (nx > 1) out[1] = hsum(acc1) - c1;
}

// Q4_K's 12 scale bytes unpacked: bytes 0..7 of u the 6-bit scales, 8..15 the mins (as scale_min).
inline void unpack_scales(const uint8_t* s, uint32_t u[4]) {
  std::memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  u[2] = mins_lo;
  u[0] &= 0x3f3f3f3fu;
}

// The AVX-512 kernels below take R weight rows (R = 4, or 1 for the last rows of a range) at a time against NX (1
// or 2) input rows: the input's loads and the constants are shared by the R rows and the accumulators stay in
// registers. Each (weight row, input row) pair's arithmetic is the same whatever R and NX are, so a row's result
// does not depend on the rows beside it.
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define TS_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni")))

// The lane sums of 4 vectors, each added exactly as _mm512_reduce_add_ps adds its lanes (the same pairs in the same
// order: halves, quarters, then (0 + 2) + (1 + 3)), in one pass.
__attribute__((target("avx512f"))) inline __m128 reduce4(const __m512* a) {
  __m128 q[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)),
                                   _mm512_castps512_ps256(a[i]));
    q[i] = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  }
  const __m128 p = _mm_add_ps(_mm_movelh_ps(q[0], q[1]), _mm_movehl_ps(q[1], q[0]));
  const __m128 s = _mm_add_ps(_mm_movelh_ps(q[2], q[3]), _mm_movehl_ps(q[3], q[2]));
  return _mm_hadd_ps(p, s);
}

// t[r * NX + j] = the lane sum of acc[r][j] (reduce4 for R = 4).
template <int R, int NX>
TS_AVX512 inline void reduce_all(const __m512 (&acc)[R][NX], float* t) {
  if constexpr (R == 4) {
    for (int j = 0; j < NX; ++j) {
      const __m512 a[4] = {acc[0][j], acc[1][j], acc[2][j], acc[3][j]};
      alignas(16) float s[4];
      _mm_store_ps(s, reduce4(a));
      for (int r = 0; r < 4; ++r) t[r * NX + j] = s[r];
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NX; ++j) t[r * NX + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

// out[r * NX + j] = the lane sum of acc[r][j] plus row r's products with input row j over blocks [b, nb) (the blocks
// after the last whole group of 8, one at a time): the end of the Q8_0 / Q4_0 kernels.
template <Fmt F, int R, int NX>
TS_AVX512 inline void finish_rows(const __m512 (&acc)[R][NX], const uint8_t* w, int64_t row_bytes, int64_t b,
                                  int64_t nb, const QRow* const* x, float* out) {
  reduce_all<R, NX>(acc, out);
  if (b < nb)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NX; ++j) out[r * NX + j] = tail_blocks<F>(w + r * row_bytes, b, nb, x[j], out[r * NX + j]);
}

struct Q4KLanes {
  alignas(64) int8_t b[4][64];
};

// Q4_K's 8 scales (bytes 0..7) and 8 mins (bytes 8..15) from a block's 12 scale bytes at s (unpack_scales in
// one vector; reads 16 bytes).
TS_AVX512 inline __m128i q4k_scales(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // dwords u0, u1, u2
  const __m128i p = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i lo = _mm_and_si128(p, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}

// Q4_K with AVX-512 (BW + VNNI): 64 values (two sub-blocks) per multiply, the scales applied by int16 dot products
// (the same integers as the AVX2 path; the float sums differ in order and, for the mins, in one fused
// multiply-add), against the input in q4_k_layout. Q5 (Q5_K: the same block with 32 bytes of fifth bits before the
// nibbles): each 64-byte vector of nibbles (sub-blocks 4h, 4h + 2 low, 4h + 1, 4h + 3 high) takes its fifth bits
// from the 32 qh bytes in both halves, shifted per half by a variable word shift.
template <int R, int NX, bool Q5 = false>
TS_AVX512 __attribute__((always_inline)) inline void rows_q4k_avx512(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, float* out) {
  const __m512i low = _mm512_set1_epi8(15), m10 = _mm512_set1_epi8(0x10);
  constexpr int64_t BB = Q5 ? 176 : 144;
  // the word shifts that bring bit s = 4h + k + 2 * half of each qh byte to bit 4 (nibble vector h, low / high
  // nibbles k, 32-byte half): left by 4 - s where s < 4, else right by s - 4
  __m512i shl[2][2], shr[2][2];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {
      const int s0 = 4 * h + k, s1 = s0 + 2;
      shl[h][k] = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(std::max(0, 4 - s0))),
                                     _mm256_set1_epi16(static_cast<int16_t>(std::max(0, 4 - s1))), 1);
      shr[h][k] = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(std::max(0, s0 - 4))),
                                     _mm256_set1_epi16(static_cast<int16_t>(std::max(0, s1 - 4))), 1);
    }
  // multiply k's int16 lanes 0..15 take sub-block A_k's scale, 16..31 B_k's: byte shuffles of the 8 scale bytes
  // (copied to every 16-byte lane), low byte the scale, high byte zero
  static const Q4KLanes ln = [] {
    static constexpr int A[4] = {0, 1, 4, 5}, B[4] = {2, 3, 6, 7};
    Q4KLanes t{};
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 32; ++i) {
        t.b[k][2 * i] = static_cast<int8_t>(i < 16 ? A[k] : B[k]);
        t.b[k][2 * i + 1] = -128;
      }
    return t;
  }();
  const int8_t* xq[NX];
  const float* xd[NX];
  const int16_t* xs[NX];
  for (int j = 0; j < NX; ++j) xq[j] = x[j]->qp.data(), xd[j] = x[j]->d.data(), xs[j] = x[j]->sum16.data();
  __m512 acc[R][NX];
  __m128 c[NX];  // lane r: row r's mins term
  for (int j = 0; j < NX; ++j) {
    c[j] = _mm_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m128i mt[NX][4];  // per row, the 4 int32 parts of its mins . input sums
    alignas(16) float dmin[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < NX; ++j)
      for (int r = 0; r < 4; ++r) mt[j][r] = _mm_setzero_si128();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // unrolled: the sums stay in registers
      const uint8_t* wb = w + r * row_bytes + b * BB;
      const float d = f16(wb);
      dmin[r] = f16(wb + 2);
      const __m128i sm = q4k_scales(wb + 4);
      const __m512i sc4 = _mm512_broadcast_i32x4(sm);
      const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
      const __m512i qh = Q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16))) : low;
      __m512i ii[NX];
      for (int j = 0; j < NX; ++j) ii[j] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // 64 bytes: sub-blocks 4h, 4h + 2 in the low nibbles, 4h + 1, 4h + 3 high
        const __m512i v = _mm512_loadu_si512(wb + (Q5 ? 48 : 16) + 64 * h);
        __m512i q[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
        if constexpr (Q5)  // vpternlogd 0xF8: a | (b & c)
          for (int k = 0; k < 2; ++k)
            q[k] = _mm512_ternarylogic_epi32(q[k], _mm512_srlv_epi16(_mm512_sllv_epi16(qh, shl[h][k]), shr[h][k]), m10, 0xF8);
        for (int k = 0; k < 2; ++k) {
          const __m512i s = _mm512_shuffle_epi8(sc4, _mm512_load_si512(ln.b[2 * h + k]));
          for (int j = 0; j < NX; ++j)
            ii[j] = _mm512_dpwssd_epi32(ii[j], _mm512_maddubs_epi16(q[k], _mm512_loadu_si512(xq[j] + b * 256 + 128 * h + 64 * k)), s);
        }
      }
      for (int j = 0; j < NX; ++j) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ii[j]), _mm512_set1_ps(d * xd[j][b]), acc[r][j]);
        mt[j][r] = _mm_madd_epi16(mins, load_sums(xs[j] + b * 8));
      }
    }
    const __m128 dm = _mm_load_ps(dmin);
    for (int j = 0; j < NX; ++j) {  // the R rows' sums in one vector, then c += dmin * xd * sum in every lane
      const __m128i t = _mm_hadd_epi32(_mm_hadd_epi32(mt[j][0], mt[j][1]), _mm_hadd_epi32(mt[j][2], mt[j][3]));
      c[j] = _mm_fmadd_ps(_mm_mul_ps(dm, _mm_set1_ps(xd[j][b])), _mm_cvtepi32_ps(t), c[j]);
    }
  }
  reduce_all<R, NX>(acc, out);
  for (int j = 0; j < NX; ++j) {
    alignas(16) float cs[4];
    _mm_store_ps(cs, c[j]);
    for (int r = 0; r < R; ++r) out[r * NX + j] -= cs[r];
  }
}

// Q5_K rows: rows_q4k_avx512 with the fifth bits.
template <int R, int NX>
TS_AVX512 __attribute__((always_inline)) inline void rows_q5k_avx512(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, float* out) {
  rows_q4k_avx512<R, NX, true>(w, row_bytes, nb, x, out);
}

// ---- Q4_K with 8 rows interleaved (block size 1152; `interleave_` makes it from Q4_K in place at load) ----
// Block b of rows 8g..8g+7 is one 1152-byte block holding the 8 rows' Q4_K blocks b: bytes 0-15 the rows' d
// (float16, row r at 2r), 16-31 their dmin, 32-95 one byte per (sub-block j, row r) at j * 8 + r: the 6-bit scale
// | the top 2 bits of the 6-bit min << 6, 96-127 the mins' low 4 bits (index j * 8 + r: byte index % 32, the low
// nibble for indices below 32), then 16 vectors of 64 bytes: vector 4k + q, 4-byte lane L = row L / 2's bytes
// 32k + 8q + 4(L % 2) .. +3 of its 128 nibble bytes (low nibbles: values of sub-block 2k, high: sub-block 2k + 1).
// Every 32-bit lane belongs to one row, and a row's two lanes hold 8 consecutive values, so one vpdpbusd against 8
// input bytes broadcast to every qword (the quantized input row as it is) sums 4 values of 8 rows x 2 places; a
// sub-block's 8 scales multiply 8 rows at once (one byte permute builds them), and a block's float scaling is one
// multiply-add for 8 rows: no per-row scale decoding or shuffles. Against rows_q4k_avx512 (packed_linear, one
// thread, matrices in the cache; scratch timing, not stored): 1.9-3.3x on one input row, 2.0-2.3x on 2 or 4.
// llama.cpp's repack interleaves 8 Q4_K rows too, in a layout of its own. The bytes are the Q4_K blocks'
// rearranged: the same size, and `q4k_block` gives each row's block back exactly.

// Row r's d, dmin and 12 scale bytes (the first 16 bytes of its Q4_K / Q5_K block) from the interleaved block at p.
inline void k_header(const uint8_t* p, int r, uint8_t* blk) {
  std::memcpy(blk, p + 2 * r, 2);
  std::memcpy(blk + 2, p + 16 + 2 * r, 2);
  int sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    const int i = j * 8 + r, b = p[32 + i];
    sc[j] = b & 63;
    m[j] = ((p[96 + (i & 31)] >> (i < 32 ? 0 : 4)) & 15) | ((b >> 6) << 4);
  }
  uint8_t* s = blk + 4;  // the inverse of scale_min
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
  }
}

// Row r's Q4_K block (144 bytes) from the interleaved block at p.
inline void q4k_block(const uint8_t* p, int r, uint8_t* blk) {
  k_header(p, r, blk);
  for (int k = 0; k < 4; ++k)
    for (int q = 0; q < 4; ++q) std::memcpy(blk + 16 + 32 * k + 8 * q, p + 128 + 64 * (4 * k + q) + 8 * r, 8);
}

// The first 128 bytes of an interleaved Q4_K / Q5_K block at p (d, dmin, scales, mins) from the 8 rows' blocks blk[r].
inline void x8_k_header(const uint8_t* const* blk, uint8_t* p) {
  std::memset(p + 96, 0, 32);
  for (int r = 0; r < 8; ++r) {
    std::memcpy(p + 2 * r, blk[r], 2);
    std::memcpy(p + 16 + 2 * r, blk[r] + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min(blk[r] + 4, j, sc, m);
      const int i = j * 8 + r;
      p[32 + i] = static_cast<uint8_t>(sc | ((m >> 4) << 6));
      p[96 + (i & 31)] |= static_cast<uint8_t>((m & 15) << (i < 32 ? 0 : 4));
    }
  }
}

// The interleaved block at p from the 8 rows' Q4_K blocks blk[r] (144 bytes each).
inline void x8_k_block(const uint8_t* const* blk, uint8_t* p) {
  x8_k_header(blk, p);
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 4; ++k)
      for (int q = 0; q < 4; ++q) std::memcpy(p + 128 + 64 * (4 * k + q) + 8 * r, blk[r] + 16 + 32 * k + 8 * q, 8);
}

// ---- Q5_K with 8 rows interleaved (block size 1408; `interleave_` makes it from Q5_K in place at load) ----
// A Q5_K block (176 bytes: d, dmin, Q4_K's 12 scale bytes, 32 bytes qh, 128 nibble bytes as Q4_K's) adds a fifth
// bit to each value: for values 64k + l and 64k + 32 + l (l < 32; the low and high nibbles of byte 32k + l) bits 2k
// and 2k + 1 of qh[l]. Block b of rows 8g..8g+7 is Q4_K_X8's block of the 8 rows (the same 128-byte header, the
// same 16 nibble vectors) with after each k's 4 nibble vectors one vector of their fifth bits: byte i of fifth-bit
// vector k holds at bits 2q / 2q + 1 those of the low / high nibble of byte i of nibble vector 4k + q. A block is
// read front to back; the kernels are Q4_K_X8's with each nibble vector's fifth bits or-ed in (AVX-512: a GF(2)
// affine map and a vpternlogd; AVX2: a shift, an and, an or). The bytes are the Q5_K blocks' rearranged: the same
// size, and `q5k_block` gives each row's back.
constexpr int x8_5_nib(int n) { return 128 + 320 * (n / 4) + 64 * (n % 4); }
constexpr int x8_5_top(int k) { return 128 + 320 * k + 256; }

// Row r's Q5_K block (176 bytes) from the interleaved block at p.
inline void q5k_block(const uint8_t* p, int r, uint8_t* blk) {
  k_header(p, r, blk);
  constexpr uint64_t m3 = 0x0303030303030303ULL;
  uint64_t qh[4] = {0, 0, 0, 0};  // qh[8q .. 8q + 8)
  for (int k = 0; k < 4; ++k) {
    uint64_t top;
    std::memcpy(&top, p + x8_5_top(k) + 8 * r, 8);
    for (int q = 0; q < 4; ++q) {
      std::memcpy(blk + 48 + 32 * k + 8 * q, p + x8_5_nib(4 * k + q) + 8 * r, 8);
      qh[q] |= ((top >> (2 * q)) & m3) << (2 * k);
    }
  }
  std::memcpy(blk + 16, qh, 32);
}

// The interleaved block at p from the 8 rows' Q5_K blocks blk[r] (176 bytes each), 8 bytes at a time.
inline void x8_5_block(const uint8_t* const* blk, uint8_t* p) {
  x8_k_header(blk, p);
  constexpr uint64_t m3 = 0x0303030303030303ULL;
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 4; ++k) {
      uint64_t top = 0;
      for (int q = 0; q < 4; ++q) {
        std::memcpy(p + x8_5_nib(4 * k + q) + 8 * r, blk[r] + 48 + 32 * k + 8 * q, 8);
        uint64_t h;
        std::memcpy(&h, blk[r] + 16 + 8 * q, 8);
        top |= ((h >> (2 * k)) & m3) << (2 * q);
      }
      std::memcpy(p + x8_5_top(k) + 8 * r, &top, 8);
    }
}

// The permutes of the interleaved kernels: sc[j] puts Q4_K sub-block j's 8 scales in the low bytes of the 16 lanes
// (lane L: row L / 2); mn[z] the mins of sub-blocks 4z..4z+3 as int16 pairs (lane D: row D / 2, sub-blocks 2p and
// 2p + 1 for p = 2z + D % 2), against the input's 4 sub-block sums 4z..4z+3 broadcast to every qword; dup[L] = L / 2
// (8 rows' floats to their two lanes each); dup2[L] = 8 + L / 2 (the next 8); q6[jj] (Q6_K, an int16 permute) puts
// sub-block 4k + jj's 8 scales (of the 4 sub-blocks' 32 int16 scales) in the low int16 of the 16 lanes (the high
// halves masked to 0).
struct X8Perm {
  alignas(64) int8_t sc[8][64];
  alignas(64) int8_t mn[2][64];
  alignas(64) int32_t dup[16];
  alignas(64) int32_t dup2[16];
  alignas(64) int16_t q6[4][32];
};

inline const X8Perm& x8_perm() {
  static const X8Perm t = [] {
    X8Perm t{};
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 64; ++i) t.sc[j][i] = static_cast<int8_t>(j * 8 + i / 8);
    for (int z = 0; z < 2; ++z)
      for (int d = 0; d < 16; ++d) {
        const int r = d / 2, p = 2 * z + d % 2;
        t.mn[z][4 * d] = static_cast<int8_t>(2 * p * 8 + r);
        t.mn[z][4 * d + 2] = static_cast<int8_t>((2 * p + 1) * 8 + r);
      }
    for (int l = 0; l < 16; ++l) t.dup[l] = l / 2, t.dup2[l] = 8 + l / 2;
    for (int jj = 0; jj < 4; ++jj)
      for (int i = 0; i < 32; ++i) t.q6[jj][i] = static_cast<int16_t>(jj * 8 + i / 4);
    return t;
  }();
  return t;
}

// 8 input bytes at p in every qword of a vector.
TS_VBMI inline __m512i bcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// Lane sums of the two lanes of each row: out[r] = t[2r] + t[2r + 1].
TS_VBMI inline void pair_sums(__m512 t, float* out) {
  alignas(64) float v[16];
  _mm512_store_ps(v, t);
  for (int r = 0; r < 8; ++r) out[r] = v[2 * r] + v[2 * r + 1];
}

// out[j * 8 + r] = row r of the 8 interleaved Q4_K (Q5: Q5_K) rows at w (nb blocks) . input row x[j], j < NX.
// Sub-block sums of one vpdpbusd lane stay below 2^15 (Q4_K: 4 x 4 products of a nibble and |q| <= 127; Q5_K: 2 x 4
// of a five-bit value, the scales applied every two vectors), so the scales apply by vpdpwssd. Every row's
// arithmetic is the same whatever NX is: a row's result does not depend on the rows beside it.
constexpr int64_t X8_AHEAD = 16384;  // prefetch distance (bytes) on the weights' stream
template <int NX, bool Q5 = false>
TS_VBMI __attribute__((always_inline)) inline void rows_q4kx8_avx512(const uint8_t* w, int64_t nb, const QRow* const* x, float* out) {
  const X8Perm& P = x8_perm();
  const __m512i low = _mm512_set1_epi8(15), m3f = _mm512_set1_epi8(0x3f), m30 = _mm512_set1_epi8(0x30);
  constexpr int64_t BB = Q5 ? 1408 : 1152;
  const __m512i dup = _mm512_load_si512(P.dup);
  __m512 acc[NX], accm[NX];
  for (int j = 0; j < NX; ++j) acc[j] = accm[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = w + b * BB;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), BB);
    const __m512i scb = _mm512_loadu_si512(o + 32);
    const __m512i sc = _mm512_and_si512(scb, m3f);
    const __m256i ml = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 96));
    const __m512i mn = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(ml, _mm256_set1_epi8(15))),
                                          _mm256_and_si256(_mm256_srli_epi16(ml, 4), _mm256_set1_epi8(15)), 1);
    const __m512i mins = _mm512_or_si512(mn, _mm512_and_si512(_mm512_srli_epi16(scb, 2), m30));
    const __m512i m0 = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512(P.mn[0]), mins);
    const __m512i m1 = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512(P.mn[1]), mins);
    const __m512 d = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)))));
    const __m512 dm = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)))));
    __m512i bi[NX];
    for (int j = 0; j < NX; ++j) bi[j] = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m512i s0 = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_load_si512(P.sc[2 * k]), sc);
      const __m512i s1 = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_load_si512(P.sc[2 * k + 1]), sc);
      const __m512i top = Q5 ? _mm512_loadu_si512(o + x8_5_top(k)) : low;
      __m512i sl[NX], sh[NX];
      for (int j = 0; j < NX; ++j) sl[j] = sh[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(o + (Q5 ? x8_5_nib(4 * k + q) : 128 + 64 * (4 * k + q)));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (Q5) {  // the fifth bits (bits 2q, 2q + 1 of `top`) moved to bit 4, alone, by a GF(2) affine map
          // per byte (against shifts and masks: the chain of a Q5_K file's products 1.3x faster on one input row,
          // level on 4); vpternlogd 0xEC is (a & c) | b
          const __m512i tl = _mm512_gf2p8affine_epi64_epi8(top, _mm512_set1_epi64(int64_t(1) << (24 + 2 * q)), 0);
          const __m512i th = _mm512_gf2p8affine_epi64_epi8(top, _mm512_set1_epi64(int64_t(1) << (25 + 2 * q)), 0);
          lo = _mm512_ternarylogic_epi32(v, tl, low, 0xEC);
          hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), th, low, 0xEC);
        }
        for (int j = 0; j < NX; ++j) {
          const int8_t* e = &x[j]->q[b * 256 + 64 * k + 8 * q];
          sl[j] = _mm512_dpbusd_epi32(sl[j], lo, bcast8(e));
          sh[j] = _mm512_dpbusd_epi32(sh[j], hi, bcast8(e + 32));
        }
        if (q == 3 || (Q5 && q == 1))
          for (int j = 0; j < NX; ++j) {
            bi[j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(bi[j], sl[j], s0), sh[j], s1);
            sl[j] = sh[j] = _mm512_setzero_si512();
          }
      }
    }
    for (int j = 0; j < NX; ++j) {
      const __m512 xd = _mm512_set1_ps(x[j]->d[b]);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bi[j]), _mm512_mul_ps(d, xd), acc[j]);
      const int16_t* bs = &x[j]->sum16[b * 8];
      const __m512i mi = _mm512_dpwssd_epi32(_mm512_madd_epi16(m0, bcast8(bs)), m1, bcast8(bs + 4));
      accm[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(dm, xd), accm[j]);
    }
  }
  for (int j = 0; j < NX; ++j) pair_sums(_mm512_sub_ps(acc[j], accm[j]), out + 8 * j);
}

// ---- Q4_0 with 8 rows interleaved (block size 576; `interleave_` makes it from Q4_0 in place at load) ----
// Blocks 4c..4c+3 of rows 8g..8g+7 are one 576-byte block: bytes 0-63 the rows' d (block i, row r: float16 at
// 16i + 2r), then 8 vectors of 64 bytes: vector 2i + q, 4-byte lane L = row L / 2's nibble bytes 8q + 4(L % 2) ..
// +3 of block i (low nibbles: values 8q + 4(L % 2) + 0..3, high: the same + 16). As for Q4_K, one vpdpbusd sums 4
// values of 8 rows x 2 places against 8 broadcast input bytes, and one multiply-add scales a block for the 8 rows;
// each row's two lanes start from -4 x the block's input sum (the weights' -8). Against the 8-blocks-per-row kernel
// (rows_q4_0_avx512; the same timing): 1.6-1.8x on one input row, 1.7-1.9x on 2 or 4.

// Row r's Q4_0 block i (18 bytes) from the interleaved block at p.
inline void q40_block(const uint8_t* p, int i, int r, uint8_t* blk) {
  std::memcpy(blk, p + 16 * i + 2 * r, 2);
  for (int q = 0; q < 2; ++q) std::memcpy(blk + 2 + 8 * q, p + 64 + 64 * (2 * i + q) + 8 * r, 8);
}

// The interleaved block at p from the 8 rows' 4 Q4_0 blocks, blk[r] (72 bytes each).
inline void x8_0_block(const uint8_t* const* blk, uint8_t* p) {
  for (int r = 0; r < 8; ++r)
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = blk[r] + 18 * i;
      std::memcpy(p + 16 * i + 2 * r, b, 2);
      for (int q = 0; q < 2; ++q) std::memcpy(p + 64 + 64 * (2 * i + q) + 8 * r, b + 2 + 8 * q, 8);
    }
}

// out[j * 8 + r] = row r of the 8 interleaved Q4_0 (Q8: Q8_0) rows at w (nc blocks of 4) . input row x[j], j < NX.
template <int NX, bool Q8 = false>
TS_VBMI __attribute__((always_inline)) inline void rows_q40x8_avx512(const uint8_t* w, int64_t nc, const QRow* const* x, float* out) {
  const X8Perm& P = x8_perm();
  const __m512i low = _mm512_set1_epi8(15), dup = _mm512_load_si512(P.dup), dup2 = _mm512_load_si512(P.dup2);
  constexpr int64_t BB = Q8 ? 1088 : 576;
  __m512 acc[NX];
  for (int j = 0; j < NX; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    const uint8_t* o = w + c * BB;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), BB);
    const __m512 d01 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
    const __m512 d23 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32)));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512 d = _mm512_permutexvar_ps(i % 2 == 0 ? dup : dup2, i < 2 ? d01 : d23);  // block i's 8 scales
      const int64_t b = 4 * c + i;
      __m512i s[NX];  // each row's two lanes start from the weights' offset (-8, or + 128) x the block's input sum
      for (int j = 0; j < NX; ++j) s[j] = _mm512_set1_epi32((Q8 ? -64 : -4) * x[j]->sum32[b]);
      if constexpr (Q8) {
        for (int q = 0; q < 4; ++q) {
          const __m512i v = _mm512_loadu_si512(o + 64 + 64 * (4 * i + q));
          for (int j = 0; j < NX; ++j) s[j] = _mm512_dpbusd_epi32(s[j], v, bcast8(&x[j]->q[b * 32 + 8 * q]));
        }
      } else {
        for (int q = 0; q < 2; ++q) {
          const __m512i v = _mm512_loadu_si512(o + 64 + 64 * (2 * i + q));
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int j = 0; j < NX; ++j) {
            const int8_t* e = &x[j]->q[b * 32 + 8 * q];
            s[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[j], lo, bcast8(e)), hi, bcast8(e + 16));
          }
        }
      }
      for (int j = 0; j < NX; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]), _mm512_mul_ps(d, _mm512_set1_ps(x[j]->d[b])), acc[j]);
    }
  }
  for (int j = 0; j < NX; ++j) pair_sums(acc[j], out + 8 * j);
}

// ---- Q8_0 with 8 rows interleaved (block size 1088; `interleave_` makes it from Q8_0 in place at load) ----
// Blocks 4c..4c+3 of rows 8g..8g+7 are one 1088-byte block: bytes 0-63 the rows' d (block i, row r: float16 at
// 16i + 2r), then 16 vectors of 64 bytes: vector 4i + q, 4-byte lane L = row L / 2's values 8q + 4(L % 2) .. +3 of
// block i, each stored + 128 (the byte xor 0x80: unsigned, for vpdpbusd). One vpdpbusd sums 4 values of 8 rows x 2
// places against 8 broadcast input bytes, as Q4_0_X8's, with no unpacking; each row's two lanes start from -64 x
// the block's input sum (the + 128). The AVX-512 kernel is Q4_0_X8's (rows_q40x8_avx512<NX, true>). `q80_block`
// gives each row's block back exactly.

// Row r's Q8_0 block i (34 bytes) from the interleaved block at p.
inline void q80_block(const uint8_t* p, int i, int r, uint8_t* blk) {
  std::memcpy(blk, p + 16 * i + 2 * r, 2);
  constexpr uint64_t flip = 0x8080808080808080ULL;
  for (int q = 0; q < 4; ++q) {
    uint64_t v;
    std::memcpy(&v, p + 64 + 64 * (4 * i + q) + 8 * r, 8);
    v ^= flip;
    std::memcpy(blk + 2 + 8 * q, &v, 8);
  }
}

// The interleaved block at p from the 8 rows' 4 Q8_0 blocks, blk[r] (136 bytes each).
inline void x8_8_block(const uint8_t* const* blk, uint8_t* p) {
  constexpr uint64_t flip = 0x8080808080808080ULL;
  for (int r = 0; r < 8; ++r)
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = blk[r] + 34 * i;
      std::memcpy(p + 16 * i + 2 * r, b, 2);
      for (int q = 0; q < 4; ++q) {
        uint64_t v;
        std::memcpy(&v, b + 2 + 8 * q, 8);
        v ^= flip;
        std::memcpy(p + 64 + 64 * (4 * i + q) + 8 * r, &v, 8);
      }
    }
}


// Q8_0_X8 rows: rows_q40x8_avx512 over values stored + 128.
template <int NX>
TS_VBMI __attribute__((always_inline)) inline void rows_q80x8_avx512(const uint8_t* w, int64_t nc, const QRow* const* x, float* out) {
  rows_q40x8_avx512<NX, true>(w, nc, x, out);
}

// ---- Q6_K with 8 rows interleaved (block size 1680; `interleave_` makes it from Q6_K in place at load) ----
// Block b of rows 8g..8g+7 is one 1680-byte block holding the 8 rows' Q6_K blocks b: bytes 0-15 the rows' d
// (float16, row r at 2r), 16-143 the int8 scales (16-value sub-block j, row r at 16 + 8j + r), then per 64 values
// (k = 0..3) 384 bytes: 4 vectors of 64 bytes of the values' low 4 bits laid out as Q4_K_X8's (vector 4k + q,
// 4-byte lane L = row L / 2: its values 64k + 8q + 4(L % 2) + 0..3 in the low nibbles, the same + 32 in the high
// ones), then 2 vectors of their top 2 bits: byte i of top-bits vector m = 2k + q / 2 holds, at bits 0-1 / 2-3 /
// 4-5 / 6-7, those of the values in byte i of nibble vector 2m (low, high nibble) and 2m + 1 (low, high). So the
// kernels rebuild 64 six-bit values of 8 rows with a few whole-vector ops and multiply them as the Q4_K_X8 kernels
// do (8 input bytes broadcast to every qword); the weights' -32 is taken once per block from the input's 16-value
// sums. A block is read front to back: with all 16 nibble vectors first and the top bits after them (two streams
// 1 KB apart), products of matrices streamed from memory ran at 9-19 GB/s against 23-44 for the file's layout
// (scratch timing, one and two threads), the same 1.2-2x faster than it in the cache. The bytes are the Q6_K
// blocks' rearranged: the same size, and `q6k_block` gives each row's block back exactly.

// A Q6_K block's 192 value bytes from its 256 six-bit values (0..63) in order.
inline void q6_pack(const uint8_t* v, uint8_t* blk) {
  std::memset(blk, 0, 192);
  for (int i = 0; i < 256; ++i) {
    const int n = i / 128, t = (i % 128) / 32, l = i % 32;
    blk[64 * n + l + 32 * (t % 2)] |= static_cast<uint8_t>((v[i] & 15) << (t < 2 ? 0 : 4));
    blk[128 + 32 * n + l] |= static_cast<uint8_t>((v[i] >> 4) << (2 * t));
  }
}

// Where nibble vector n and top-bits vector m lie in an interleaved block: per 64 values of the 8 rows (k = n / 4 =
// m / 2), the 4 nibble vectors then their 2 top-bits vectors, so a block is read front to back.
constexpr int x8_6_nib(int n) { return 144 + 384 * (n / 4) + 64 * (n % 4); }
constexpr int x8_6_top(int m) { return 144 + 384 * (m / 2) + 256 + 64 * (m % 2); }

// Byte 8r + u of nibble vector 4k + q holds row r's values 64k + 8q + u (low nibble) and that + 32 (high nibble).
inline void x8_6_values(int n, int i, int& v_lo, int& v_hi) {
  const int k = n / 4, q = n % 4, u = i % 8;
  v_lo = 64 * k + 8 * q + u;
  v_hi = v_lo + 32;
}

// Row r's Q6_K block (210 bytes) from the interleaved block at p.
inline void q6k_block(const uint8_t* p, int r, uint8_t* blk) {
  uint8_t v[256];
  for (int n = 0; n < 16; ++n)
    for (int u = 0; u < 8; ++u) {
      const int i = 8 * r + u;
      const uint8_t nib = p[x8_6_nib(n) + i], hb = p[x8_6_top(n / 2) + i] >> (4 * (n % 2));
      int lo, hi;
      x8_6_values(n, i, lo, hi);
      v[lo] = static_cast<uint8_t>((nib & 15) | ((hb & 3) << 4));
      v[hi] = static_cast<uint8_t>((nib >> 4) | (((hb >> 2) & 3) << 4));
    }
  q6_pack(v, blk);
  for (int j = 0; j < 16; ++j) blk[192 + j] = p[16 + 8 * j + r];
  std::memcpy(blk + 208, p + 2 * r, 2);
}

// The interleaved block at p from the 8 rows' Q6_K blocks blk[r] (210 bytes each), 8 bytes at a time: values
// 64k + 8q + u and that + 32 (u < 8) are, in ggml's half n = k / 2, the low (k even) or high (k odd) nibbles of
// ql[64n + 8q + u] and ql[64n + 32 + 8q + u], with their top bits at bits 4(k % 2) .. 4(k % 2) + 3 of
// qh[32n + 8q + u].
inline void x8_6_block(const uint8_t* const* blk, uint8_t* p) {
  constexpr uint64_t m4 = 0x0F0F0F0F0F0F0F0FULL;
  for (int m = 0; m < 8; ++m) std::memset(p + x8_6_top(m), 0, 64);
  for (int r = 0; r < 8; ++r) {
    const uint8_t* b = blk[r];
    std::memcpy(p + 2 * r, b + 208, 2);
    for (int j = 0; j < 16; ++j) p[16 + 8 * j + r] = b[192 + j];
    for (int k = 0; k < 4; ++k)
      for (int q = 0; q < 4; ++q) {
        const int n = k / 2;
        uint64_t lo, hi, top, h;
        std::memcpy(&lo, b + 64 * n + 8 * q, 8);
        std::memcpy(&hi, b + 64 * n + 32 + 8 * q, 8);
        std::memcpy(&top, b + 128 + 32 * n + 8 * q, 8);
        const uint64_t nib = k % 2 ? ((lo >> 4) & m4) | (hi & ~m4) : (lo & m4) | ((hi & m4) << 4);
        std::memcpy(p + x8_6_nib(4 * k + q) + 8 * r, &nib, 8);
        uint8_t* hp = p + x8_6_top(2 * k + q / 2) + 8 * r;
        std::memcpy(&h, hp, 8);
        h |= ((k % 2 ? top >> 4 : top) & m4) << (4 * (q % 2));
        std::memcpy(hp, &h, 8);
      }
  }
}

// Row r's sum over the block of scale x the input's 16-value sums (for the weights' -32), the 8 rows in the 8 lanes:
// sub-blocks (2t, 2t + 1) per vpmaddwd (|result| < 2^23).
__attribute__((always_inline)) inline __m256i q6x8_offsets(const uint8_t* o, const int16_t* s16) {
  __m256i t = _mm256_setzero_si256();
  for (int u = 0; u < 8; ++u) {
    const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 + 16 * u));  // sub-blocks 2u, 2u + 1
    int32_t pair;
    std::memcpy(&pair, s16 + 2 * u, 4);
    t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128(two, 8))),
                                              _mm256_set1_epi32(pair)));
  }
  return t;
}

// out[j * 8 + r] = row r of the 8 interleaved Q6_K rows at w (nb blocks) . input row x[j], j < NX. A vpdpbusd lane
// sums 4 products of a six-bit value and |q| <= 127 (< 2^15), so each applies its sub-block's scale by vpdpwssd.
template <int NX>
TS_VBMI __attribute__((always_inline)) inline void rows_q6kx8_avx512(const uint8_t* w, int64_t nb, const QRow* const* x, float* out) {
  const X8Perm& P = x8_perm();
  const __m512i m0f = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
  const __m512i dup = _mm512_load_si512(P.dup);
  __m512 acc[NX];
  for (int j = 0; j < NX; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = w + b * 1680;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), 1680);
    const __m512 d = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)))));
    __m512i bi[NX];
    for (int j = 0; j < NX; ++j) {  // both lanes of a row start from -16 x its offsets: -32 x them in the row's sum
      const __m512i off = _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(q6x8_offsets(o, &x[j]->half16[b * 16])));
      bi[j] = _mm512_sub_epi32(zero, _mm512_slli_epi32(off, 4));
    }
    for (int k = 0; k < 4; ++k) {
      const __m512i sc16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 16 + 32 * k)));
      __m512i sc[4];
      for (int jj = 0; jj < 4; ++jj) sc[jj] = _mm512_maskz_permutexvar_epi16(0x55555555u, _mm512_load_si512(P.q6[jj]), sc16);
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(o + x8_6_nib(4 * k + q));
        const __m512i h = _mm512_loadu_si512(o + x8_6_top(2 * k + q / 2));
        const __m512i hl = q % 2 ? h : _mm512_slli_epi16(h, 4), hh = q % 2 ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
        // (nibble & 15) | (top bits & 0x30): vpternlogd 0xEC is (a & c) | b (a GF(2) affine map moving the top bits
        // instead of the shift and mask: no faster here, unlike Q5_K's)
        const __m512i lo = _mm512_ternarylogic_epi32(v, _mm512_and_si512(hl, m30), m0f, 0xEC);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(hh, m30), m0f, 0xEC);
        for (int j = 0; j < NX; ++j) {
          const int8_t* e = &x[j]->q[b * 256 + 64 * k + 8 * q];
          bi[j] = _mm512_dpwssd_epi32(bi[j], _mm512_dpbusd_epi32(zero, lo, bcast8(e)), sc[q / 2]);
          bi[j] = _mm512_dpwssd_epi32(bi[j], _mm512_dpbusd_epi32(zero, hi, bcast8(e + 32)), sc[2 + q / 2]);
        }
      }
    }
    for (int j = 0; j < NX; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bi[j]), _mm512_mul_ps(d, _mm512_set1_ps(x[j]->d[b])), acc[j]);
  }
  for (int j = 0; j < NX; ++j) pair_sums(acc[j], out + 8 * j);
}

// ---- The interleaved formats with AVX2 (CPUs without AVX-512 VBMI, or TURBOSPEC_NO_AVX512): the same blocks, each
// 64-byte vector taken as two halves of 4 rows. `vpmaddubsw` sums pairs of nibble x input products in int16 (a sub-block's 4 vectors add
// up to at most 4 x 2 x 15 x 127 = 15240), `vpmaddwd` applies the scales (Q4_K) or sums to int32 (Q4_0).

// 8 input bytes at p in every qword of a 256-bit vector.
inline __m256i bcast8_256(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// Lane sums of the two lanes of each of 4 rows: out[r] = t[2r] + t[2r + 1].
inline void pair_sums4(__m256 t, float* out) {
  alignas(32) float v[8];
  _mm256_store_ps(v, t);
  for (int r = 0; r < 4; ++r) out[r] = v[2 * r] + v[2 * r + 1];
}

// The byte shuffles of rows_q4kx8_avx2: sc[h] takes rows 4h..4h+3's scales (of 8 scale bytes in every qword) into
// both int16 halves of their two 32-bit lanes; dup[h] takes rows 4h..4h+3's floats (of 8) to their two lanes each;
// q6[h] (rows_q6kx8_avx2) takes rows 4h..4h+3's int8 scales into the high byte of both int16 halves of their two
// lanes (an arithmetic shift by 8 then sign-extends them).
struct X8Avx2 {
  alignas(32) int8_t sc[2][32];
  alignas(32) int32_t dup[2][8];
  alignas(32) int8_t q6[2][32];
};

inline const X8Avx2& x8_avx2() {
  static const X8Avx2 t = [] {
    X8Avx2 t{};
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 32; ++i) {  // byte i: 32-bit lane 4 (i / 16) + (i % 16) / 4 of row 4h + that lane / 2
        const int8_t row = static_cast<int8_t>(4 * h + 2 * (i / 16) + (i % 16) / 8);
        t.sc[h][i] = i % 2 ? -128 : row;
        t.q6[h][i] = i % 2 ? row : -128;
      }
      for (int l = 0; l < 8; ++l) t.dup[h][l] = 4 * h + l / 2;
    }
    return t;
  }();
  return t;
}

// A table's two 32-byte rows (an X8Avx2 field, one per half of 4 rows) in two vectors.
inline void load_halves(const void* table, __m256i* out) {
  for (int h = 0; h < 2; ++h) out[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(table) + h);
}

// out[j * 8 + r] as rows_q4kx8_avx512, with AVX2 (Q5_K: a sub-block's 4 vectors' pairs sum to at most 4 x 2 x 31
// x 127 = 31496 in int16).
template <int NX, bool Q5 = false>
__attribute__((always_inline)) inline void rows_q4kx8_avx2(const uint8_t* w, int64_t nb, const QRow* const* x, float* out) {
  const X8Avx2& P = x8_avx2();
  const __m256i low = _mm256_set1_epi8(15);
  __m256i shuf[2];
  load_halves(P.sc, shuf);
  __m256i dup[2];
  load_halves(P.dup, dup);
  __m256 acc[NX][2], accm[NX];
  for (int j = 0; j < NX; ++j) acc[j][0] = acc[j][1] = accm[j] = _mm256_setzero_ps();
  constexpr int64_t BB = Q5 ? 1408 : 1152;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = w + b * BB;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), BB);
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
    const __m256 d[2] = {_mm256_permutevar8x32_ps(d8, dup[0]), _mm256_permutevar8x32_ps(d8, dup[1])};
    // the mins: byte j * 8 + r, low nibbles at 96.., top bits in the scale bytes' bits 6-7
    const __m256i ml = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 96));
    const __m256i sb0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32));
    const __m256i sb1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 64));
    const __m256i m30 = _mm256_set1_epi8(0x30);
    alignas(32) uint8_t mins[64];
    _mm256_store_si256(reinterpret_cast<__m256i*>(mins),
                       _mm256_or_si256(_mm256_and_si256(ml, low), _mm256_and_si256(_mm256_srli_epi16(sb0, 2), m30)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(mins + 32),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ml, 4), low),
                                       _mm256_and_si256(_mm256_srli_epi16(sb1, 2), m30)));
    __m256i bi[NX][2];
    for (int j = 0; j < NX; ++j) bi[j][0] = bi[j][1] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      // sub-blocks 2k and 2k + 1's 6-bit scales (8 rows each), then their lanes in each half
      const __m256i c0 = _mm256_and_si256(bcast8_256(o + 32 + 16 * k), _mm256_set1_epi8(0x3f));
      const __m256i c1 = _mm256_and_si256(bcast8_256(o + 40 + 16 * k), _mm256_set1_epi8(0x3f));
      __m256i s0[2], s1[2];
      for (int h = 0; h < 2; ++h) s0[h] = _mm256_shuffle_epi8(c0, shuf[h]), s1[h] = _mm256_shuffle_epi8(c1, shuf[h]);
      __m256i sl[NX][2], sh[NX][2];
      for (int j = 0; j < NX; ++j) sl[j][0] = sl[j][1] = sh[j][0] = sh[j][1] = _mm256_setzero_si256();
      for (int q = 0; q < 4; ++q)
        for (int h = 0; h < 2; ++h) {
          const int at = (Q5 ? x8_5_nib(4 * k + q) : 128 + 64 * (4 * k + q)) + 32 * h;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at));
          __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (Q5) {
            const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + x8_5_top(k) + 32 * h));
            lo = _mm256_or_si256(lo, bit_at4(top, 2 * q));
            hi = _mm256_or_si256(hi, bit_at4(top, 2 * q + 1));
          }
          for (int j = 0; j < NX; ++j) {
            const int8_t* e = &x[j]->q[b * 256 + 64 * k + 8 * q];
            sl[j][h] = _mm256_add_epi16(sl[j][h], _mm256_maddubs_epi16(lo, bcast8_256(e)));
            sh[j][h] = _mm256_add_epi16(sh[j][h], _mm256_maddubs_epi16(hi, bcast8_256(e + 32)));
          }
        }
      for (int j = 0; j < NX; ++j)
        for (int h = 0; h < 2; ++h)
          bi[j][h] = _mm256_add_epi32(bi[j][h], _mm256_add_epi32(_mm256_madd_epi16(sl[j][h], s0[h]),
                                                                 _mm256_madd_epi16(sh[j][h], s1[h])));
    }
    for (int j = 0; j < NX; ++j) {
      const __m256 xd = _mm256_set1_ps(x[j]->d[b]);
      for (int h = 0; h < 2; ++h)
        acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bi[j][h]), _mm256_mul_ps(d[h], xd), acc[j][h]);
      // row r's mins . sub-block sums, the 8 rows in the 8 lanes: pairs of sub-blocks (2t, 2t + 1) per vpmaddwd
      const int16_t* bs = &x[j]->sum16[b * 8];
      __m256i mi = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + 16 * t));  // sub-blocks 2t, 2t + 1
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128(two, 8)));
        int32_t pair;
        std::memcpy(&pair, bs + 2 * t, 4);
        mi = _mm256_add_epi32(mi, _mm256_madd_epi16(m16, _mm256_set1_epi32(pair)));
      }
      accm[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(dm8, xd), accm[j]);
    }
  }
  for (int j = 0; j < NX; ++j) {
    alignas(32) float m8[8];
    _mm256_store_ps(m8, accm[j]);
    pair_sums4(acc[j][0], out + 8 * j);
    pair_sums4(acc[j][1], out + 8 * j + 4);
    for (int r = 0; r < 8; ++r) out[8 * j + r] -= m8[r];
  }
}

// out[j * 8 + r] as rows_q40x8_avx512 (Q8: rows_q80x8_avx512), with AVX2. Q8_0's weights go back to signed (xor
// 0x80) for its sign trick (|w| x sign(x, w): vpmaddubsw pairs of at most 2 x 128 x 127, no saturation).
template <int NX, bool Q8 = false>
__attribute__((always_inline)) inline void rows_q40x8_avx2(const uint8_t* w, int64_t nc, const QRow* const* x, float* out) {
  const X8Avx2& P = x8_avx2();
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  constexpr int64_t BB = Q8 ? 1088 : 576;
  __m256i dup[2];
  load_halves(P.dup, dup);
  __m256 acc[NX][2];
  for (int j = 0; j < NX; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    const uint8_t* o = w + c * BB;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), BB);
    for (int i = 0; i < 4; ++i) {
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 * i)));
      const int64_t b = 4 * c + i;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_permutevar8x32_ps(d8, dup[h]);
        __m256i s[NX];  // Q4_0: from -8 x the block's input sum (the weights' -8), its pairs summed in int16 first
        for (int j = 0; j < NX; ++j) s[j] = _mm256_set1_epi32(Q8 ? 0 : -4 * x[j]->sum32[b]);
        if constexpr (Q8) {
          for (int q = 0; q < 4; ++q) {
            const __m256i v = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 64 + 64 * (4 * i + q) + 32 * h)), flip);
            const __m256i u = _mm256_sign_epi8(v, v);
            for (int j = 0; j < NX; ++j)
              s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(
                  _mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast8_256(&x[j]->q[b * 32 + 8 * q]), v)), one));
          }
        } else {
          __m256i s16[NX];
          for (int j = 0; j < NX; ++j) s16[j] = _mm256_setzero_si256();
          for (int q = 0; q < 2; ++q) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 64 + 64 * (2 * i + q) + 32 * h));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int j = 0; j < NX; ++j) {
              const int8_t* e = &x[j]->q[b * 32 + 8 * q];
              s16[j] = _mm256_add_epi16(s16[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast8_256(e)),
                                                                 _mm256_maddubs_epi16(hi, bcast8_256(e + 16))));
            }
          }
          for (int j = 0; j < NX; ++j) s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(s16[j], one));
        }
        for (int j = 0; j < NX; ++j)
          acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j]), _mm256_mul_ps(d, _mm256_set1_ps(x[j]->d[b])), acc[j][h]);
      }
    }
  }
  for (int j = 0; j < NX; ++j) {
    pair_sums4(acc[j][0], out + 8 * j);
    pair_sums4(acc[j][1], out + 8 * j + 4);
  }
}

// Q8_0_X8 rows with AVX2: rows_q40x8_avx2 over values stored + 128.
template <int NX>
__attribute__((always_inline)) inline void rows_q80x8_avx2(const uint8_t* w, int64_t nc, const QRow* const* x, float* out) {
  rows_q40x8_avx2<NX, true>(w, nc, x, out);
}

// out[j * 8 + r] as rows_q6kx8_avx512, with AVX2: vpmaddubsw pairs (at most 2 x 63 x 127) summed over the two
// vectors of a 16-value sub-block stay within int16, and vpmaddwd applies its scale.
template <int NX>
__attribute__((always_inline)) inline void rows_q6kx8_avx2(const uint8_t* w, int64_t nb, const QRow* const* x, float* out) {
  const X8Avx2& P = x8_avx2();
  const __m256i m0f = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i shuf[2];
  load_halves(P.q6, shuf);
  __m256i dup[2];
  load_halves(P.dup, dup);
  __m256 acc[NX][2];
  for (int j = 0; j < NX; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = w + b * 1680;
    prefetch_l2(reinterpret_cast<const char*>(o + X8_AHEAD), 1680);
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    const __m256 d[2] = {_mm256_permutevar8x32_ps(d8, dup[0]), _mm256_permutevar8x32_ps(d8, dup[1])};
    __m256i bi[NX][2];
    for (int j = 0; j < NX; ++j) {  // both lanes of a row start from -16 x its offsets: -32 x them in the row's sum
      const __m256i off = _mm256_slli_epi32(q6x8_offsets(o, &x[j]->half16[b * 16]), 4);
      for (int h = 0; h < 2; ++h) bi[j][h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_permutevar8x32_epi32(off, dup[h]));
    }
    for (int k = 0; k < 4; ++k) {
      __m256i sc[4][2];  // sub-block 4k + jj's scales in each half
      for (int jj = 0; jj < 4; ++jj) {
        const __m256i c = bcast8_256(o + 16 + 8 * (4 * k + jj));
        for (int h = 0; h < 2; ++h) sc[jj][h] = _mm256_srai_epi16(_mm256_shuffle_epi8(c, shuf[h]), 8);
      }
      for (int p = 0; p < 2; ++p)  // nibble vectors 4k + 2p and 4k + 2p + 1: sub-blocks 4k + p (low), 4k + 2 + p (high)
        for (int h = 0; h < 2; ++h) {
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + x8_6_top(2 * k + p) + 32 * h));
          __m256i sl[NX], sh[NX];
          for (int j = 0; j < NX; ++j) sl[j] = sh[j] = _mm256_setzero_si256();
          for (int u = 0; u < 2; ++u) {
            const int q = 2 * p + u;
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + x8_6_nib(4 * k + q) + 32 * h));
            const __m256i hl = u ? hb : _mm256_slli_epi16(hb, 4), hh = u ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m0f), _mm256_and_si256(hl, m30));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m0f), _mm256_and_si256(hh, m30));
            for (int j = 0; j < NX; ++j) {
              const int8_t* e = &x[j]->q[b * 256 + 64 * k + 8 * q];
              sl[j] = _mm256_add_epi16(sl[j], _mm256_maddubs_epi16(lo, bcast8_256(e)));
              sh[j] = _mm256_add_epi16(sh[j], _mm256_maddubs_epi16(hi, bcast8_256(e + 32)));
            }
          }
          for (int j = 0; j < NX; ++j)
            bi[j][h] = _mm256_add_epi32(bi[j][h], _mm256_add_epi32(_mm256_madd_epi16(sl[j], sc[p][h]),
                                                                   _mm256_madd_epi16(sh[j], sc[2 + p][h])));
        }
    }
    for (int j = 0; j < NX; ++j) {
      const __m256 xd = _mm256_set1_ps(x[j]->d[b]);
      for (int h = 0; h < 2; ++h)
        acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bi[j][h]), _mm256_mul_ps(d[h], xd), acc[j][h]);
    }
  }
  for (int j = 0; j < NX; ++j) {
    pair_sums4(acc[j][0], out + 8 * j);
    pair_sums4(acc[j][1], out + 8 * j + 4);
  }
}

// y[j * out + 8g + r] = weight row 8g + r . input row x[j] for groups g in [g0, g1) and j < m (an interleaved format
// F, blocks of `bytes` per group), the inputs in pairs (on AVX-512, Q4_0 / Q8_0 in fours where four are left).
#define TS_RANGE_X8(TARGET, NAME, SUFFIX, QUAD)                                                                \
  template <Fmt F>                                                                                               \
  TARGET void NAME(const uint8_t* w, int64_t nb, int64_t bytes, const QRow* const* x, int64_t m, int64_t g0,      \
                   int64_t g1, float* y, int64_t out) {                                                          \
    alignas(32) float t[32];                                                                                     \
    for (int64_t g = g0; g < g1; ++g) {                                                                          \
      const uint8_t* wg = w + g * nb * bytes;                                                                    \
      for (int64_t j = 0; j < m; j += 2) {                                                                       \
        const int nx = j + 1 < m ? 2 : 1;                                                                        \
        if constexpr (QUAD && (F == Fmt::Q4_0X8 || F == Fmt::Q8_0X8)) {                                          \
          if (j + 3 < m) {  /* four rows per pass over the weights: each block unpacked once for them */          \
            if constexpr (F == Fmt::Q8_0X8) rows_q80x8_##SUFFIX<4>(wg, nb, x + j, t);                            \
            else rows_q40x8_##SUFFIX<4>(wg, nb, x + j, t);                                                       \
            for (int k = 0; k < 4; ++k)                                                                          \
              for (int r = 0; r < 8; ++r) y[(j + k) * out + 8 * g + r] = t[8 * k + r];                           \
            j += 2;                                                                                              \
            continue;                                                                                            \
          }                                                                                                      \
        }                                                                                                        \
        if constexpr (F == Fmt::Q4_KX8 || F == Fmt::Q5_KX8) {                                                    \
          constexpr bool Q5 = F == Fmt::Q5_KX8;                                                                  \
          if (nx == 2) rows_q4kx8_##SUFFIX<2, Q5>(wg, nb, x + j, t);                                             \
          else rows_q4kx8_##SUFFIX<1, Q5>(wg, nb, x + j, t);                                                     \
        } else if constexpr (F == Fmt::Q6_KX8) {                                                                 \
          if (nx == 2) rows_q6kx8_##SUFFIX<2>(wg, nb, x + j, t);                                                 \
          else rows_q6kx8_##SUFFIX<1>(wg, nb, x + j, t);                                                         \
        } else if constexpr (F == Fmt::Q8_0X8) {                                                                 \
          if (nx == 2) rows_q80x8_##SUFFIX<2>(wg, nb, x + j, t);                                                 \
          else rows_q80x8_##SUFFIX<1>(wg, nb, x + j, t);                                                         \
        } else {                                                                                                 \
          if (nx == 2) rows_q40x8_##SUFFIX<2>(wg, nb, x + j, t);                                                 \
          else rows_q40x8_##SUFFIX<1>(wg, nb, x + j, t);                                                         \
        }                                                                                                        \
        for (int k = 0; k < nx; ++k)                                                                             \
          for (int r = 0; r < 8; ++r) y[(j + k) * out + 8 * g + r] = t[8 * k + r];                               \
      }                                                                                                          \
    }                                                                                                            \
  }
TS_RANGE_X8(TS_VBMI, range_x8, avx512, true)
TS_RANGE_X8(, range_x8_avx2, avx2, false)
#undef TS_RANGE_X8

// Q6_K with AVX-512 (BW + VNNI): per 128-value half, one 64-byte load of the low nibbles (values 0..63 in its low
// nibbles, 64..127 in its high ones) and the 32 bytes of high bits in both 256-bit lanes (shifted by 0 / 2, or 4 /
// 6, per lane: the two quarters each vector holds); 64 values per multiply, the 16-value scales applied by int16
// dot products, and the weights' -32 through the input's 16-value sums (the same integers as the AVX2 path).
struct Q6KLanes {
  alignas(64) int16_t idx[4][32];  // multiply p's int16 lanes -> their 16-value group's scale (group 4p + lane / 8)
};

template <int R, int NX>
TS_AVX512 __attribute__((always_inline)) inline void rows_q6k_avx512(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, float* out) {
  static const Q6KLanes ln = [] {
    Q6KLanes t{};
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) t.idx[p][l] = static_cast<int16_t>(4 * p + l / 8);
    return t;
  }();
  const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
  const __m512i sh_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  const int8_t* xq[NX];
  const float* xd[NX];
  const int16_t* xh[NX];
  for (int j = 0; j < NX; ++j) xq[j] = x[j]->q.data(), xd[j] = x[j]->d.data(), xh[j] = x[j]->half16.data();
  __m512 acc[R][NX];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NX; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // unrolled: the sums stay in registers
      const uint8_t* wb = w + r * row_bytes + b * 210;
      const float d = f16(wb + 208);
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192)));
      const __m512i sc16 = _mm512_castsi256_si512(sc);
      __m512i ii[NX];
      for (int j = 0; j < NX; ++j) ii[j] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i l = _mm512_loadu_si512(wb + 64 * h);
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * h)));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh_lo), m2), 4)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, sh_hi), m2), 4))};
        for (int k = 0; k < 2; ++k) {
          const __m512i s = _mm512_permutexvar_epi16(_mm512_load_si512(ln.idx[2 * h + k]), sc16);
          for (int j = 0; j < NX; ++j)
            ii[j] = _mm512_dpwssd_epi32(ii[j], _mm512_maddubs_epi16(q[k], _mm512_loadu_si512(xq[j] + b * 256 + 128 * h + 64 * k)), s);
        }
      }
      for (int j = 0; j < NX; ++j) {  // minus 32 x (scales . the input's 16-value sums)
        const __m256i t = _mm256_madd_epi16(sc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xh[j] + b * 16)));
        ii[j] = _mm512_sub_epi32(ii[j], _mm512_zextsi256_si512(_mm256_slli_epi32(t, 5)));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ii[j]), _mm512_set1_ps(d * xd[j][b]), acc[r][j]);
      }
    }
  }
  reduce_all<R, NX>(acc, out);
}

// Q8_0 with AVX-512 VNNI: two blocks (64 values) per multiply, 8 blocks' scales in one vector. The weights go in
// offset by 128 (w ^ 0x80, unsigned) and the products start from -128 x the input's sum per lane (QRow::off8), so
// each lane's int32 is the signed product exactly.
template <int R, int NX>
TS_AVX512 __attribute__((always_inline)) inline void rows_q8_0_avx512(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, float* out) {
  constexpr int64_t BB = 34;
  alignas(64) static const int32_t lanes[4][16] = {  // lanes of pair p's products -> their block's scale
      {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
      {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq[NX];
  const float* xd[NX];
  const int32_t* xo[NX];
  for (int j = 0; j < NX; ++j) xq[j] = x[j]->q.data(), xd[j] = x[j]->d.data(), xo[j] = x[j]->off8.data();
  __m512 acc[R][NX];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NX; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // unrolled: the sums stay in registers
      const uint8_t* wb = w + r * row_bytes + b * BB;
      alignas(16) uint16_t dh[8];
      for (int k = 0; k < 8; ++k) std::memcpy(&dh[k], wb + k * BB, 2);
      const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
      __m512 s[NX];
      for (int j = 0; j < NX; ++j) s[j] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(xd[j] + b)));
      for (int p = 0; p < 4; ++p) {
        const uint8_t* blk = wb + 2 * p * BB;
        const __m512i u = _mm512_xor_si512(flip, _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BB + 2)), 1));
        const __m512i idx = _mm512_load_si512(lanes[p]);
        for (int j = 0; j < NX; ++j) {
          const int64_t v = (b + 2 * p) * 32;
          const __m512i i = _mm512_dpbusd_epi32(_mm512_loadu_si512(xo[j] + v / 4), u, _mm512_loadu_si512(xq[j] + v));
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(idx, s[j]), acc[r][j]);
        }
      }
    }
  }
  finish_rows<Fmt::Q8_0, R, NX>(acc, w, row_bytes, b, nb, x, out);
}

// Q4_0 with AVX-512 VBMI + VNNI: 8 blocks (144 bytes) per step. Byte permutes gather the nibbles of 4 + 4 blocks
// out of the 18-byte blocks (and a word permute their 8 scales), so the products run 64 values at a time against
// the input in q4_0_layout, with no per-block work.
struct Q40Index {
  alignas(64) uint8_t lo4[64];   // from bytes [0, 128) of the group: blocks 0..3's 16 nibble bytes
  alignas(64) uint8_t hi4[64];   // from bytes [64, 192): blocks 4..7's
  alignas(64) uint16_t scale[32];  // words [0, 64): the 8 scales (word 9k)
  alignas(64) int32_t lane[2][16];  // product lane -> its block's scale (4 lanes per block)
};

inline const Q40Index& q40_index() {
  static const Q40Index t = [] {
    Q40Index x{};
    for (int j = 0; j < 64; ++j) {
      x.lo4[j] = static_cast<uint8_t>(18 * (j / 16) + 2 + j % 16);
      x.hi4[j] = static_cast<uint8_t>(18 * (j / 16 + 4) + 2 + j % 16 - 64);
    }
    for (int k = 0; k < 8; ++k) x.scale[k] = static_cast<uint16_t>(9 * k);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 16; ++l) x.lane[h][l] = 4 * h + l / 4;
    return x;
  }();
  return t;
}

template <int R, int NX>
TS_VBMI __attribute__((always_inline)) inline void rows_q4_0_avx512(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, float* out) {
  const Q40Index& ix = q40_index();
  const __m512i lo4 = _mm512_load_si512(ix.lo4), hi4 = _mm512_load_si512(ix.hi4);
  const __m512i sci = _mm512_load_si512(ix.scale);
  const __m512i la = _mm512_load_si512(ix.lane[0]), lb = _mm512_load_si512(ix.lane[1]);
  const __m512i low = _mm512_set1_epi8(15);
  const int8_t* xp[NX];
  const int32_t* xo[NX];
  const float* xd[NX];
  for (int j = 0; j < NX; ++j) xp[j] = x[j]->qp.data(), xo[j] = x[j]->off.data(), xd[j] = x[j]->d.data();
  __m512 acc[R][NX];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NX; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // unrolled: the sums stay in registers
      const uint8_t* g = w + r * row_bytes + b * 18;
      const __m512i A = _mm512_loadu_si512(g), B = _mm512_loadu_si512(g + 64);
      const __m512i D = _mm512_maskz_loadu_epi8(0xFFFFull, g + 128);  // the group's last 16 bytes only
      const __m256 dw = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(A, sci, B)));
      const __m512i va = _mm512_permutex2var_epi8(A, lo4, B), vb = _mm512_permutex2var_epi8(B, hi4, D);
      const __m512i a_lo = _mm512_and_si512(va, low), a_hi = _mm512_and_si512(_mm512_srli_epi16(va, 4), low);
      const __m512i b_lo = _mm512_and_si512(vb, low), b_hi = _mm512_and_si512(_mm512_srli_epi16(vb, 4), low);
      for (int j = 0; j < NX; ++j) {
        const int8_t* q = xp[j] + b * 32;
        const int32_t* o = xo[j] + b * 4;
        __m512i ia = _mm512_dpbusd_epi32(_mm512_loadu_si512(o), a_lo, _mm512_loadu_si512(q));
        ia = _mm512_dpbusd_epi32(ia, a_hi, _mm512_loadu_si512(q + 64));
        __m512i ib = _mm512_dpbusd_epi32(_mm512_loadu_si512(o + 16), b_lo, _mm512_loadu_si512(q + 128));
        ib = _mm512_dpbusd_epi32(ib, b_hi, _mm512_loadu_si512(q + 192));
        const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(xd[j] + b)));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_permutexvar_ps(la, s), acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_permutexvar_ps(lb, s), acc[r][j]);
      }
    }
  }
  finish_rows<Fmt::Q4_0, R, NX>(acc, w, row_bytes, b, nb, x, out);
}

// The kernel's results t[k * NX + j] (weight row o + k, input row j) into y[j * out + o + k].
template <int R, int NX>
__attribute__((always_inline)) inline void put_rows(const float* t, float* y, int64_t out, int64_t o) {
  for (int k = 0; k < R; ++k)
    for (int j = 0; j < NX; ++j) y[j * out + o + k] = t[k * NX + j];
}

#define TS_RANGE_STEP(KERNEL, R)                                                                                \
  for (int64_t j = 0; j + 1 < m; j += 2)                                                                        \
    KERNEL<R, 2>(w + o * row_bytes, row_bytes, nb, x + j, t), put_rows<R, 2>(t, y + j * out, out, o);           \
  if (m % 2) KERNEL<R, 1>(w + o * row_bytes, row_bytes, nb, x + m - 1, t), put_rows<R, 1>(t, y + (m - 1) * out, out, o);
// NAME: y[j * out + o] = weight row o . input row x[j] for o in [o0, o1) and j < m, 4 weight rows per step against
// the input rows in pairs, the kernel inlined (one loop per format and target). Before each step the 4 rows about
// 2 x PREFETCH_BYTES further on are prefetched: the hardware prefetcher alone left these kernels, which read 4
// rows side by side, at 12-20 GB/s on matrices larger than the cache (a one-row AVX2 loop: 29-40 GB/s). Into L2
// (prefetch_l2), not L1: with 2 or more input rows a tile takes longer than its prefetch, and prefetches into L1
// stalled the loop (65536 x 2048 Q4_K, 4 input rows: 8.2-11.5 ms into L1, 5.1-5.3 ms into L2; 2 rows 3.3-4.4 vs
// 3.0-3.1; Q4_0 the same; one row and matrices in the cache unchanged). Rows
// longer than LONG_ROW bytes go one at a time for up to SINGLE input rows: streamed from memory, 4 such rows side
// by side stayed slow even with the prefetch (2048 x 6144 Q4_K: 21 GB/s, one at a time 30; 32768 x 2048 Q6_K / Q8_0,
// rows of 1680 / 2176 bytes: 1.4 / 1.6 ms for one input row against 1.9-3.1 four at a time, and for Q6_K up to 16
// input rows, Q8_0 up to 4, before 4 at a time wins), while shorter ones (Q4_K / Q4_0 with 2048 columns: 1152
// bytes) stream faster 4 at a time (31-42 GB/s against 22-30), as every row does from the cache. A row's result is
// the same either way (see above).
constexpr int64_t LONG_ROW = 1152;
#define TS_RANGE(TARGET, NAME, KERNEL, SINGLE)                                                                  \
  TARGET void NAME(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, int64_t m, int64_t o0, \
                   int64_t o1, float* y, int64_t out) {                                                        \
    float t[8];                                                                                                \
    const int64_t tile = 4 * row_bytes, ahead = 4 * std::max<int64_t>(1, (2 * PREFETCH_BYTES + tile - 1) / tile); \
    int64_t o = o0;                                                                                            \
    const bool single = m <= SINGLE && row_bytes > LONG_ROW;                                                   \
    for (; !single && o + 4 <= o1; o += 4) {                                                                   \
      if (o + ahead + 4 <= o1) {                                                                               \
        prefetch_l2(reinterpret_cast<const char*>(w + (o + ahead) * row_bytes), tile);                          \
      }                                                                                                        \
      TS_RANGE_STEP(KERNEL, 4)                                                                                 \
    }                                                                                                          \
    for (; o < o1; ++o) { TS_RANGE_STEP(KERNEL, 1) }                                                           \
  }
TS_RANGE(TS_AVX512, range_q4k_avx512, rows_q4k_avx512, 1)
TS_RANGE(TS_AVX512, range_q5k_avx512, rows_q5k_avx512, 1)
TS_RANGE(TS_AVX512, range_q8_0_avx512, rows_q8_0_avx512, 4)
TS_RANGE(TS_AVX512, range_q6k_avx512, rows_q6k_avx512, 16)
TS_RANGE(TS_VBMI, range_q4_0_avx512, rows_q4_0_avx512, 1)
#undef TS_RANGE_STEP
#undef TS_RANGE

// AVX-512 paths when the CPU has AVX-512 BW + VL + VNNI (Cascade Lake, Ice Lake, Zen 4 and later; Q4_0's and the
// interleaved formats' also VBMI + GFNI: Ice Lake, Zen 4 and later), unless TURBOSPEC_NO_AVX512 is set; AVX2
// otherwise.
inline bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                          !std::getenv("TURBOSPEC_NO_AVX512");
  return yes;
}

inline bool use_vbmi() {  // (TS_VBMI code may also use GFNI: every CPU with AVX-512 VBMI but Cannon Lake has it)
  static const bool yes = use_avx512() && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  return yes;
}

// x (in values) quantized for products with format f's weights on this CPU: quantize_row, plus the AVX-512
// kernels' input layouts.
inline void prepare_row(const float* x, int64_t in, Fmt f, QRow& r) {
  quantize_row(x, in, f == Fmt::Q4_0X8 || f == Fmt::Q8_0X8 ? 32 : block_values(f), r);  // a scale per 32-value block
  if (f == Fmt::Q4_0 && use_vbmi()) q4_0_layout(r, in);
  if ((f == Fmt::Q4_K || f == Fmt::Q5_K) && use_avx512()) q4_k_layout(r, in);
  if (f == Fmt::Q8_0 && use_avx512()) q8_0_layout(r, in);
}

// fn(integral_constant<Fmt, f>): a packed format as a compile-time value.
template <typename Fn>
inline void by_fmt(Fmt f, Fn&& fn) {
  switch (f) {
    case Fmt::Q8_0: fn(std::integral_constant<Fmt, Fmt::Q8_0>{}); break;
    case Fmt::Q4_0: fn(std::integral_constant<Fmt, Fmt::Q4_0>{}); break;
    case Fmt::Q4_K: fn(std::integral_constant<Fmt, Fmt::Q4_K>{}); break;
    case Fmt::Q5_K: fn(std::integral_constant<Fmt, Fmt::Q5_K>{}); break;
    case Fmt::Q6_K: fn(std::integral_constant<Fmt, Fmt::Q6_K>{}); break;
    case Fmt::Q8_0X8:
    case Fmt::Q4_0X8:
    case Fmt::Q4_KX8:
    case Fmt::Q5_KX8:
    case Fmt::Q6_KX8: TORCH_CHECK(false, "interleaved weights multiply through product() only");
  }
}

// Whether format F has an AVX-512 kernel on this CPU (Q4_0's also needs VBMI).
template <Fmt F>
inline bool avx512_rows() {
  return use_avx512() && (F != Fmt::Q4_0 || use_vbmi());
}

// y[j * out + o] = weight row o . input row x[j] for o in [o0, o1) and j < m: the AVX-512 kernels where `avx512`
// (avx512_rows), else one row at a time against the input rows in pairs (AVX2).
template <Fmt F>
inline void dot_range(const uint8_t* w, int64_t row_bytes, int64_t nb, const QRow* const* x, int64_t m, int64_t o0,
                      int64_t o1, float* y, int64_t out, bool avx512) {
  if (avx512) {
    if constexpr (F == Fmt::Q4_K) range_q4k_avx512(w, row_bytes, nb, x, m, o0, o1, y, out);
    else if constexpr (F == Fmt::Q8_0) range_q8_0_avx512(w, row_bytes, nb, x, m, o0, o1, y, out);
    else if constexpr (F == Fmt::Q4_0) range_q4_0_avx512(w, row_bytes, nb, x, m, o0, o1, y, out);
    else if constexpr (F == Fmt::Q5_K) range_q5k_avx512(w, row_bytes, nb, x, m, o0, o1, y, out);
    else range_q6k_avx512(w, row_bytes, nb, x, m, o0, o1, y, out);
    return;
  }
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t j = 0; j < m; j += 2) {
      const int nx = j + 1 < m ? 2 : 1;
      float t[2];
      row_dot<F>(w + o * row_bytes, nb, x[j], nx > 1 ? x[j + 1] : nullptr, nx, t);
      for (int k = 0; k < nx; ++k) y[(j + k) * out + o] = t[k];
    }
}

// y[m, out] = x[m, in] . W^T for a packed W (float32 x and y), each thread a range of weight rows.
template <Fmt F>
void run(const uint8_t* w, int64_t nb, int64_t row_bytes, const std::vector<QRow>& xq, float* y, int64_t m,
         int64_t out) {
  const bool avx512 = avx512_rows<F>();
  std::vector<const QRow*> x(m);
  for (int64_t r = 0; r < m; ++r) x[r] = &xq[r];
  at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
    dot_range<F>(w, row_bytes, nb, x.data(), m, o0, o1, y, out, avx512);
  });
}

// Rows [0, n * rows_each) of the products of pairs p = 0..n-1: y[p * rows_each + o] = row o of w[p] . x[p], in one
// parallel region for all pairs (the experts of a MoE layer). `second` (may be null) gives the matrix of rows
// [rows_first, rows_each) of each pair (an expert's up rows after its gate rows).
template <Fmt F>
void pair_products(const std::vector<const uint8_t*>& w, const std::vector<const uint8_t*>* second, int64_t rows_first,
                   int64_t rows_each, int64_t nb, int64_t row_bytes, const std::vector<const QRow*>& x, float* y) {
  const bool avx512 = avx512_rows<F>();
  const int64_t n = static_cast<int64_t>(w.size());
  at::parallel_for(0, n * rows_each, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t p = i / rows_each, o = i % rows_each;
      const uint8_t* wr = o < rows_first ? w[p] + o * row_bytes : (*second)[p] + (o - rows_first) * row_bytes;
      dot_range<F>(wr, row_bytes, nb, &x[p], 1, 0, 1, &y[i], 1, avx512);
    }
  });
}

// The routed experts of a mixture-of-experts layer for a few rows x [m, hidden] (float32): pairs p = (row[p],
// gate[p], up[p], down[p], weight[p]) give out[row] = sum over the row's pairs, in the order given, of weight x
// down(silu(gate . x) * up . x), all in float32 [m, hidden]. Gate and up matrices share one packed format, the down
// matrices another. Two parallel regions for all pairs (gate and up rows, then down rows) instead of three per
// expert; each pair's arithmetic depends on its own row only, so a batch's rows equal the rows alone.
void moe_experts(const float* x, int64_t m, int64_t hidden, const std::vector<torch::Tensor>& gate,
                 const std::vector<torch::Tensor>& up, const std::vector<torch::Tensor>& down,
                 const std::vector<int64_t>& row, const std::vector<double>& weight, float* out) {
  const int64_t n = static_cast<int64_t>(gate.size()), inter = gate[0].size(0);
  const Fmt fg = fmt_of(gate[0]), fd = fmt_of(down[0]);
  std::vector<QRow> xq(m);
  for (int64_t r = 0; r < m; ++r) prepare_row(x + r * hidden, hidden, fg, xq[r]);
  std::vector<const uint8_t*> wg(n), wu(n), wd(n);
  std::vector<const QRow*> xs(n);
  for (int64_t p = 0; p < n; ++p) {
    wg[p] = gate[p].data_ptr<uint8_t>();
    wu[p] = up[p].data_ptr<uint8_t>();
    wd[p] = down[p].data_ptr<uint8_t>();
    xs[p] = &xq[row[p]];
  }
  std::vector<float> gu(n * 2 * inter);
  by_fmt(fg, [&](auto f) {
    pair_products<decltype(f)::value>(wg, &wu, inter, 2 * inter, gate[0].size(1), gate[0].size(1) * gate[0].size(2),
                                      xs, gu.data());
  });
  std::vector<QRow> hq(n);
  std::vector<float> h(inter);
  for (int64_t p = 0; p < n; ++p) {
    const float* g = &gu[p * 2 * inter];
    silu_all(g, h.data(), inter);
    for (int64_t i = 0; i < inter; ++i) h[i] *= g[inter + i];
    prepare_row(h.data(), inter, fd, hq[p]);
    xs[p] = &hq[p];
  }
  std::vector<float> y(n * hidden);
  by_fmt(fd, [&](auto f) {
    pair_products<decltype(f)::value>(wd, nullptr, hidden, hidden, down[0].size(1), down[0].size(1) * down[0].size(2),
                                      xs, y.data());
  });
  std::fill(out, out + m * hidden, 0.f);
  for (int64_t p = 0; p < n; ++p) {
    const float wp = static_cast<float>(weight[p]);
    float* o = out + row[p] * hidden;
    for (int64_t i = 0; i < hidden; ++i) o[i] += wp * y[p * hidden + i];
  }
}

void product(const torch::Tensor& w, const float* x, float* y, int64_t m) {
  const Fmt f = fmt_of(w);
  const int64_t nb = w.size(1), out = w.size(0) * rows_per(f), qk = block_values(f), in = nb * qk,
                row_bytes = nb * w.size(2);
  thread_local std::vector<QRow> xq;  // reused: no allocation per product once warm
  if (static_cast<int64_t>(xq.size()) < m) xq.resize(m);
  std::vector<QRow>& rows = xq;  // (the threads below fill the caller's rows)
  at::parallel_for(0, m, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) prepare_row(x + r * in, in, f, rows[r]);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (interleaved(f)) {  // groups of 8 rows per thread range
    std::vector<const QRow*> xs(m);
    for (int64_t r = 0; r < m; ++r) xs[r] = &xq[r];
    const int64_t bytes = w.size(2);
    const bool vbmi = use_vbmi();
    at::parallel_for(0, w.size(0), 8, [&](int64_t g0, int64_t g1) {
      if (f == Fmt::Q4_KX8 && vbmi) range_x8<Fmt::Q4_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q4_KX8) range_x8_avx2<Fmt::Q4_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q5_KX8 && vbmi) range_x8<Fmt::Q5_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q5_KX8) range_x8_avx2<Fmt::Q5_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q6_KX8 && vbmi) range_x8<Fmt::Q6_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q6_KX8) range_x8_avx2<Fmt::Q6_KX8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q8_0X8 && vbmi) range_x8<Fmt::Q8_0X8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (f == Fmt::Q8_0X8) range_x8_avx2<Fmt::Q8_0X8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else if (vbmi) range_x8<Fmt::Q4_0X8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
      else range_x8_avx2<Fmt::Q4_0X8>(wp, nb, bytes, xs.data(), m, g0, g1, y, out);
    });
    return;
  }
  by_fmt(f, [&](auto fc) { run<decltype(fc)::value>(wp, nb, row_bytes, xq, y, m, out); });
}

// Weight rows [r0, r1) of packed w as float32, into y (row-major, in values per row), or as bfloat16 into y16 when
// it is given (each row rounded from float32 by row_from_floats, as torch rounds: the same bits as converting y).
// The arithmetic is the gguf package's: Q8_0 d * q, Q4_0 d * (q - 8), Q4_K (d * sc) * q - (dmin * m), each product
// rounded to float32.
__attribute__((optimize("fp-contract=off")))  // multiply, then subtract: two roundings, as numpy
void dequantize_rows(const torch::Tensor& w, int64_t r0, int64_t r1, float* y, at::BFloat16* y16 = nullptr) {
  const Fmt fw = fmt_of(w);  // an interleaved format's rows go as its blocks' format, one block at a time
  const Fmt f = row_fmt(fw);
  const int64_t nb = w.size(1) * block_values(fw) / block_values(f), bb = w.size(2), in = nb * block_values(f);
  const uint8_t* base = w.data_ptr<uint8_t>();
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t e) {
    alignas(64) uint8_t blk[256];
    std::vector<float> row(y16 ? in : 0);  // one row at a time in float32 (in the cache), then rounded
    for (int64_t r = a; r < e; ++r) {
      float* yr = y16 ? row.data() : y + (r - r0) * in;
      for (int64_t b = 0; b < nb; ++b) {
        if (fw == Fmt::Q6_KX8) {  // row r % 8's values straight from the interleaved block, as the Q6_K path below
          const uint8_t* o = base + ((r / 8) * nb + b) * bb;
          const int i = 8 * static_cast<int>(r % 8);
          const float d = f16(o + 2 * (r % 8));
          for (int n = 0; n < 16; ++n) {
            uint64_t nib, top;
            std::memcpy(&nib, o + x8_6_nib(n) + i, 8);
            std::memcpy(&top, o + x8_6_top(n / 2) + i, 8);
            top >>= 4 * (n % 2);
            const uint64_t m4 = 0x0F0F0F0F0F0F0F0FULL, m2 = 0x0303030303030303ULL;
            int lo, hi;
            x8_6_values(n, i, lo, hi);
            const uint64_t q[2] = {(nib & m4) | ((top & m2) << 4), ((nib >> 4) & m4) | (((top >> 2) & m2) << 4)};
            const int v0[2] = {lo, hi};
            for (int t = 0; t < 2; ++t) {
              const __m256 ds = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(o[16 + 8 * (v0[t] / 16) + r % 8])));
              const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(q[t]))), _mm256_set1_epi32(32));
              _mm256_storeu_ps(yr + b * 256 + v0[t], _mm256_mul_ps(ds, _mm256_cvtepi32_ps(qi)));
            }
          }
          continue;
        }
        const uint8_t* p = blk;
        if (fw == Fmt::Q4_KX8)  // row r % 8's Q4_K block b
          q4k_block(base + ((r / 8) * nb + b) * bb, static_cast<int>(r % 8), blk);
        else if (fw == Fmt::Q5_KX8)  // row r % 8's Q5_K block b
          q5k_block(base + ((r / 8) * nb + b) * bb, static_cast<int>(r % 8), blk);
        else if (fw == Fmt::Q4_0X8)  // row r % 8's Q4_0 block b
          q40_block(base + ((r / 8) * w.size(1) + b / 4) * bb, static_cast<int>(b % 4), static_cast<int>(r % 8), blk);
        else if (fw == Fmt::Q8_0X8)  // row r % 8's Q8_0 block b
          q80_block(base + ((r / 8) * w.size(1) + b / 4) * bb, static_cast<int>(b % 4), static_cast<int>(r % 8), blk);
        else
          p = base + (r * nb + b) * bb;
        if (f == Fmt::Q8_0) {
          const __m256 d = _mm256_set1_ps(f16(p));
          for (int i = 0; i < 32; i += 8) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + i));
            _mm256_storeu_ps(yr + b * 32 + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
          }
        } else if (f == Fmt::Q4_0) {
          const __m256 d = _mm256_set1_ps(f16(p));
          const __m256i eight = _mm256_set1_epi32(8), m15 = _mm256_set1_epi32(15);
          for (int i = 0; i < 16; i += 8) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + i)));
            const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(q, m15), eight);
            const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
            _mm256_storeu_ps(yr + b * 32 + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
            _mm256_storeu_ps(yr + b * 32 + 16 + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
          }
        } else if (f == Fmt::Q6_K) {  // (d * sc) * (q - 32), as the gguf package
          const float d = f16(p + 208);
          const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
          for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_unpack(p + 64 * h, p + 128 + 32 * h, q);
            for (int g = 0; g < 4; ++g) {
              alignas(32) uint8_t v[32];
              _mm256_store_si256(reinterpret_cast<__m256i*>(v), q[g]);
              const int v0 = 128 * h + 32 * g;
              for (int i = 0; i < 32; i += 8) {
                const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[(v0 + i) / 16]));
                const __m256i qi = _mm256_sub_epi32(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + i))), _mm256_set1_epi32(32));
                _mm256_storeu_ps(yr + b * 256 + v0 + i, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(qi)));
              }
            }
          }
        } else {  // Q4_K / Q5_K: (d * sc) * q - (dmin * m)
          const bool q5 = f == Fmt::Q5_K;
          const float d = f16(p), dmin = f16(p + 2);
          for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min(p + 4, j, sc, m);
            const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc)), dm = _mm256_set1_ps(dmin * static_cast<float>(m));
            const uint8_t* qs = p + (q5 ? 48 : 16) + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            const __m128i sh = _mm_cvtsi32_si128(shift), hs = _mm_cvtsi32_si128(j);
            for (int i = 0; i < 32; i += 8) {
              __m256i q = _mm256_and_si256(
                  _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + i))), sh),
                  _mm256_set1_epi32(15));
              if (q5)  // + 16 x bit j of qh[i..i+8)
                q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16 + i))), hs), _mm256_set1_epi32(1)), 4));
              const __m256 v = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q));
              _mm256_storeu_ps(yr + b * 256 + 32 * j + i, _mm256_sub_ps(v, dm));
            }
          }
        }
      }
      if (y16) row_from_floats(yr, y16 + (r - r0) * in, in);
    }
  });
}

}  // namespace packed

// Columns of a weight: its second size, or blocks x values per block when packed.
inline int64_t in_features(const torch::Tensor& w) {
  return packed::is_packed(w) ? w.size(1) * packed::block_values(packed::fmt_of(w)) : w.size(1);
}

// Rows of a weight (output features): its first size, times 8 for the interleaved Q4_K.
inline int64_t out_features(const torch::Tensor& w) {
  return packed::is_packed(w) ? w.size(0) * packed::rows_per(packed::fmt_of(w)) : w.size(0);
}

torch::Tensor dequantize_packed(torch::Tensor w, int64_t r0, int64_t r1) {
  TORCH_CHECK(packed::is_packed(w) && w.is_contiguous() && 0 <= r0 && r0 <= r1 && r1 <= out_features(w), "bad packed weight");
  auto y = torch::empty({r1 - r0, in_features(w)}, torch::kFloat);
  packed::dequantize_rows(w, r0, r1, y.data_ptr<float>());
  return y;
}

// x [.., in] . W^T (+ b) for a packed W and any number of rows: the int8 kernel for up to `skinny` rows (any
// number for int8_rows_any), else tiles of weight rows dequantized to float32 times torch's GEMM (for a bfloat16 x the tiles are rounded to
// bfloat16 and the GEMM is bfloat16's, ~2.5x faster on CPUs with AVX-512 BF16; the rounding, 2^-9 of a weight, is
// below the int8 rounding of the inputs in decode).
// Whether 16-bit activations multiply w through the int8 kernel at any row count (prefill too): interleaved Q4_0 /
// Q4_K / Q5_K, whose int8 kernels beat bf16 tiles and oneDNN's GEMM at 64-512 rows (the 1.94B shape's 12288 x 2048,
// 2 threads: Q4_K 1.35-2.1x, Q4_0 1.3-1.9x, Q5_K 1.0-1.6x; Q6_K_X8 and Q8_0 lose beyond 64 rows). float32
// activations keep the tiles: exact dequantized weights, no int8 rounding of the inputs.
inline bool int8_rows_any(const torch::Tensor& w, const torch::Tensor& x) {
  const packed::Fmt f = packed::fmt_of(w);
  return x.scalar_type() != torch::kFloat && (f == packed::Fmt::Q8_0X8 || f == packed::Fmt::Q4_0X8 ||
                                              f == packed::Fmt::Q4_KX8 || f == packed::Fmt::Q5_KX8);
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t skinny) {
  TORCH_CHECK(packed::is_packed(w) && w.is_contiguous(), "packed weight expected");
  const int64_t in = in_features(w), out = out_features(w);
  TORCH_CHECK(x.size(-1) == in, "shape mismatch");
  auto shape = x.sizes().vec();
  shape.back() = out;
  const int64_t m = x.numel() / in;
  if (m <= skinny || int8_rows_any(w, x)) {
    auto xs = x.reshape({-1, in}).to(torch::kFloat).contiguous();
    auto y = torch::empty({m, out}, xs.options());
    packed::product(w, xs.data_ptr<float>(), y.data_ptr<float>(), m);
    if (bias.has_value()) y.add_(bias->to(torch::kFloat));
    return y.to(x.scalar_type()).reshape(shape);
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto xs = x.reshape({-1, in}).to(bf16 ? torch::kBFloat16 : torch::kFloat).contiguous();
  auto y = torch::empty({m, out}, xs.options());
  const int64_t tile = std::max<int64_t>(64, (int64_t(4) << 20) / (4 * in));  // ~4 MB of float32 rows
  auto buf = torch::empty({std::min(tile, out), in}, bf16 ? torch::kBFloat16 : torch::kFloat);
  for (int64_t o = 0; o < out; o += tile) {
    const int64_t n = std::min(tile, out - o);
    auto t = buf.narrow(0, 0, n);
    if (bf16)  // rounded to bfloat16 row by row as they are dequantized (no float32 tile in memory)
      packed::dequantize_rows(w, o, o + n, nullptr, t.data_ptr<at::BFloat16>());
    else
      packed::dequantize_rows(w, o, o + n, t.data_ptr<float>());
    y.narrow(1, o, n).copy_(at::mm(xs, t.t()));
  }
  if (bias.has_value()) y.add_(bias->to(y.scalar_type()));
  return y.to(x.scalar_type()).reshape(shape);
}

// x [m, hidden] (any float dtype) through the routed experts of a MoE layer (packed::moe_experts) -> float32.
torch::Tensor moe_experts(torch::Tensor x, std::vector<torch::Tensor> gate, std::vector<torch::Tensor> up,
                          std::vector<torch::Tensor> down, std::vector<int64_t> row, std::vector<double> weight) {
  const int64_t n = static_cast<int64_t>(gate.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(up.size()) == n && static_cast<int64_t>(down.size()) == n &&
              static_cast<int64_t>(row.size()) == n && static_cast<int64_t>(weight.size()) == n, "moe_experts: lists differ");
  auto xs = x.reshape({-1, x.size(-1)}).to(torch::kFloat).contiguous();
  const int64_t m = xs.size(0), hidden = xs.size(1);
  const int64_t inter = gate[0].size(0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(packed::is_packed(gate[p]) && packed::is_packed(up[p]) && packed::is_packed(down[p]) &&
                gate[p].is_contiguous() && up[p].is_contiguous() && down[p].is_contiguous(), "moe_experts: packed weights");
    TORCH_CHECK(gate[p].sizes() == gate[0].sizes() && up[p].sizes() == gate[0].sizes() &&
                down[p].sizes() == down[0].sizes(), "moe_experts: experts of different shapes or formats");
    TORCH_CHECK(0 <= row[p] && row[p] < m, "moe_experts: row out of range");
  }
  TORCH_CHECK(in_features(gate[0]) == hidden && down[0].size(0) == hidden && in_features(down[0]) == inter,
              "moe_experts: shape mismatch");
  auto out = torch::empty({m, hidden}, torch::kFloat);
  packed::moe_experts(xs.data_ptr<float>(), m, hidden, gate, up, down, row, weight, out.data_ptr<float>());
  return out;
}

// Rows `ids` of a packed table (an embedding) as float32 [n, in].
torch::Tensor packed_rows(torch::Tensor w, torch::Tensor ids) {
  TORCH_CHECK(packed::is_packed(w) && w.is_contiguous(), "packed weight expected");
  auto idc = ids.reshape({-1}).to(torch::kLong).contiguous();
  const int64_t n = idc.size(0), in = in_features(w);
  auto y = torch::empty({n, in}, torch::kFloat);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= ip[i] && ip[i] < out_features(w), "index out of range");
    packed::dequantize_rows(w, ip[i], ip[i] + 1, y.data_ptr<float>() + i * in);
  }
  return y;
}

// Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K weights [out, blocks, 34 / 18 / 144 / 176 / 210] rearranged in place into 8-row
// interleaved blocks (packed::x8_8_block, x8_0_block, x8_k_block, x8_5_block, x8_6_block), returned as the [out / 8,
// blocks / 4 (Q8_0, Q4_0) or blocks, 1088 / 576 / 1152 / 1408 / 1680] view of the same memory. The caller owns the memory (nothing else reads it in the old
// layout).
torch::Tensor interleave_(torch::Tensor w) {
  TORCH_CHECK(packed::is_packed(w) && w.is_contiguous() && w.size(0) % 8 == 0 &&
              (w.size(2) == 144 || w.size(2) == 176 || w.size(2) == 210 ||
               ((w.size(2) == 18 || w.size(2) == 34) && w.size(1) % 4 == 0)),
              "interleave_: contiguous Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K blocks, rows in whole groups of 8 (Q8_0 / Q4_0: "
              "blocks in groups of 4)");
  const int64_t bs = w.size(2), groups = w.size(0) / 8, nb = w.size(1), bytes = 8 * nb * bs;
  const int64_t per = bs == 18 || bs == 34 ? 4 : 1, out_blocks = nb / per, out_bytes = 8 * per * bs;  // per block
  uint8_t* base = w.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> tmp(bytes);
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* p = base + g * bytes;
      std::memcpy(tmp.data(), p, bytes);
      for (int64_t c = 0; c < out_blocks; ++c) {
        const uint8_t* blk[8];
        for (int r = 0; r < 8; ++r) blk[r] = tmp.data() + (r * nb + c * per) * bs;
        if (bs == 144) packed::x8_k_block(blk, p + c * out_bytes);
        else if (bs == 176) packed::x8_5_block(blk, p + c * out_bytes);
        else if (bs == 210) packed::x8_6_block(blk, p + c * out_bytes);
        else if (bs == 34) packed::x8_8_block(blk, p + c * out_bytes);
        else packed::x8_0_block(blk, p + c * out_bytes);
      }
    }
  });
  return w.view({groups, out_blocks, out_bytes});
}

// Rows `ids` of a packed weight as ggml blocks [n, blocks, block bytes]: an interleaved format's rows as its rows'
// blocks (packed::q80_block, q40_block, q4k_block, q5k_block, q6k_block), any other format's rows as they are.
torch::Tensor packed_blocks(torch::Tensor w, torch::Tensor ids) {
  TORCH_CHECK(packed::is_packed(w) && w.is_contiguous(), "packed weight expected");
  auto idc = ids.reshape({-1}).to(torch::kLong).contiguous();
  const packed::Fmt f = packed::fmt_of(w);
  if (!packed::interleaved(f)) return w.index_select(0, idc);
  const bool q40 = f == packed::Fmt::Q4_0X8 || f == packed::Fmt::Q8_0X8;  // 4 blocks per interleaved block
  const int64_t n = idc.size(0), per = q40 ? 4 : 1, nb = w.size(1) * per, bb = w.size(2) / (8 * per);
  auto y = torch::empty({n, nb, bb}, torch::kByte);
  const int64_t* ip = idc.data_ptr<int64_t>();
  const uint8_t* base = w.data_ptr<uint8_t>();
  uint8_t* yp = y.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= ip[i] && ip[i] < out_features(w), "index out of range");
    const int r = static_cast<int>(ip[i] % 8);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = base + ((ip[i] / 8) * w.size(1) + b / per) * w.size(2);
      uint8_t* dst = yp + (i * nb + b) * bb;
      if (f == packed::Fmt::Q4_KX8) packed::q4k_block(p, r, dst);
      else if (f == packed::Fmt::Q5_KX8) packed::q5k_block(p, r, dst);
      else if (f == packed::Fmt::Q6_KX8) packed::q6k_block(p, r, dst);
      else if (f == packed::Fmt::Q8_0X8) packed::q80_block(p, static_cast<int>(b % 4), r, dst);
      else packed::q40_block(p, static_cast<int>(b % 4), r, dst);
    }
  }
  return y;
}

// Whether Linear interleaves packed weights: unless TURBOSPEC_NO_INTERLEAVE is set (the kernels:
// AVX-512 VNNI + VBMI + GFNI where the CPU has them, AVX2 otherwise).
bool interleaved_here() { return !std::getenv("TURBOSPEC_NO_INTERLEAVE"); }

// ---- Quantization of float rows into ggml blocks, as llama.cpp's reference quantizers (quantize_row_*_ref):
// the same weights give the same bytes. Every step is written out (no fused multiply-add), as the C reference.

namespace packed {

inline uint16_t to_f16(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
inline void put_f16(uint8_t* p, float v) {
  const uint16_t h = to_f16(v);
  std::memcpy(p, &h, 2);
}
inline int nearest_int(float v) { return static_cast<int>(std::nearbyint(v)); }  // ties to even, as ggml's trick

void quant_q8_0(const float* x, uint8_t* y) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  put_f16(y, d);
  for (int i = 0; i < 32; ++i) y[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[i] * id)));
}

__attribute__((optimize("fp-contract=off")))
void quant_q4_0(const float* x, uint8_t* y) {
  float amax = 0.f, max = 0.f;
  for (int i = 0; i < 32; ++i)
    if (amax < std::fabs(x[i])) { amax = std::fabs(x[i]); max = x[i]; }
  const float d = max / -8.f, id = d != 0.f ? 1.f / d : 0.f;
  put_f16(y, d);
  for (int j = 0; j < 16; ++j) {
    const float x0 = x[j] * id, x1 = x[16 + j] * id;
    const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(x0 + 8.5f)));
    const int q1 = std::min(15, static_cast<int>(static_cast<int8_t>(x1 + 8.5f)));
    y[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
}

// ggml's make_qkx2_quants for 32 values (nmax 15, rmin -1, rdelta 0.1, 20 steps, squared error): the scale,
// with -min in *the_min and the levels in L.
__attribute__((optimize("fp-contract=off")))
float make_qkx2(const float* x, const float* w, uint8_t* L, float* the_min) {
  constexpr int n = 32, nmax = 15, nstep = 20;
  constexpr float rmin = -1.f, rdelta = 0.1f;
  uint8_t Laux[32];
  float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = diff * diff;
    best += w[i] * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = diff * diff;
        cur += w[i] * diff;
      }
      if (cur < best) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best = cur;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

__attribute__((optimize("fp-contract=off")))
void quant_q4_k(const float* x, uint8_t* y) {
  uint8_t L[256];
  float wts[32], mins[8], scales[8], max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) wts[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2(x + 32 * j, wts, L + 32 * j, &mins[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  uint8_t* sc = y + 4;
  std::memset(sc, 0, 12);
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = static_cast<uint8_t>(std::min(63, static_cast<int>(static_cast<uint8_t>(nearest_int(inv_scale * scales[j])))));
    const uint8_t lm = static_cast<uint8_t>(std::min(63, static_cast<int>(static_cast<uint8_t>(nearest_int(inv_min * mins[j])))));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  put_f16(y, max_scale / 63.f);
  put_f16(y + 2, max_min / 63.f);
  const float d_all = f16(y), dmin_all = f16(y + 2);
  for (int j = 0; j < 8; ++j) {
    int s, m;
    scale_min(sc, j, s, m);
    const float d = d_all * s;
    if (d == 0.f) continue;
    const float dm = dmin_all * m;
    for (int i = 0; i < 32; ++i) {
      const int l = nearest_int((x[32 * j + i] + dm) / d);
      L[32 * j + i] = static_cast<uint8_t>(std::max(0, std::min(15, l)));
    }
  }
  uint8_t* q = y + 16;
  for (int j = 0; j < 256; j += 64, q += 32)
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
}

}  // namespace packed

// w [out, in] (float32 / bfloat16 / float16) as packed blocks of `block_bytes` (34: Q8_0, 18: Q4_0, 144: Q4_K);
// one float32 row at a time, rows in parallel.
torch::Tensor quantize_packed(torch::Tensor w, int64_t block_bytes) {
  TORCH_CHECK(w.dim() == 2, "quantize: 2-D weight expected");
  auto wc = w.contiguous();
  const int64_t out = wc.size(0), in = wc.size(1);
  const int64_t qk = block_bytes == 144 ? 256 : 32;
  TORCH_CHECK(block_bytes == 34 || block_bytes == 18 || block_bytes == 144, "quantize: unknown block size");
  TORCH_CHECK(in % qk == 0, "quantize: ", in, " columns are not a multiple of the block size ", qk);
  const int64_t nb = in / qk;
  auto y = torch::empty({out, nb, block_bytes}, torch::kByte);
  uint8_t* yp = y.data_ptr<uint8_t>();
  by_dtype(wc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);  // by_dtype: gemv.cpp's float32 / bfloat16 / float16 dispatch
    const T* wp = wc.data_ptr<T>();
    at::parallel_for(0, out, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(in);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < in; ++i) row[i] = static_cast<float>(wp[r * in + i]);
        uint8_t* dst = yp + r * nb * block_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          if (block_bytes == 34) packed::quant_q8_0(&row[b * qk], dst + b * block_bytes);
          else if (block_bytes == 18) packed::quant_q4_0(&row[b * qk], dst + b * block_bytes);
          else packed::quant_q4_k(&row[b * qk], dst + b * block_bytes);
        }
      }
    });
  });
  return y;
}
