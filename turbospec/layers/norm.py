"""RMSNorm in float32, as the reference implementations compute it."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """y = x / rms(x) * w  (or * (1 + w) for zero-centred weights), computed in float32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)
