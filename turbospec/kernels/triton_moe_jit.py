"""The Triton program of turbospec/kernels/triton_moe.py (imported on first use: Triton reads TRITON_INTERPRET when
it is defined)."""

import triton
import triton.language as tl

from turbospec.kernels.triton_packed_jit import _values


@triton.jit
def expert_rows(x, xrow, w, wexp, out, N, sx, so, row_bytes, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                FMT: tl.constexpr):
    """Program (p, tile): out[p, n] = sum_k x[xrow[p], k] W[wexp[p] * N + n, k] for a tile of BN outputs, W the rows
    of every expert stacked (float [E * N, K], or packed blocks: FMT as triton_packed_jit's, -1 for float).
    Products in float32, one input row per program: a pair's result does not depend on the others."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    r = tl.load(xrow + p).to(tl.int64)
    rows = tl.load(wexp + p).to(tl.int64) * N + n.to(tl.int64)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        xv = tl.load(x + r * sx + k, mask=kmask, other=0.0).to(tl.float32)
        if FMT < 0:
            wt = tl.load(w + rows[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
        else:
            wt = _values(w, rows, nmask, k, kmask, row_bytes, FMT)
        acc += tl.sum(wt * xv[None, :], 1)
    tl.store(out + p.to(tl.int64) * so + n, acc.to(out.dtype.element_ty), mask=nmask)
