"""Packed ggml weight blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) on a GPU, in Triton (the counterpart of quant.cpp): a fused
dequantizing product for decode and verification rows, which reads each weight byte once per step and never
writes a float copy of the matrix, and a dequantizer (embedding rows, prefill tiles).

`matmul(x, w, bias)`: x [M, K] (any float dtype, M <= `MAX_ROWS`) times packed w [N, K/BV, bytes]^T -> [M, N] in
x's dtype; products in float32 (three TF32 products on tensor cores, IEEE in the interpreter). Every input row
goes through the same tiles of `ROWS` rows, so a row's result does not depend on the batch (speculative
verification then gives each draft exactly the logits a single-token step would). `dequantize(w, ids, dtype)`:
rows `ids` of w as values [len(ids), K], bit for bit the gguf package's dequantization (in float32).
Where it runs: `turbospec.kernels.gpu.wanted`; the kernels compile on first use.
"""

from __future__ import annotations

import sys
from functools import cache

import torch

FMT = {34: 0, 18: 1, 144: 2, 210: 3, 176: 4}  # block bytes -> the programs' FMT
VALUES = {34: 32, 18: 32, 144: 256, 210: 256, 176: 256}  # block bytes -> values per block
MAX_ROWS = 64  # input rows of the fused product (decode and verification); prefill dequantizes tiles
ROWS, COLS, DEPTH = 16, 32, 128  # tile: input rows, weight rows, values per step
WIDE = 512, 256  # COLS, DEPTH in the interpreter (the tests on the CPU), whose cost is per program
_PRECISION = "tf32x3"


@cache
def _kernels():
    from turbospec.kernels import triton_packed_jit

    return triton_packed_jit.matmul, triton_packed_jit.dequantize


def supports(w: torch.Tensor) -> bool:
    return w.dtype == torch.uint8 and w.dim() == 3 and w.shape[2] in FMT


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    global _PRECISION
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the fused packed product takes at most {MAX_ROWS}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cols, depth = (COLS, DEPTH) if x.is_cuda else WIDE
    grid = (-(-n // cols), -(-m // ROWS))
    args = (x, w, bias if bias is not None else x, out, m, n, w.shape[1] * w.shape[2], x.stride(0), out.stride(0))
    meta = {"K": k, "BM": ROWS, "BN": cols, "BK": depth, "FMT": FMT[w.shape[2]], "HAS_BIAS": bias is not None,
            "enable_fp_fusion": False}
    if x.is_cuda and _PRECISION == "tf32x3":
        try:
            _kernels()[0][grid](*args, PREC="tf32x3", **meta)
            return out
        except Exception as e:  # noqa: BLE001 -- a Triton without 3xTF32 products: IEEE float32 (slower)
            print(f"turbospec: Triton packed product without tf32x3 ({' '.join(str(e).split())[:100]}); using ieee",
                  file=sys.stderr)
            _PRECISION = "ieee"
    _kernels()[0][grid](*args, PREC="ieee", **meta)
    return out


def dequantize(w: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    ids = ids.reshape(-1).contiguous()
    r, k = ids.numel(), w.shape[1] * VALUES[w.shape[2]]
    w = w.contiguous()
    out = torch.empty(r, k, dtype=dtype, device=w.device)
    if r:
        rows, depth = (ROWS, DEPTH) if w.is_cuda else WIDE
        grid = (-(-r // rows), -(-k // depth))
        _kernels()[1][grid](w, ids, out, r, k, w.shape[1] * w.shape[2], out.stride(0), BR=rows, BK=depth,
                            FMT=FMT[w.shape[2]], enable_fp_fusion=False)
    return out
