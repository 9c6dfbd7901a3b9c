import pytest
import torch

from tests.hf_tiny import VARIANTS, hf_logits
from turbospec.kv.plan import AttentionPlan
from turbospec.model import load_model


def full_logits(model, ids):
    cache = model.new_cache(256)
    h = model.forward(ids, AttentionPlan.causal(0, ids.numel()), cache)
    cache.commit()
    return model.logits(h)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(hf_models, name):
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf_models[name], ids)
    model = load_model(hf_models[name], "float32")
    model.rope.set_context(len(ids))  # (LongRoPE: transformers' long factors past the pretrained 32 positions)
    got = full_logits(model, ids)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qwen3", "llama3_rope", "qwen2", "phi3_partial"])
@pytest.mark.parametrize("ubatch", [1, 7, 16, 50])
def test_chunked_prefill_then_decode(hf_models, name, ubatch):
    model = load_model(hf_models[name], "float32")
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(2))
    ref = full_logits(model, ids)
    cache = model.new_cache(128)
    rows = []
    split = 40
    for s in range(0, split, ubatch):
        chunk = ids[s:min(s + ubatch, split)]
        rows.append(model.logits(model.forward(chunk, AttentionPlan.causal(cache.length, chunk.numel()), cache)))
        cache.commit()
    for t in range(split, 64):
        rows.append(model.logits(model.forward(ids[t:t + 1], AttentionPlan.causal(cache.length, 1), cache)))
        cache.commit()
    assert (torch.cat(rows) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close(hf_models, dtype):
    ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(3))
    ref = full_logits(load_model(hf_models["qwen3"], "float32"), ids)
    got = full_logits(load_model(hf_models["qwen3"], dtype), ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("kv", [None, "tbq4_0"])
def test_prefill_out_rows(hf_models, tmp_path, kind, rows, kv):
    """`out_rows` (prefill that wants only the next-token logits, or a drafter's prompt window) returns the last
    rows of a full forward and stores every row's K/V (decoding on gives the same logits), over a plain or a
    packed cache; the last attention layer attends only those rows."""
    from tests.hf_hybrid import build as build_hybrid

    model = load_model(hf_models["qwen3"] if kind == "qwen3" else build_hybrid("qwen3_5", tmp_path), "float32")
    ids = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(3))
    outs, attended = [], []  # the packed cache's query rows per call during each prefill
    for out_rows in (rows, None):
        cache = model.new_cache(64, k_type=kv, v_type=kv)
        kv_cache = cache.kv if kind == "hybrid" else cache
        seen: list[int] = []
        if kv is not None:
            attend = kv_cache.attend
            kv_cache.attend = lambda layer, q, *a, _f=attend, _s=seen: _s.append(q.shape[1]) or _f(layer, q, *a)
        h = model.forward(ids[:40], AttentionPlan.causal(0, 40), cache, out_rows=out_rows)
        attended.append(list(seen))
        cache.commit()
        nxt = model.forward(ids[40:], AttentionPlan.causal(40, 1), cache)
        outs.append((h, model.logits(h[-rows:]), model.logits(nxt)))
    (h1, l1, n1), (h2, l2, n2) = outs
    assert h1.shape[0] == rows and h2.shape[0] == 40
    assert torch.allclose(l1, l2, atol=1e-4) and torch.allclose(n1, n2, atol=1e-4)
    if kv is not None:  # with out_rows: 40 rows in every attention layer but the last; without: 40 everywhere
        layers = len(attended[1])
        assert layers >= 2 and attended == [[40] * (layers - 1) + [rows], [40] * layers]
