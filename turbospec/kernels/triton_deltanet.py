"""The Gated DeltaNet mixer of a decode or verification step in one Triton program per value head (the GPU's
counterpart of deltanet.cpp's `gdn_step`): conv, SiLU, L2 norms, the gated delta rule for each token (a chain, or
a tree: each node from its parent's state), every token's state kept, and the gated RMS norm of the output.

`step(window, conv_t, z, b, a, neg_a, dt_bias, norm_weight, state, parents, nk, nv, dk, dv, eps)` takes what
`GatedDeltaNet.mix` has at that point: the conv window [K-1+N, C] (committed conv state, then the step's q|k|v
rows), conv weights [K, C], z [N, Hv*Dv], b and a [N, Hv] (views into the projection), -exp(A_log) and dt_bias
float32 [Hv], the norm weight [Dv], the committed state [Hv, Dk, Dv] float32, the tree's parents (None: a chain).
Returns (o [N, Hv*Dv] in z's dtype, states [N, Hv, Dk, Dv] float32). Arithmetic in float32 (the torch path rounds
the conv to the model dtype between products: bf16 models agree to that rounding).
"""

from __future__ import annotations

from functools import cache

import torch

MAX_ROWS = 16  # tokens per step (compiled for 1, 2, 4, 8 and 16)


def supports(n: int, dk: int, dv: int) -> bool:
    return 1 <= n <= MAX_ROWS and all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


@cache
def _kernel():
    from turbospec.kernels import triton_deltanet_jit

    return triton_deltanet_jit.gdn_step


def step(window: torch.Tensor, conv_t: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
         neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor,
         parents: list[int] | None, nk: int, nv: int, dk: int, dv: int, eps: float,
         rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = z.shape[0]
    k = conv_t.shape[0]
    window = window.contiguous()
    conv_t = conv_t.contiguous()
    state = state.contiguous()
    out = torch.empty(n, nv * dv, dtype=z.dtype, device=z.device)
    states = torch.empty(n, nv, dk, dv, dtype=torch.float32, device=z.device)
    tree = parents is not None
    par = torch.tensor(parents, dtype=torch.int32, device=z.device) if tree else states
    rws = rows.to(device=z.device, dtype=torch.int32).contiguous() if tree else states
    for t in (z, b, a):
        if t.stride(-1) != 1:
            raise ValueError("z, b and a must have unit stride along heads")
    _kernel()[(nv,)](window, conv_t, z, b, a, neg_a, dt_bias, norm_weight, state, par, rws, out, states,
                     window.stride(0), z.stride(0), b.stride(0), a.stride(0), float(eps), float(dk) ** -0.5, n,
                     NP=1 << (n - 1).bit_length(), K=k, DK=dk, DV=dv, REP=nv // nk, KEY_DIM=nk * dk, TREE=tree, NV=nv,
                     num_warps=8 if dk * dv >= 128 * 128 else 4)
    return out, states
