"""RMSNorm in float32, as the reference implementations compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.kernels.gemv import load_kernel

KERNEL_MAX_NUMEL = 1 << 16  # decode/verification-sized inputs use the one-pass C++ kernel (single thread)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """y = x / rms(x) * w  (or * (1 + w) for zero-centred weights), computed in float32.

    One fused F.rms_norm call for the normalisation: decode runs ~50 norms per token, so op count matters."""
    k = load_kernel()
    if k is not None and x.dim() >= 1 and x.numel() <= KERNEL_MAX_NUMEL and x.dtype == weight.dtype:
        return k.rms_norm(x, weight, eps, zero_centred)
    dtype = x.dtype
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)
