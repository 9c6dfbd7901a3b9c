"""RMSNorm in float32, as the reference implementations compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.kernels import gpu
from turbospec.kernels import triton_norm as gpu_norm
from turbospec.kernels.gemv import load_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """y = x / rms(x) * w  (or * (1 + w) for zero-centred weights), computed in float32.

    One C++ pass per row (rows in parallel for prefill-sized inputs) where the kernel is built, one Triton launch on
    a GPU, else one F.rms_norm call for the normalisation: decode runs ~50 norms per token, so op count matters."""
    k = load_kernel()
    if k is not None and x.dim() >= 1 and x.dtype == weight.dtype:
        return k.rms_norm(x, weight, eps, zero_centred)
    if gpu.wanted(x) and gpu.enabled("rms_norm") and x.dim() >= 1 and x.numel():  # one Triton launch
        try:
            return gpu_norm.rms_norm(x, weight, eps, zero_centred)
        except Exception as e:  # noqa: BLE001 -- a Triton that cannot build it: torch below
            gpu.failed("rms_norm", e)
    dtype = x.dtype
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)
