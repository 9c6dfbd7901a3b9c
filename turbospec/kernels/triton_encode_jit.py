"""The Triton program of turbospec/kernels/triton_encode.py (imported on first use: Triton reads TRITON_INTERPRET
when it is defined)."""

import triton
import triton.language as tl


@triton.jit
def _recip(d):
    """1/d correctly rounded, 0 where that is not finite (the reference's `_safe_reciprocal`)."""
    inv = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    return tl.where(tl.abs(inv) == float("inf"), 0.0, inv)


@triton.jit
def _trunc(v):
    return tl.where(v >= 0, tl.floor(v), tl.ceil(v))


@triton.jit
def _rne(v):
    """Round half to even (torch.round) for |v| well inside float32's integer range."""
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _half_away(v):
    """Round half away from zero (ggml's roundf), as the reference computes it."""
    a = tl.abs(v)
    fl = tl.floor(a)
    r = fl + tl.floor((a - fl) * 2.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def encode(x, f0, f1, sxh, sxt, s0h, s0t, s1h, s1t, n, rows, start, slots, KIND: tl.constexpr, BS: tl.constexpr,
           RP: tl.constexpr, SLOTS: tl.constexpr):
    """One program per (RP vectors, block): vector v = head * n + token of x [KVH, n, D] (v < rows = KVH * n) into
    position start + token (SLOTS: position slots[token], a paged pool's)."""
    v = tl.program_id(0) * RP + tl.arange(0, RP)
    b = tl.program_id(1)
    vmask = v < rows
    h = (v // n).to(tl.int64)
    t = v % n
    HALF: tl.constexpr = BS // 2
    j = tl.arange(0, HALF)
    m2 = vmask[:, None]
    xp = x + h[:, None] * sxh + t[:, None] * sxt + b * BS + j[None, :]
    lo = tl.load(xp, mask=m2, other=0.0).to(tl.float32)  # [RP, HALF]
    hi = tl.load(xp + HALF, mask=m2, other=0.0).to(tl.float32)
    if SLOTS:  # noqa: SIM108 -- (a compile-time branch of Triton's)
        pos = tl.load(slots + t, mask=vmask, other=0).to(tl.int64)
    else:
        pos = (start + t).to(tl.int64)
    o0 = f0 + h * s0h + pos * s0t  # [RP]
    o1 = f1 + h * s1h + pos * s1t
    if KIND <= 2:  # plain: the values in the cache's dtype
        tl.store(o0[:, None] + b * BS + j[None, :], lo.to(f0.dtype.element_ty), mask=m2)
        tl.store(o0[:, None] + b * BS + HALF + j[None, :], hi.to(f0.dtype.element_ty), mask=m2)
    elif KIND == 3:  # q8_0: d = absmax / 127 (stored fp16), codes roundf(x / d) with the float32 d
        d = tl.math.div_rn(tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1)), 127.0)
        inv = _recip(d)[:, None]
        tl.store(o0 + b, d.to(tl.float16), mask=vmask)
        tl.store(o1[:, None] + b * BS + j[None, :], _half_away(lo * inv).to(tl.int8), mask=m2)
        tl.store(o1[:, None] + b * BS + HALF + j[None, :], _half_away(hi * inv).to(tl.int8), mask=m2)
    else:
        if KIND == 4:  # q4_0: d = (the value of largest magnitude, first on ties) / -8; codes trunc(x / d + 8.5)
            al = tl.abs(lo)
            ah = tl.abs(hi)
            ml = tl.max(al, 1)
            mh = tl.max(ah, 1)
            il = tl.argmax(al, 1, tie_break_left=True)
            ih = tl.argmax(ah, 1, tie_break_left=True)
            xl = tl.sum(tl.where(j[None, :] == il[:, None], lo, 0.0), 1)
            xh = tl.sum(tl.where(j[None, :] == ih[:, None], hi, 0.0), 1)
            m = tl.where(ml >= mh, xl, xh)
            d = tl.math.div_rn(m, -8.0)
            inv = _recip(d)[:, None]
            tl.store(o0 + b, d.to(tl.float16), mask=vmask)
            ql = tl.minimum(tl.maximum(_trunc((lo * inv) + 8.5), 0.0), 15.0)
            qh = tl.minimum(tl.maximum(_trunc((hi * inv) + 8.5), 0.0), 15.0)
        else:  # tbq4_0: S = absmax / 7 stored fp16, codes round(x / S) in [-8, 7] against the stored S, + 8
            s16 = tl.math.div_rn(tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1)), 7.0).to(tl.float16)
            inv = _recip(s16.to(tl.float32))[:, None]
            tl.store(o0 + b, s16, mask=vmask)
            ql = tl.minimum(tl.maximum(_rne(lo * inv), -8.0), 7.0) + 8.0
            qh = tl.minimum(tl.maximum(_rne(hi * inv), -8.0), 7.0) + 8.0
        byte = ql.to(tl.int32) | (qh.to(tl.int32) << 4)  # low nibbles: the block's first half
        tl.store(o1[:, None] + b * HALF + j[None, :], byte.to(tl.uint8), mask=m2)


@triton.jit
def encode_turbo(x, rot, bounds, cent, f0, f1, f2, sxh, sxt, s0h, s0t, s1h, s1t, s2h, s2t, n, rows, start, slots,
                 B: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, RP: tl.constexpr, SLOTS: tl.constexpr):
    """TurboQuant-MSE blocks of RP vectors at once (program 0: the vectors, program 1: the block): rotate (x R^T),
    normalize, Lloyd-Max indices against the boundaries, the fp16 scale of the norm mode (0 plain, 1 corrected,
    2 least squares), the indices packed in bit planes (kv/bitpack.py)."""
    r = tl.program_id(0) * RP + tl.arange(0, RP)
    b = tl.program_id(1)
    rmask = r < rows
    h = (r // n).to(tl.int64)
    t = r % n
    cols = tl.arange(0, B)
    xv = tl.load(x + h[:, None] * sxh + t[:, None] * sxt + b * B + cols[None, :], mask=rmask[:, None], other=0.0)
    rm = tl.load(rot + cols[:, None] * B + cols[None, :])
    u = tl.dot(xv.to(tl.float32), tl.trans(rm), input_precision="ieee")  # [RP, B]
    norm = tl.sqrt(tl.sum(u * u, 1))
    u = u / tl.where(norm > 0, norm, 1.0)[:, None]
    idx = tl.zeros([RP, B], tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        idx += (u > tl.load(bounds + i)).to(tl.int32)
    c = tl.zeros([RP, B], tl.float32)
    for i in tl.static_range(1 << BITS):
        c += tl.where(idx == i, tl.load(cent + i), 0.0)
    if MODE == 0:
        scale = norm
    elif MODE == 1:
        scale = norm / tl.sqrt(tl.sum(c * c, 1))
    else:
        scale = norm * tl.sum(u * c, 1) / tl.sum(c * c, 1)
    if SLOTS:  # noqa: SIM108 -- (a compile-time branch of Triton's)
        pos = tl.load(slots + t, mask=rmask, other=0).to(tl.int64)
    else:
        pos = (start + t).to(tl.int64)
    tl.store(f0 + h * s0h + pos * s0t + b, scale.to(tl.float16), mask=rmask)
    W: tl.constexpr = 2 if BITS == 3 else BITS
    K: tl.constexpr = 8 // W
    PER: tl.constexpr = B // K
    codes = tl.reshape(idx & ((1 << W) - 1), (RP, K, PER))
    shifts = tl.arange(0, K) * W
    byte = tl.sum(codes << shifts[None, :, None], 1)  # byte j: codes j, j + PER, ... at W-bit offsets
    jj = tl.arange(0, PER)
    tl.store(f1 + h[:, None] * s1h + pos[:, None] * s1t + b * PER + jj[None, :], byte.to(tl.uint8),
             mask=rmask[:, None])
    if BITS == 3:  # the high bit in a 1-bit plane
        PH: tl.constexpr = B // 8
        hb = tl.reshape((idx >> 2) & 1, (RP, 8, PH))
        hbyte = tl.sum(hb << tl.arange(0, 8)[None, :, None], 1)
        jh = tl.arange(0, PH)
        tl.store(f2 + h[:, None] * s2h + pos[:, None] * s2t + b * PH + jh[None, :], hbyte.to(tl.uint8),
                 mask=rmask[:, None])
