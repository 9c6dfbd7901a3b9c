// Encode a few K/V vectors (one decode or verification step) straight into a KV cache's packed buffers.
// One call replaces the ~20-30 small torch ops per format and field of the reference encoders in
// turbospec/kv/formats.py, which dominate a decode step's cache cost at short depth.
//
// f32/f16/bf16, q8_0, q4_0 and tbq4_0 repeat the reference's float32 operations and give the same bytes.
// turbo*: the rotation is a fast Walsh-Hadamard transform (the same linear map as the reference's matmul,
// summed in another order), so a coordinate within an ulp of a codebook boundary may take the neighbouring
// code and the norm may differ in its last fp16 bit; both encodings are valid TurboQuant codes of the vector.
// Returns false when a scale or value is not finite (the caller re-encodes with the reference, which raises
// the proper error), before writing anything.
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

enum Kind : int64_t { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4, TBQ4_0 = 5, TURBO = 6, TURBO64 = 7 };

struct Out {  // one field of the layer's buffer [KVH, T, ...]
  uint8_t* p;
  int64_t sh, st;
  uint8_t* at(int64_t h, int64_t t) const { return p + h * sh + t * st; }
};

inline uint16_t to_half(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
inline float from_half(uint16_t h) { return _cvtsh_ss(h); }

inline uint16_t to_bf16(float v) {  // round to nearest even, like c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (std::isnan(v)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float safe_reciprocal(float d) {
  const float inv = 1.0f / d;
  return std::isinf(inv) ? 0.0f : inv;
}

// ggml's roundf for |v| (ties away from zero), written as the reference does: fl + floor(2 * (a - fl)).
inline float round_half_away(float v) {
  const float a = std::fabs(v);
  const float fl = std::floor(a);
  return std::copysign(fl + std::floor(2.0f * (a - fl)), v);
}

// q4_0 / tbq4_0 nibble order within a block of n codes: byte j = code j | code j + n/2 << 4.
inline void pack_nibbles(const uint8_t* q, int64_t n, uint8_t* out) {
  for (int64_t j = 0; j < n / 2; ++j) out[j] = static_cast<uint8_t>(q[j] | (q[j + n / 2] << 4));
}

// Bit plane of width w (1, 2, 4) of n codes: byte j holds codes j, j + P, j + 2P, ... (P = n * w / 8).
inline void pack_plane(const uint8_t* codes, int64_t n, int w, int shift, uint8_t* out) {
  const int64_t P = n * w / 8;
  const int mask = (1 << w) - 1;
  for (int64_t j = 0; j < P; ++j) {
    int b = 0;
    for (int64_t k = 0; k < 8 / w; ++k) b |= ((codes[j + k * P] >> shift) & mask) << (k * w);
    out[j] = static_cast<uint8_t>(b);
  }
}

// In-place orthonormal randomized Hadamard transform of one block: y = s2 * H (s1 * x) / sqrt(n).
void rotate_block(float* x, int64_t n, const float* s1, const float* s2) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s1[i];
  for (int64_t len = 1; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
  const float r = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= s2[i] * r;
}

struct Turbo {
  int bits = 0, block = 0, norm_mode = 2;  // 0 plain, 1 corrected, 2 lsq
  const float *cent = nullptr, *bounds = nullptr, *s1 = nullptr, *s2 = nullptr;
};

// One block: norm (fp16 bits) and codes. false when not finite.
bool turbo_block(const Turbo& tq, float* y, uint16_t& norm16, uint8_t* codes) {
  const int64_t n = tq.block;
  rotate_block(y, n, tq.s1, tq.s2);
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(y[i]) * y[i];
  const float norm = static_cast<float>(std::sqrt(ss));
  const float inv = norm > 0.0f ? 1.0f / norm : 1.0f;
  const int nb = (1 << tq.bits) - 1;  // number of boundaries
  float uc = 0.0f, cc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float u = y[i] * inv;
    int idx = 0;
    while (idx < nb && tq.bounds[idx] < u) ++idx;  // torch.bucketize (right=False)
    codes[i] = static_cast<uint8_t>(idx);
    const float c = tq.cent[idx];
    uc += u * c;
    cc += c * c;
  }
  float scale = norm;
  if (tq.norm_mode == 1) scale = norm / std::sqrt(cc);
  if (tq.norm_mode == 2) scale = norm * uc / cc;
  if (!std::isfinite(scale)) return false;
  norm16 = to_half(scale);
  return std::isfinite(from_half(norm16));
}

}  // namespace

// Encoded rows waiting to be written (stage, then scatter): every row's fields, one after the other.
struct Staged {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> lens;  // bytes of each field per position
  std::vector<Out> out;
  int64_t rows = 0, n = 0, start = 0;  // rows: KVH x N, head-major
};

// x: float32 [KVH, N, D] (contiguous), encoded for positions [start, start + N) of the fields (list of the layer's
// buffers, [KVH, T, ...], in the format's field order) into `st`; nothing is written yet. width: padded length
// (multiple of the block). False when a value or scale is not finite.
bool stage(const torch::Tensor& x, int64_t kind, int64_t bits, int64_t width, const std::vector<torch::Tensor>& fields,
           int64_t start, const torch::Tensor& cent, const torch::Tensor& bounds, const torch::Tensor& s1,
           const torch::Tensor& s2, int64_t norm_mode, Staged& st) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.is_contiguous(), "x: float32 [KVH, N, D]");
  const int64_t kvh = x.size(0), n = x.size(1), d = x.size(2);
  TORCH_CHECK(width >= d, "width < head size");
  std::vector<Out>& out = st.out;
  out.clear();
  st.n = n, st.start = start;
  for (auto& f : fields) {
    TORCH_CHECK(f.dim() >= 2 && f.size(0) == kvh && f.size(1) >= start + n, "field shape");
    const int64_t isz = f.element_size();
    out.push_back({static_cast<uint8_t*>(f.data_ptr()), f.stride(0) * isz, f.stride(1) * isz});
  }
  Turbo tq;
  const bool turbo = kind == TURBO || kind == TURBO64;
  if (turbo) {
    tq.bits = static_cast<int>(bits);
    tq.block = kind == TURBO64 ? 64 : 128;
    tq.norm_mode = static_cast<int>(norm_mode);
    TORCH_CHECK(cent.numel() == (1 << bits) && bounds.numel() == (1 << bits) - 1, "codebook size");
    TORCH_CHECK(s1.numel() == tq.block && s2.numel() == tq.block, "sign vectors");
    tq.cent = cent.data_ptr<float>();
    tq.bounds = bounds.data_ptr<float>();
    tq.s1 = s1.data_ptr<float>();
    tq.s2 = s2.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const int64_t rows = kvh * n;
  st.rows = 0;  // set once every row is staged
  // encode every row into a staging area first: nothing is written if any row is not finite
  std::vector<int64_t>& lens = st.lens;
  lens.clear();
  int64_t bytes_per_row = 0;
  for (auto& f : fields) {
    lens.push_back(f.numel() / (f.size(0) * f.size(1)) * f.element_size());
    bytes_per_row += lens.back();
  }
  std::vector<uint8_t>& stage = st.bytes;
  stage.assign(rows * bytes_per_row, 0);
  std::vector<float> buf(width);
  std::vector<uint8_t> codes(width);
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(buf.begin(), buf.end(), 0.0f);
    std::copy(xp + r * d, xp + (r + 1) * d, buf.begin());
    for (int64_t i = 0; i < d; ++i)
      if (!std::isfinite(buf[i])) return false;
    uint8_t* o = stage.data() + r * bytes_per_row;
    if (kind == F32 || kind == F16 || kind == BF16) {
      for (int64_t i = 0; i < d; ++i) {
        if (kind == F32) reinterpret_cast<float*>(o)[i] = buf[i];
        if (kind == F16) {
          const uint16_t h = to_half(buf[i]);
          if (!std::isfinite(from_half(h))) return false;
          reinterpret_cast<uint16_t*>(o)[i] = h;
        }
        if (kind == BF16) reinterpret_cast<uint16_t*>(o)[i] = to_bf16(buf[i]);
      }
    } else if (kind == Q8_0) {  // fields d [nb] fp16, qs [nb, 32] int8
      const int64_t nb = width / 32;
      uint16_t* dd = reinterpret_cast<uint16_t*>(o);
      int8_t* qs = reinterpret_cast<int8_t*>(o + 2 * nb);
      for (int64_t b = 0; b < nb; ++b) {
        const float* v = buf.data() + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float dv = amax / 127.0f;
        const float inv = safe_reciprocal(dv);
        dd[b] = to_half(dv);
        if (!std::isfinite(from_half(dd[b]))) return false;
        for (int i = 0; i < 32; ++i) qs[32 * b + i] = static_cast<int8_t>(round_half_away(v[i] * inv));
      }
    } else if (kind == Q4_0 || kind == TBQ4_0) {  // fields d [nb] fp16, qs [nb, B/2] nibbles
      const int64_t B = kind == Q4_0 ? 32 : 64, nb = width / B;
      uint16_t* dd = reinterpret_cast<uint16_t*>(o);
      uint8_t* qs = o + 2 * nb;
      uint8_t q[64];
      for (int64_t b = 0; b < nb; ++b) {
        const float* v = buf.data() + B * b;
        if (kind == Q4_0) {
          float amax = 0.0f, m = 0.0f;
          for (int64_t i = 0; i < B; ++i)
            if (std::fabs(v[i]) > amax) { amax = std::fabs(v[i]); m = v[i]; }
          const float dv = m / -8.0f;
          dd[b] = to_half(dv);
          if (!std::isfinite(from_half(dd[b]))) return false;
          const float inv = safe_reciprocal(dv);
          for (int64_t i = 0; i < B; ++i) {
            const float w = std::trunc(v[i] * inv + 8.5f);  // no fused multiply-add (-ffp-contract=off)
            q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, w)));
          }
        } else {
          float amax = 0.0f;
          for (int64_t i = 0; i < B; ++i) amax = std::max(amax, std::fabs(v[i]));
          dd[b] = to_half(amax / 7.0f);
          const float s = from_half(dd[b]);
          if (!std::isfinite(s)) return false;
          const float inv = safe_reciprocal(s);
          for (int64_t i = 0; i < B; ++i) {
            const float w = std::nearbyint(v[i] * inv);  // torch.round: half to even
            q[i] = static_cast<uint8_t>(std::min(7.0f, std::max(-8.0f, w)) + 8.0f);
          }
        }
        pack_nibbles(q, B, qs + b * (B / 2));
      }
    } else if (turbo) {  // fields norm [nb] fp16, qs [nb, B*w/8] (, qh [nb, B/8])
      const int64_t B = tq.block, nb = width / B;
      const int w = bits == 3 ? 2 : static_cast<int>(bits);
      uint16_t* norms = reinterpret_cast<uint16_t*>(o);
      uint8_t* qs = o + 2 * nb;
      uint8_t* qh = qs + nb * (B * w / 8);
      for (int64_t b = 0; b < nb; ++b) {
        if (!turbo_block(tq, buf.data() + B * b, norms[b], codes.data() + B * b)) return false;
        pack_plane(codes.data() + B * b, B, w, 0, qs + b * (B * w / 8));
        if (bits == 3) pack_plane(codes.data() + B * b, B, 1, 2, qh + b * (B / 8));
      }
    } else {
      TORCH_CHECK(false, "unknown KV kind ", kind);
    }
  }
  st.rows = rows;
  return true;
}

// Writes staged rows into their fields (field i's bytes follow field i-1's in a staged row).
void scatter(const Staged& st) {
  const uint8_t* src = st.bytes.data();
  for (int64_t r = 0; r < st.rows; ++r) {
    const int64_t h = r / st.n, t = st.start + r % st.n;
    for (size_t i = 0; i < st.out.size(); ++i) {
      std::memcpy(st.out[i].at(h, t), src, st.lens[i]);
      src += st.lens[i];
    }
  }
}

// Writes staged rows (staged as positions [0, N)) to positions slots[0..N) of their fields instead (a paged pool:
// each row's own physical position).
void scatter_slots(const Staged& st, const int64_t* slots) {
  const uint8_t* src = st.bytes.data();
  for (int64_t r = 0; r < st.rows; ++r) {
    const int64_t h = r / st.n, t = slots[r % st.n];
    for (size_t i = 0; i < st.out.size(); ++i) {
      std::memcpy(st.out[i].at(h, t), src, st.lens[i]);
      src += st.lens[i];
    }
  }
}

// stage, then scatter: positions [start, start + N) of the fields, or false (nothing written).
bool encode_into(torch::Tensor x, int64_t kind, int64_t bits, int64_t width, std::vector<torch::Tensor> fields,
                 int64_t start, torch::Tensor cent, torch::Tensor bounds, torch::Tensor s1, torch::Tensor s2,
                 int64_t norm_mode) {
  Staged st;
  if (!stage(x, kind, bits, width, fields, start, cent, bounds, s1, s2, norm_mode, st)) return false;
  scatter(st);
  return true;
}

// stage, then scatter_slots: row i of x [KVH, N, D] to position slots[i] (int64 [N], each < the fields' length) of
// the fields, or false (nothing written).
bool encode_slots(torch::Tensor x, int64_t kind, int64_t bits, int64_t width, std::vector<torch::Tensor> fields,
                  torch::Tensor slots, torch::Tensor cent, torch::Tensor bounds, torch::Tensor s1, torch::Tensor s2,
                  int64_t norm_mode) {
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == x.size(1),
              "slots: int64, one per row");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    for (auto& f : fields) TORCH_CHECK(sl[i] >= 0 && sl[i] < f.size(1), "slot out of range");
  Staged st;
  if (!stage(x, kind, bits, width, fields, 0, cent, bounds, s1, s2, norm_mode, st)) return false;
  scatter_slots(st, sl);
  return true;
}

// Randomized Hadamard rotation of every block of every row of x (float32 [..., W], W a multiple of the block):
// y = s2 * H (s1 * x) / sqrt(n); inverse: x = s1 * H (s2 * y) / sqrt(n). Returns a new tensor.
torch::Tensor hadamard_rows(torch::Tensor x, torch::Tensor s1, torch::Tensor s2, bool inverse) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x must be float32");
  const int64_t n = s1.numel();
  TORCH_CHECK(n > 0 && s2.numel() == n && x.size(-1) % n == 0, "block / width mismatch");
  auto y = x.contiguous().clone();
  float* p = y.data_ptr<float>();
  const float* a = (inverse ? s2 : s1).data_ptr<float>();
  const float* b = (inverse ? s1 : s2).data_ptr<float>();
  for (int64_t off = 0; off < y.numel(); off += n) rotate_block(p + off, n, a, b);
  return y;
}

#ifndef TURBOSPEC_EMBED_ENCODE  // gemv.cpp includes this file for its one-call decode step over a packed cache
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_into", &encode_into, "encode K/V rows into a packed KV cache's buffers");
  m.def("encode_slots", &encode_slots, "encode K/V rows into given positions of a paged pool's buffers");
  m.def("hadamard_rows", &hadamard_rows, "blockwise randomized Hadamard rotation (or its inverse) of rows");
}
#endif
