"""The C++ Gated DeltaNet decode/verification mixer against the Python reference path."""

import pytest
import torch

from turbospec.layers.gated_deltanet import GatedDeltaNet, load_gdn_kernel
from turbospec.layers.linear import Linear

pytestmark = pytest.mark.skipif(load_gdn_kernel() is None, reason="Gated DeltaNet kernel not available here")


def _layer(dtype, nk, nv, dk=32, dv=32, hidden=64, kernel=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = 2 * nk * dk + nv * dv

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    layer = GatedDeltaNet(Linear(r(c + nv * dv + 2 * nv, hidden, s=0.2)), r(c, 1, kernel, s=0.5),
                          torch.randn(nv, generator=g), torch.randn(nv, generator=g), 1 + r(dv, s=0.1),
                          Linear(r(hidden, nv * dv, s=0.2)), nk, nv, dk, dv, 1e-6)
    x = r(5, hidden)
    conv_state = r(kernel - 1, c)
    state = torch.randn(nv, dk, dv, generator=g) * 0.1
    return layer, x, conv_state, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)])
def test_kernel_matches_python_path(dtype, heads, monkeypatch):
    layer, x, conv_state, state = _layer(dtype, *heads)
    y_k, win_k, states_k = layer(x, conv_state, state, True)
    monkeypatch.setenv("TURBOSPEC_NO_GDN_KERNEL", "1")
    y_p, win_p, states_p = layer(x, conv_state, state, True)
    assert states_k.shape == states_p.shape == (5, heads[1], 32, 32)
    assert torch.equal(win_k, win_p)
    assert torch.allclose(states_k, states_p, atol=1e-5)
    # 16-bit: the kernel rounds where the Python path rounds, so the outputs agree to the last bit or one ulp
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y_k.float(), y_p.float(), atol=tol, rtol=tol)


def test_state_input_is_not_modified_and_prefix_states_are_consistent():
    layer, x, conv_state, state = _layer(torch.float32, 2, 4)
    before = state.clone()
    _, _, states = layer(x, conv_state, state, True)
    assert torch.equal(state, before)
    # the state after 3 tokens equals the 3rd state of the 5-token call
    _, _, states3 = layer(x[:3], conv_state, state, True)
    assert torch.allclose(states3[-1], states[2], atol=1e-6)
