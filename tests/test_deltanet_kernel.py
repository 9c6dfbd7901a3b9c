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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_for_a_batchs_sequences_equals_one_call_each(dtype):
    """`gdn_steps` (every sequence of a batched step: a decode row, a chain, a tree, with committed states as the
    pool holds them or as a step's outputs) gives each sequence's `gdn_step` outputs to the bit, its states in the
    buffer given for them (an earlier step's, overwritten) where there is one; a buffer of another size is refused."""
    from turbospec.layers.gated_deltanet import _CHAIN

    k = load_gdn_kernel()
    layer, _, _, _ = _layer(dtype, 2, 4)
    g = torch.Generator().manual_seed(1)
    c = layer.conv_dim
    sizes, trees = [1, 3, 4], [None, None, [-1, 0, 0, 1]]
    proj = (torch.randn(sum(sizes), c + layer.value_dim + 2 * layer.nv, generator=g) * 0.5).to(dtype)
    convs = [(torch.randn(3, c, generator=g)).to(dtype), (torch.randn(5, c, generator=g)).to(dtype),
             (torch.randn(3, c, generator=g)).to(dtype)]  # (the second: a step's window, its last 3 rows the state)
    ssms = [torch.randn(4, 32, 32, generator=g) * 0.1, torch.randn(2, 4, 32, 32, generator=g) * 0.1,
            torch.randn(4, 32, 32, generator=g) * 0.1]
    pars = [_CHAIN if t is None else torch.tensor(t, dtype=torch.int64) for t in trees]
    starts = [0, 1, 4, 8]
    old = torch.full((3, 4, 32, 32), float("nan"))  # the chain's states go here
    outs = [torch.empty(0), old, torch.empty(0)]
    got = k.gdn_steps(proj, layer.conv_t, layer.neg_a, layer.dt_bias, layer.norm_weight, convs, ssms, starts, pars,
                      outs, layer.nk, layer.nv, layer.dk, layer.dv, layer.eps)
    assert got[4].data_ptr() == old.data_ptr()
    with pytest.raises(RuntimeError, match="states buffer"):
        k.gdn_steps(proj, layer.conv_t, layer.neg_a, layer.dt_bias, layer.norm_weight, convs, ssms, starts, pars,
                    [torch.empty(0), torch.zeros(2, 4, 32, 32), torch.empty(0)], layer.nk, layer.nv, layer.dk,
                    layer.dv, layer.eps)
    for s in range(3):
        rows = proj[starts[s]:starts[s + 1]]
        qkv, z, b, a = rows.split([c, layer.value_dim, layer.nv, layer.nv], dim=-1)
        window = torch.cat([convs[s][-3:], qkv])
        y, states = k.gdn_step(window, layer.conv_t, z, b, a, layer.neg_a, layer.dt_bias, layer.norm_weight,
                               ssms[s] if ssms[s].dim() == 3 else ssms[s][-1], pars[s], layer.nk, layer.nv, layer.dk,
                               layer.dv, layer.eps, True)
        assert torch.equal(got[0][starts[s]:starts[s + 1]], y), s
        assert torch.equal(got[1 + 2 * s], window) and torch.equal(got[2 + 2 * s], states), s
