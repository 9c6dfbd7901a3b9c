"""The Triton program of turbospec/kernels/triton_norm.py (imported on first use: Triton reads TRITON_INTERPRET
when it is defined)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm(x, w, out, d, eps, sx, so, BLOCK: tl.constexpr, ZC: tl.constexpr):
    """One row per program: y = x / rms(x) in float32, then times (1 + w) in float32 (zero-centred weights) or
    rounded to the output dtype and times w there (the torch path's two roundings)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < d
    v = tl.load(x + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    y = v * tl.rsqrt(tl.sum(v * v, 0) / d + eps)
    wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    if ZC:  # noqa: SIM108 -- (a compile-time branch of Triton's)
        o = y * (1.0 + wv)
    else:
        o = y.to(out.dtype.element_ty).to(tl.float32) * wv
    tl.store(out + row * so + cols, o.to(out.dtype.element_ty), mask=m)
