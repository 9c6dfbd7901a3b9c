"""Packed ggml weight blocks (turbospec.weights' layout) off the C++ kernels: on a GPU (Triton,
turbospec/kernels/triton_packed.py) or in plain torch (any device: the reference, and the fallback where neither
kernel runs).

`dequantize(w, ids)`: rows `ids` of a packed matrix as float32 values, bit for bit the gguf package's
dequantization. `linear(x, w, bias)`: x W^T + b in x's dtype: up to `triton_packed.MAX_ROWS` rows in the fused
Triton product, more (prefill) through dequantized tiles of `TILE_VALUES` values and torch's GEMM in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.kernels import gpu
from turbospec.kernels import triton_packed as tp

TILE_VALUES = 1 << 25  # weight values dequantized per prefill tile (64 MiB in 16 bits)


def _half(b: torch.Tensor) -> torch.Tensor:
    """The little-endian float16s in the last dimension's byte pairs, as float32 (last dimension 1)."""
    return b.contiguous().view(torch.float16).float()


def dequantize_torch(w: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all when None) of packed w [N, B, bytes] -> float32 [len, B * block values], in the gguf
    package's order of operations."""
    if ids is not None:
        w = w.index_select(0, ids.reshape(-1))
    n, nb, size = w.shape
    if size == 34:  # Q8_0
        v = w[..., 2:].contiguous().view(torch.int8).float() * _half(w[..., :2])
    elif size == 18:  # Q4_0
        qs = w[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], -1).to(torch.int8) - 8
        v = _half(w[..., :2]) * q.float()
    elif size in (144, 176):  # Q4_K, Q5_K (Q4_K plus a fifth bit: bit j of qh[l] for sub-block j's value l)
        s = w[..., 4:16]
        sd, sm, sx = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([sd & 63, (sx & 15) | ((sd >> 2) & 48)], -1).float()
        mn = torch.cat([sm & 63, (sx >> 4) | ((sm >> 2) & 48)], -1).float()
        d = (_half(w[..., 0:2]) * sc).unsqueeze(-1)
        dm = (_half(w[..., 2:4]) * mn).unsqueeze(-1)
        qs = w[..., size - 128:].reshape(n, nb, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], 3).reshape(n, nb, 8, 32)
        if size == 176:
            qh = w[..., 16:48].reshape(n, nb, 1, 32)
            q = q | (((qh >> torch.arange(8, dtype=torch.uint8, device=w.device).reshape(1, 1, 8, 1)) & 1) << 4)
        v = d * q.float() - dm
    elif size == 210:  # Q6_K
        ql = w[..., :128].reshape(n, nb, 2, 64)
        ql = torch.stack([ql & 15, ql >> 4], 3).reshape(n, nb, 8, 32)
        qh = w[..., 128:192].reshape(n, nb, 2, 32)
        qh = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3).reshape(n, nb, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(n, nb, 16, 16).float()
        d = (_half(w[..., 208:210]) * w[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
        v = d * q
    else:
        raise ValueError(f"packed weight: unknown block size {size}")
    return v.reshape(n, -1)


def _triton(w: torch.Tensor, kernel: str) -> bool:
    return gpu.wanted(w) and gpu.enabled(kernel) and tp.supports(w)


def dequantize(w: torch.Tensor, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (all when None) of packed w as values in `dtype` (float32: exact)."""
    if _triton(w, "dequantize"):
        try:
            return tp.dequantize(w, ids if ids is not None else torch.arange(w.shape[0], device=w.device), dtype)
        except Exception as e:  # noqa: BLE001 -- a Triton or driver that cannot compile it: torch from now on
            gpu.failed("dequantize", e)
    return dequantize_torch(w, ids).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] W^T + b -> [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = w.shape[0]
    if rows.shape[0] <= tp.MAX_ROWS and _triton(w, "packed product"):
        try:
            return tp.matmul(rows, w, bias).reshape(*lead, n)
        except Exception as e:  # noqa: BLE001
            gpu.failed("packed product", e)
    # dequantized tiles of weight rows: float32 off the GPU (exact values), x's dtype on it (its GEMMs' dtype)
    dt = x.dtype if x.is_cuda else torch.float32
    xr = rows.to(dt)
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    step = max(1, TILE_VALUES // max(1, k))
    for a in range(0, n, step):
        ids = torch.arange(a, min(n, a + step), device=w.device)
        y = F.linear(xr, dequantize(w, ids, dt), None if bias is None else bias[a:a + step].to(dt))
        out[:, a:a + step] = y
    return out.reshape(*lead, n)
