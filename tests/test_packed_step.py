"""One decode token over a packed KV cache in one kernel call (`layer_packed` / `attn_packed`, turbospec/layers/
block.py) against the general path (`attn_in`, `QuantKVCache.attend`, `out_mlp`): the same logits and the same
cache bytes, bit for bit, for every format the kernels encode, dense and hybrid (gated attention) targets.
(Verification rows through the same call equal single steps: tests/test_block.py.)"""

import pytest
import torch

from tests.hf_hybrid import build as build_hybrid
from turbospec.kernels.gemv import load_kernel
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.layers import block
from turbospec.model import load_model

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="C++ kernels unavailable")
FORMATS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tbq4_0", "tbq4_0"), ("turbo3", "turbo3"), ("turbo4", "turbo2"),
           ("f16", "q4_0"), ("turbo3", "q8_0")]
_packed_step = block._packed_step


def decode(model, ids, kt, vt, monkeypatch, one_call: bool, base: int = 0):
    """Prefill 40 tokens, then decode 6 single tokens (`one_call`: through the one-call step, else the general
    path; the prefill the same way both times): their logits and the cache."""
    def general(attn, plan, cache):
        return plan.n > 1 and _packed_step(attn, plan, cache)

    monkeypatch.setattr(block, "_packed_step", _packed_step if one_call else general)
    cache = model.new_cache(64, k_type=kt, v_type=vt)
    model.forward(ids[:40], AttentionPlan.causal(0, 40), cache)
    cache.commit()
    kv = getattr(cache, "kv", cache)
    kv.base = base
    out = []
    for t in range(40, 46):
        out.append(model.logits(model.forward(ids[t:t + 1], AttentionPlan.causal(kv.length, 1), cache)))
        cache.commit()
    return torch.cat(out), kv


def same(model, kt, vt, monkeypatch, base: int = 0):
    ids = torch.randint(0, 128, (46,), generator=torch.Generator().manual_seed(7))
    got, c1 = decode(model, ids, kt, vt, monkeypatch, True, base)
    ref, c2 = decode(model, ids, kt, vt, monkeypatch, False, base)
    assert isinstance(c1, QuantKVCache) and c1.step_args(0) is not None
    assert torch.equal(got, ref)
    for a, b in zip(c1.buffers(), c2.buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kt,vt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_one_call_equals_general_path(hf_models, kt, vt, dtype, monkeypatch):
    same(load_model(hf_models["qwen3"], dtype), kt, vt, monkeypatch)


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("turbo3", "turbo3")])
def test_hybrid_one_call_equals_general_path(tmp_path, kt, vt, monkeypatch):
    same(load_model(build_hybrid("qwen3_5", tmp_path), "float32"), kt, vt, monkeypatch)


def test_one_call_attends_from_the_cache_base(hf_models, monkeypatch):
    """A cache whose first attended position is not 0 (drafters skip a prompt prefix)."""
    same(load_model(hf_models["qwen3"], "float32"), "tbq4_0", "q8_0", monkeypatch, base=9)


def test_the_one_call_path_is_taken(hf_models, monkeypatch):
    model = load_model(hf_models["qwen3"], "float32")
    k = load_kernel()
    calls = []
    orig = k.layer_packed
    monkeypatch.setattr(k, "layer_packed", lambda *a: calls.append(1) or orig(*a))
    ids = torch.arange(3, 49)
    decode(model, ids, "q4_0", "q4_0", monkeypatch, True)
    assert len(calls) == 6 * len(model.layers)


def test_a_non_finite_value_still_raises_and_writes_nothing(hf_models, monkeypatch):
    """A NaN reaching K/V: the one call writes nothing and gives the step back to the general path, whose encoder
    raises the usual error."""
    model = load_model(hf_models["qwen3"], "float32")
    cache = model.new_cache(16, k_type="q4_0", v_type="q4_0")
    model.forward(torch.tensor([1, 2, 3]), AttentionPlan.causal(0, 3), cache)
    cache.commit()
    before = [b.clone() for b in cache.buffers()]
    model.embed[5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        model.forward(torch.tensor([5]), AttentionPlan.causal(3, 1), cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers()))


def test_a_non_finite_value_in_v_alone_writes_nothing(hf_models):
    """K encodes, V does not: the one call puts K's rows back before handing the step to the general path (which
    then raises the usual error)."""
    model = load_model(hf_models["qwen3"], "float32")
    cache = model.new_cache(16, k_type="q8_0", v_type="q4_0")
    model.forward(torch.tensor([1, 2, 3]), AttentionPlan.causal(0, 3), cache)
    cache.commit()
    before = [b.clone() for b in cache.buffers()]
    attn = model.layers[0].attn
    attn.qkv.weight[-attn.kv_width:] = float("nan")  # layer 0's V rows
    k = load_kernel()
    orig, seen = k.layer_packed, []

    def spy(*a):
        out = orig(*a)
        seen.append((out, [torch.equal(x, y) for x, y in zip(before, cache.buffers())]))
        return out

    try:
        k.layer_packed = spy
        with pytest.raises(ValueError, match="non-finite"):
            model.forward(torch.tensor([5]), AttentionPlan.causal(3, 1), cache)
    finally:
        k.layer_packed = orig
    assert len(seen) == 1 and seen[0][0] is None and all(seen[0][1])
