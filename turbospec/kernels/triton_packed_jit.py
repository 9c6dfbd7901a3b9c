"""The Triton programs of turbospec/kernels/triton_packed.py (imported on first use: Triton reads TRITON_INTERPRET
when it is defined).

A packed matrix is uint8 [out, blocks, block bytes] (turbospec.weights): row r's bytes start at r * row_bytes, value
column k lies in block k // BV. FMT: 0 Q8_0 (34 bytes: f16 d, 32 int8), 1 Q4_0 (18: f16 d, 16 bytes of nibbles),
2 Q4_K (144: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles), 3 Q6_K (210: 128 bytes of
low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d), 4 Q5_K (176: Q4_K's first 16 bytes, 32 bytes of fifth
bits, Q4_K's 128 bytes of nibbles). Values are formed in float32 in the gguf package's order of operations
(launched without fused multiply-adds: bit for bit its dequantization).
"""

import triton
import triton.language as tl


@triton.jit
def _f16(p, m):
    """The little-endian float16 at byte pointers `p` (mask `m`), as float32."""
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _values(w, rows, rmask, k, kmask, row_bytes, FMT: tl.constexpr):
    """Float32 values [BN, BK] of packed rows `rows` (int64 [BN]) at value columns `k` ([BK])."""
    m = rmask[:, None] & kmask[None, :]
    if FMT == 0:
        p = w + rows[:, None] * row_bytes + (k // 32 * 34)[None, :]
        d = _f16(p, m)
        q = tl.load(p + 2 + (k % 32)[None, :], mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        v = q * d
    elif FMT == 1:
        p = w + rows[:, None] * row_bytes + (k // 32 * 18)[None, :]
        d = _f16(p, m)
        j = k % 32
        b = tl.load(p + 2 + (j % 16)[None, :], mask=m, other=0).to(tl.int32)
        q = ((b >> (j // 16 * 4)[None, :]) & 15) - 8
        v = d * q.to(tl.float32)
    elif FMT == 2 or FMT == 4:
        BB = 144 + FMT // 4 * 32  # block bytes: Q4_K 144, Q5_K 176
        p = w + rows[:, None] * row_bytes + (k // 256 * BB)[None, :]
        d = _f16(p, m)
        dmin = _f16(p + 2, m)
        j = k % 256
        sub = j // 32  # sub-block 0..7: the low nibbles of 32 bytes, then their high nibbles, four times
        low = sub < 4
        b1 = tl.load(p + 4 + tl.where(low, sub, sub + 4)[None, :], mask=m, other=0).to(tl.int32)
        b2 = tl.load(p + 4 + tl.where(low, sub + 4, sub - 4)[None, :], mask=m, other=0).to(tl.int32)
        b3 = tl.load(p + 4 + sub[None, :], mask=m, other=0).to(tl.int32)
        sc = tl.where(low[None, :], b1 & 63, (b1 & 15) | ((b2 >> 6) << 4))
        mn = tl.where(low[None, :], b2 & 63, (b1 >> 4) | ((b3 >> 6) << 4))
        b = tl.load(p + (BB - 128) + (j // 64 * 32 + j % 32)[None, :], mask=m, other=0).to(tl.int32)
        q = (b >> (sub % 2 * 4)[None, :]) & 15
        if FMT == 4:  # Q5_K's fifth bit: bit `sub` of qh[j % 32]
            h = tl.load(p + 16 + (j % 32)[None, :], mask=m, other=0).to(tl.int32)
            q = q | (((h >> sub[None, :]) & 1) << 4)
        v = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    else:
        p = w + rows[:, None] * row_bytes + (k // 256 * 210)[None, :]
        j = k % 256
        h = j // 128
        g = j % 128 // 32
        ln = j % 32
        ql = tl.load(p + (h * 64 + g % 2 * 32 + ln)[None, :], mask=m, other=0).to(tl.int32)
        qh = tl.load(p + 128 + (h * 32 + ln)[None, :], mask=m, other=0).to(tl.int32)
        q = (((ql >> (g // 2 * 4)[None, :]) & 15) | (((qh >> (g * 2)[None, :]) & 3) << 4)) - 32
        sc = tl.load(p + 192 + (j // 16)[None, :], mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(p + 208, m)
        v = (d * sc) * q.to(tl.float32)
    return v


@triton.jit
def dequantize(w, ids, out, R, K, row_bytes, so, BR: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr):
    """out[i, k] = value k of packed row ids[i] (float32 or the output's dtype, rounded once)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < R
    rows = tl.load(ids + r, mask=rmask, other=0).to(tl.int64)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    kmask = k < K
    v = _values(w, rows, rmask, k, kmask, row_bytes, FMT)
    tl.store(out + r.to(tl.int64)[:, None] * so + k[None, :], v.to(out.dtype.element_ty),
             mask=rmask[:, None] & kmask[None, :])


@triton.jit
def matmul(x, w, bias, out, M, N, row_bytes, sx, so, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for a tile of BN weight rows and BM input rows, the weights
    decoded tile by tile in registers and multiplied in float32. Every row goes through the same tiles whatever the
    other rows hold: a row's result does not depend on the batch. (K, the row length, is a compile-time constant:
    a model has a handful.)"""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    ms = tl.program_id(1) * BM + tl.arange(0, BM)
    mmask = ms < M
    rows = n.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        wt = _values(w, rows, nmask, k, kmask, row_bytes, FMT)
        xt = tl.load(x + ms.to(tl.int64)[:, None] * sx + k[None, :], mask=mmask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.dot(xt, tl.trans(wt), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + ms.to(tl.int64)[:, None] * so + n[None, :], acc.to(out.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
