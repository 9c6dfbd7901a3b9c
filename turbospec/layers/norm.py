"""RMSNorm in float32, as the reference implementations compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.kernels.gemv import load_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """y = x / rms(x) * w  (or * (1 + w) for zero-centred weights), computed in float32.

    One C++ pass per row (rows in parallel for prefill-sized inputs) where the kernel is built, else one
    F.rms_norm call for the normalisation: decode runs ~50 norms per token, so op count matters."""
    k = load_kernel()
    if k is not None and x.dim() >= 1 and x.dtype == weight.dtype:
        return k.rms_norm(x, weight, eps, zero_centred)
    dtype = x.dtype
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)
