"""The fused decode layer (turbospec/layers/block.py: two C++ calls around the mixer) against the op-by-op path."""

import pytest
import torch

from tests.hf_hybrid import build as build_hybrid
from turbospec.kernels.gemv import load_kernel
from turbospec.kv.plan import AttentionPlan
from turbospec.layers import block
from turbospec.model import load_model

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="C++ kernels unavailable")
# float32: the same math in another order (measured ~4e-7 relative); 16-bit: both paths round at the same points
# (measured bit-identical here), so at most the odd value a rounding step or two apart (bf16: 2^-7 relative per
# step; the prefill both paths share runs torch's GEMM, whose last bit can vary from run to run)
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def steps(model, ids, monkeypatch, fused: bool):
    """Prefill 20 tokens (torch path), decode 5 single tokens, then one 4-token step: logits of each, and the
    cache afterwards."""
    monkeypatch.setattr(block, "ENABLED", fused)
    cache = model.new_cache(64)
    model.forward(ids[:20], AttentionPlan.causal(0, 20), cache)
    cache.commit()
    out = []
    for t in range(20, 25):
        out.append(model.logits(model.forward(ids[t:t + 1], AttentionPlan.causal(cache.length, 1), cache)))
        cache.commit()
    out.append(model.logits(model.forward(ids[25:29], AttentionPlan.causal(cache.length, 4), cache)))
    cache.commit()
    return torch.cat(out), cache


def compare(model, dtype, monkeypatch):
    ids = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(4))
    got, c1 = steps(model, ids, monkeypatch, True)
    ref, c2 = steps(model, ids, monkeypatch, False)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOL[dtype] * max(scale, 1.0)
    if dtype == "float32":
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    kv1, kv2 = getattr(c1, "kv", c1), getattr(c2, "kv", c2)
    for a, b in zip(kv1.buffers(), kv2.buffers()):
        assert (a.float() - b.float()).abs().max().item() <= TOL[dtype] * max(b.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied_bias", "llama3_rope"])
def test_dense_fused_matches_op_by_op(hf_models, name, dtype, monkeypatch):
    compare(load_model(hf_models[name], dtype), dtype, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_fused_matches_op_by_op(tmp_path, dtype, monkeypatch):
    compare(load_model(build_hybrid("qwen3_5", tmp_path), dtype), dtype, monkeypatch)


def split_input_projections(model):
    """Each mixer's input projection (qkv, the Gated DeltaNet's inputs) as parts in different formats, as a Q4_K_M
    GGUF file's Q6_K attn_v beside Q4_K q/k: rows in Q8_0, in Q4_0 and in float32 (with the bias, if any, split)."""
    from turbospec import weights as W
    from turbospec.layers.linear import Linear, SplitLinear

    for layer in model.layers:
        mixer = getattr(layer, "attn", None) or layer.mixer
        lin = mixer.linears()[0]
        w, b = lin.weight, lin.bias
        cut = [0, w.shape[0] // 3, 2 * w.shape[0] // 3, w.shape[0]]
        parts = [Linear(W.quantize(w[cut[0]:cut[1]].float(), "q8_0")), Linear(W.quantize(w[cut[1]:cut[2]].float(), "q4_0")),
                 Linear(w[cut[2]:].contiguous())]
        for i, part in enumerate(parts):
            part.bias = None if b is None else b[cut[i]:cut[i + 1]]
        setattr(mixer, "qkv" if hasattr(mixer, "qkv") else "proj", SplitLinear(parts))
    return model


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied_bias"])
def test_fused_layer_takes_parts_in_different_formats(hf_models, name, monkeypatch):
    """A q/k/v projection in parts of different formats runs through the fused calls (each part's product into its
    columns), as the op-by-op path computes it."""
    model = split_input_projections(load_model(hf_models[name], "float32"))
    calls = _count_fused_layers(monkeypatch)
    compare(model, "float32", monkeypatch)
    assert calls


def _count_fused_layers(monkeypatch) -> list:
    """A list that grows by one per attention layer step run by the fused calls: `decode_layer` (a step at a plain
    cache's end, the layer's arguments cached) or `attention_layer` (every other fused step)."""
    calls: list = []
    orig_layer, orig_decode = block.attention_layer, block.decode_layer

    def decode(*a):
        out = orig_decode(*a)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(block, "attention_layer", lambda *a: calls.append(1) or orig_layer(*a))
    monkeypatch.setattr(block, "decode_layer", decode)
    return calls


def test_hybrid_fused_layer_takes_parts_in_different_formats(tmp_path, monkeypatch):
    """The Gated DeltaNet layers' input projections in parts (Qwen3.5 GGUF files hold in_proj_qkv, z, b and a
    apart, in different types) go through `gdn_layer` too."""
    from turbospec.layers.gated_deltanet import load_gdn_kernel

    if load_gdn_kernel() is None:
        pytest.skip("Gated DeltaNet kernel unavailable")
    model = split_input_projections(load_model(build_hybrid("qwen3_5", tmp_path), "float32"))
    calls = []
    k = load_kernel()

    class Counting:
        def __getattr__(self, name):
            if name == "gdn_layer":
                return lambda *a: calls.append(1) or k.gdn_layer(*a)
            return getattr(k, name)

    kernel_for = block.kernel_for
    monkeypatch.setattr(block, "kernel_for", lambda x, norm: Counting() if kernel_for(x, norm) is not None else None)
    compare(model, "float32", monkeypatch)
    assert calls


def test_fused_path_is_taken(hf_models, monkeypatch):
    """The fused calls run for decode-sized steps (so the comparisons above compare two different paths)."""
    calls = _count_fused_layers(monkeypatch)
    model = load_model(hf_models["qwen3"], "float32")
    cache = model.new_cache(8)
    model.forward(torch.tensor([1, 2]), AttentionPlan.causal(0, 2), cache)
    assert len(calls) == len(model.layers)
    monkeypatch.setattr(block, "ENABLED", False)
    cache.commit()
    model.forward(torch.tensor([3]), AttentionPlan.causal(2, 1), cache)
    assert len(calls) == len(model.layers)


def test_hybrid_gdn_layer_is_one_call(tmp_path, monkeypatch):
    """Gated DeltaNet layers of a decode / verification step (chain or tree) run as one `gdn_layer` call."""
    from turbospec.layers.gated_deltanet import load_gdn_kernel

    if load_gdn_kernel() is None:
        pytest.skip("Gated DeltaNet kernel unavailable")
    model = load_model(build_hybrid("qwen3_5", tmp_path), "float32")
    k = load_kernel()
    calls = []
    orig = k.gdn_layer
    monkeypatch.setattr(k, "gdn_layer", lambda *a: calls.append(1) or orig(*a))
    cache = model.new_cache(16)
    model.forward(torch.tensor([1, 2, 3]), AttentionPlan.causal(0, 3), cache)
    cache.commit()
    model.forward(torch.tensor([4, 5, 6]), AttentionPlan.tree(3, [-1, 0, 0]), cache)
    cache.commit([0, 2])
    assert len(calls) == 2 * model.num_gdn_layers and cache.length == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_input_fused_matches_op_by_op(tmp_path, dtype, monkeypatch):
    """The MTP block's input (norms, concatenation, fc) as one C++ call equals the op-by-op path."""
    from tests.hf_hybrid import to_multimodal

    model = load_model(to_multimodal(build_hybrid("qwen3_5", tmp_path), tmp_path / "mm"), dtype)
    mtp = model.mtp
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(8, model.cfg.hidden_size, generator=g)
    toks = torch.randint(0, 128, (8,), generator=g)
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(block, "ENABLED", fused)
        cache = mtp.new_cache(32)
        rows = [mtp.forward(toks[:5], hidden[:5], AttentionPlan.causal(0, 5), cache)]
        cache.commit()
        for t in range(5, 8):  # drafting-sized steps
            rows.append(mtp.forward(toks[t:t + 1], hidden[t:t + 1], AttentionPlan.causal(cache.length, 1), cache))
            cache.commit()
        outs[fused] = torch.cat(rows).float()
    # the whole MTP layer differs between the two paths too; bf16: up to two roundings apart (measured 0.031 at a
    # scale of 3.0); a wrong input (halves swapped, a norm missing) is off by O(1)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    scale = outs[False].abs().max().item()
    assert (outs[True] - outs[False]).abs().max().item() <= tol * max(scale, 1.0)


KV = [None, ("tbq4_0", "tbq4_0"), ("q4_0", "q8_0"), ("turbo3", "turbo4")]  # None: the plain cache


def new_cache(model, n: int, kv):
    return model.new_cache(n) if kv is None else model.new_cache(n, k_type=kv[0], v_type=kv[1])


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chain_verification_rows_equal_single_steps_bit_for_bit(dtype, kv):
    """A k-token causal step over a plain or packed cache gives each row exactly the hidden state of decoding that
    token alone at its position (same tiles, same order), also where the rows straddle a 256-position attention tile,
    so verifying a draft chain reproduces token-by-token decoding; a packed cache also from a base position (an MTP
    drafter's cache skips a prompt prefix)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
    if not (path / "config.json").exists():
        pytest.skip("no bundled model")
    model = load_model(str(path), dtype)
    ids = torch.randint(3, 900, (520,), generator=torch.Generator().manual_seed(5))
    for start in (40, 253, 509):
        for k in (2, 7):
            base = 0 if kv is None else start % 37
            one = new_cache(model, 520, kv)
            many = new_cache(model, 520, kv)
            for c in (one, many):
                model.forward(ids[:start], AttentionPlan.causal(0, start), c)
                c.commit()
                c.base = base
            rows = []
            for t in range(start, start + k):
                rows.append(model.forward(ids[t:t + 1], AttentionPlan.causal(t, 1), one))
                one.commit()
            got = model.forward(ids[start:start + k], AttentionPlan.causal(start, k), many)
            assert torch.equal(got, torch.cat(rows)), (start, k)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_verification_rows_equal_single_steps_bit_for_bit(dtype, kv):
    """Each row of a draft tree verified over a plain cache equals decoding its branch token by token, also where a
    branch straddles a 256-position attention tile: trees stay exact like chains (greedy speculation with trees is
    plain decoding in every dtype)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
    if not (path / "config.json").exists():
        pytest.skip("no bundled model")
    model = load_model(str(path), dtype)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 900, (520,), generator=g)
    # root, two branches under it, a sub-branch: rows 0..6
    parents = [-1, 0, 1, 0, 3, 2, 1]
    tree_ids = torch.randint(3, 900, (len(parents),), generator=g)
    for start in (40, 250, 255, 509):
        many = new_cache(model, 530, kv)
        model.forward(ids[:start], AttentionPlan.causal(0, start), many)
        many.commit()
        got = model.forward(tree_ids, AttentionPlan.tree(start, parents), many)
        def branch(i: int) -> list[int]:  # node i's ancestors, root first, and i
            return (branch(parents[i]) if parents[i] >= 0 else []) + [i]

        for i in range(len(parents)):
            one = new_cache(model, 530, kv)
            model.forward(ids[:start], AttentionPlan.causal(0, start), one)
            one.commit()
            for d, node in enumerate(branch(i)):
                row = model.forward(tree_ids[node:node + 1], AttentionPlan.causal(start + d, 1), one)
                one.commit()
            assert torch.equal(got[i], row[0]), (start, i)
