"""The Triton program of turbospec/kernels/triton_norm.py (imported on first use: Triton reads TRITON_INTERPRET
when it is defined)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm(x, w, out, n, d, eps, sx, so, BLOCK: tl.constexpr, ZC: tl.constexpr, R: tl.constexpr):
    """R rows per program: y = x / rms(x) in float32, then times (1 + w) in float32 (zero-centred weights) or
    rounded to the output dtype and times w there (the torch path's two roundings)."""
    rows = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = (rows < n)[:, None] & (cols < d)[None, :]
    v = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = v * tl.rsqrt(tl.sum(v * v, 1) / d + eps)[:, None]
    wv = tl.load(w + cols, mask=cols < d, other=0.0).to(tl.float32)[None, :]
    if ZC:  # noqa: SIM108 -- (a compile-time branch of Triton's)
        o = y * (1.0 + wv)
    else:
        o = y.to(out.dtype.element_ty).to(tl.float32) * wv
    tl.store(out + rows[:, None] * so + cols[None, :], o.to(out.dtype.element_ty), mask=m)
