"""RMSNorm in float32, as the reference implementations compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """y = x / rms(x) * w  (or * (1 + w) for zero-centred weights), computed in float32.

    One fused F.rms_norm call for the normalisation: decode runs ~50 norms per token, so op count matters."""
    dtype = x.dtype
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)
