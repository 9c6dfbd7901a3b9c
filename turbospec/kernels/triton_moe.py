"""A mixture-of-experts layer's routed experts on a GPU, in Triton: every (token, chosen expert) pair's product in one
launch, the expert read from the router's choice on the device (no host round-trip to group tokens by expert, as
the CPU path does), over every expert's matrices stacked in one tensor (float, or packed ggml blocks).

`expert_rows(x, rows, w, experts)`: out[p] = W[experts[p]] x[rows[p]] for stacked w [E, N, K] (float) or
[E, N, K / BV, block bytes] (packed) -> [P, N] in x's dtype. Where it runs: `turbospec.kernels.gpu.wanted`.
"""

from __future__ import annotations

from functools import cache

import torch

from turbospec.kernels.triton_packed import FMT, VALUES

COLS, DEPTH = 32, 128  # outputs and input values per step of a program
WIDE = 256, 256  # in the interpreter (the tests on the CPU), whose cost is per program


@cache
def _kernel():
    from turbospec.kernels import triton_moe_jit

    return triton_moe_jit.expert_rows


def supports(w: torch.Tensor) -> bool:
    """Stacked experts the kernel reads: float [E, N, K], or packed [E, N, blocks, bytes] of a known format."""
    return (w.dim() == 3 and w.is_floating_point()) or (w.dim() == 4 and w.dtype == torch.uint8 and w.shape[3] in FMT)


def expert_rows(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    p, n = rows.numel(), w.shape[1]
    packed = w.dim() == 4
    k = w.shape[2] * VALUES[w.shape[3]] if packed else w.shape[2]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p:
        cols, depth = (COLS, DEPTH) if x.is_cuda else WIDE
        _kernel()[(p, -(-n // cols))](x, rows.contiguous(), w.contiguous(), experts.contiguous(), out, n, x.stride(0),
                                      out.stride(0), w.shape[2] * w.shape[3] if packed else 0, K=k, BN=cols, BK=depth,
                                      FMT=FMT[w.shape[3]] if packed else -1, enable_fp_fusion=False)
    return out
