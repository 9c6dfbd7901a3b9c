"""The Triton Gated DeltaNet step (turbospec/kernels/triton_deltanet.py) against the torch path of
`GatedDeltaNet.mix`: chains of 1 and 4 tokens and a tree, float32 (to float rounding) and bfloat16 (to its
rounding); on a GPU where there is one, else in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from turbospec.kernels import triton_deltanet as td
from turbospec.layers.gated_deltanet import GatedDeltaNet, conv_rows
from turbospec.layers.linear import Linear

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,parents", [(1, None), (4, None), (6, [-1, 0, 0, 1, 2, 4])])
def test_step_matches_the_torch_mixer(dtype, n, parents):
    g = torch.Generator().manual_seed(n)
    nk, nv, dk, dv, k, hidden = 2, 4, 32, 32, 4, 64
    c = 2 * nk * dk + nv * dv

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    mixer = GatedDeltaNet(Linear(rnd(c + nv * dv + 2 * nv, hidden, s=0.2)), rnd(c, 1, k, s=0.5),
                          torch.rand(nv, generator=g), torch.randn(nv, generator=g) * 0.3, 1 + rnd(dv, s=0.1),
                          Linear(rnd(hidden, nv * dv, s=0.1)), nk, nv, dk, dv, 1e-6)
    x, conv_state, ssm = rnd(n, hidden), rnd(k - 1, c), torch.randn(nv, dk, dv, generator=g) * 0.1
    proj = mixer.proj(x)
    o_ref, window, states_ref = mixer.mix(proj, conv_state, ssm, True, parents)  # the torch path (on the CPU)
    _, z, b, a = proj.split([mixer.conv_dim, mixer.value_dim, nv, nv], dim=-1)
    dev = [t.to(DEV) for t in (window, mixer.conv_t, z, b, a, mixer.neg_a, mixer.dt_bias, mixer.norm_weight, ssm)]
    rows = conv_rows(parents, k) if parents is not None else None
    o, states = td.step(*dev, parents, nk, nv, dk, dv, 1e-6, rows)
    if dtype == torch.float32:
        torch.testing.assert_close(states.cpu(), states_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    else:  # the conv's bf16 roundings land differently: agreement to a few bf16 steps
        scale = o_ref.float().abs().max()
        assert (o.cpu().float() - o_ref.float()).abs().max() < 0.06 * scale
        assert (states.cpu() - states_ref).abs().max() < 0.06 * states_ref.abs().max()
