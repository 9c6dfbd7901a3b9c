"""RMSNorm of many rows in one Triton launch (a GPU's decode runs about 160 norms per token of a 64-layer model:
one launch each instead of torch's five or six ops). Matches `turbospec.layers.norm.rms_norm`'s torch path to
float32 rounding: float32 statistics, zero-centred weights applied in float32, plain weights in the input dtype."""

from __future__ import annotations

from functools import cache

import torch

INTERPRETER_ROWS = 16  # rows per program in the interpreter (the tests on the CPU), whose cost is per program; 1 on a GPU


@cache
def _kernel():
    from turbospec.kernels import triton_norm_jit

    return triton_norm_jit.rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = max(16, 1 << (d - 1).bit_length())
    r = 1 if x.is_cuda else INTERPRETER_ROWS
    _kernel()[(-(-rows.shape[0] // r),)](rows, weight, out, rows.shape[0], d, float(eps), rows.stride(0),
                                         out.stride(0), BLOCK=block, ZC=zero_centred, R=r,
                                         num_warps=8 if block >= 4096 else 4)
    return out.reshape(x.shape)
