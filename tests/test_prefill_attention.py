"""Prompt chunks at depth on the CPU: torch's flash kernel per block of the context, merged by log-sum-exp
(`kernels.attention.prefill_rows`, and the committed blocks of `QuantKVCache.attend`), against softmax
references and against the paths they replace."""

import math

import pytest
import torch

from turbospec.kernels import attention as fused
from turbospec.kv.cache import KVCache
from turbospec.kv.paged import BlockPool, PagedBatch, PagedSequence, Segment
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.layers.attention import Attention

pytestmark = pytest.mark.skipif(not fused.prefill_rows_available(), reason="no CPU flash kernel in this torch")


def _reference(q, keys, values, start):
    """Causal softmax attention in float64 (GQA by repeating KV heads)."""
    h, r, d = q.shape
    g = h // keys.shape[0]
    k = keys.double().repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)
    scores = q.double() @ k.transpose(1, 2) / math.sqrt(d)
    pos = torch.arange(start, start + r)[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[1])[None, :] > pos, -math.inf)
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 6])  # 6: three query heads per KV head
@pytest.mark.parametrize("start,rows", [(0, 20), (37, 20), (37, 1), (64, 33)])
def test_prefill_rows_match_softmax_reference(dtype, heads, start, rows, monkeypatch):
    monkeypatch.setattr(fused, "PREFILL_BLOCK", 16)  # several blocks and a ragged last one
    g = torch.Generator().manual_seed(start + rows + heads)
    q = torch.randn(heads, rows, 64, generator=g).to(dtype)
    keys = torch.randn(2, start + rows, 64, generator=g).to(dtype)
    values = torch.randn(2, start + rows, 64, generator=g).to(dtype)
    got = fused.prefill_rows(q, keys, values, start)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), _reference(q, keys, values, start), atol=tol)


def test_attention_over_a_plain_cache_equals_sdpa_without_the_flash_kernel(monkeypatch):
    """Attention.mix for a prompt chunk at depth: the flash path and SDPA (where torch lacks the kernel) agree."""
    g = torch.Generator().manual_seed(5)
    attn = Attention(None, None, num_heads=6, num_kv_heads=2, head_dim=64)  # mix needs no projections
    monkeypatch.setattr(fused, "PREFILL_BLOCK", 32)

    def run():
        cache = KVCache(1, 2, 64, 256, torch.float32)
        outs = []
        for n in (70, 50, 40):
            q = torch.randn(n, 6, 64, generator=g)
            k, v = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
            cache.begin(n)
            outs.append(attn.mix(q, k, v, AttentionPlan.causal(cache.length, n), cache, 0))
            cache.commit()
        return outs

    state = g.get_state()
    flash = run()
    g.set_state(state)
    monkeypatch.setattr(fused, "_FLASH", None)
    assert fused.prefill_rows(torch.zeros(2, 3, 64), torch.zeros(2, 3, 64), torch.zeros(2, 3, 64), 0) is None
    sdpa = run()
    for a, b in zip(flash, sdpa):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kv", [("q8_0", "q8_0"), ("tbq4_0", "tbq4_0"), ("q4_0", "turbo3"), ("turbo4", "f16")])
def test_packed_cache_prompt_chunks_equal_the_matmul_blocks(kv, monkeypatch):
    """QuantKVCache.attend for chunks of more rows than the fused kernel takes: the committed blocks through
    the flash kernel equal the matmul / online-softmax blocks (the last, causal block is the same code)."""
    d, kvh, h = 64, 2, 6

    def run():
        g = torch.Generator().manual_seed(7)
        cache = QuantKVCache(1, kvh, d, 256, kv[0], kv[1], block=16)
        outs = []
        for n in (70, 50, 40):
            q = torch.randn(h, n, d, generator=g)
            k, v = torch.randn(kvh, n, d, generator=g), torch.randn(kvh, n, d, generator=g)
            cache.begin(n)
            outs.append(cache.attend(0, q, k, v, AttentionPlan.causal(cache.length, n), 1.0 / math.sqrt(d)))
            cache.commit()
        return outs

    flash = run()
    monkeypatch.setattr(fused, "prefill_rows_available", lambda: False)
    blocks = run()
    for a, b in zip(flash, blocks):
        assert torch.allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("kv", [("f16", "f16"), ("q8_0", "q8_0"), ("tbq4_0", "tbq4_0"), ("q4_0", "turbo3")])
@pytest.mark.parametrize("last", [1, 5])
def test_packed_cache_attends_only_a_chunks_last_rows(kv, last):
    """A prompt chunk whose last `last` rows alone are wanted (prefill's last layer): those rows equal the same
    rows of the whole chunk's attention, and the cache stores every row's K/V (the next chunks agree too)."""
    d, kvh, h = 64, 2, 6
    g = torch.Generator().manual_seed(11)
    full, part = (QuantKVCache(1, kvh, d, 256, kv[0], kv[1], block=16) for _ in range(2))
    for n in (70, 50, 40):
        q = torch.randn(h, n, d, generator=g)
        k, v = torch.randn(kvh, n, d, generator=g), torch.randn(kvh, n, d, generator=g)
        plan = AttentionPlan.causal(full.length, n)
        full.begin(n)
        part.begin(n)
        want = full.attend(0, q, k, v, plan, 1.0 / math.sqrt(d))[:, -last:]
        got = part.attend(0, q[:, -last:], k, v, plan, 1.0 / math.sqrt(d))
        assert got.shape == (h, last, d)
        assert torch.allclose(got, want, atol=2e-5)
        full.commit()
        part.commit()
    assert all(torch.equal(a, b) for a, b in zip(full.buffers(), part.buffers()))
    with pytest.raises(ValueError, match="causal plan"):
        part.begin(3)
        part.attend(0, q[:, :2], k[:, :3], v[:, :3], AttentionPlan.tree(part.length, [-1, 0, 0]), 0.125)


@pytest.mark.parametrize("kv", ["q8_0", "tbq4_0", "turbo4", "turbo3"])
@pytest.mark.parametrize("d", [64, 80])  # 80: turbo's rotation pads K to 128
def test_paged_prompt_chunk_equals_the_contiguous_cache(kv, d):
    """A prompt chunk after committed positions attends over the paged pool as over a QuantKVCache holding the same
    bytes: queries against integer keys rounded in the same domain (turbo4: after the rotation)."""
    kvh, h, scale = 2, 6, 1.0 / math.sqrt(d)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 70, d, generator=g) for n in (h, kvh, kvh))
    cache = QuantKVCache(1, kvh, d, 128, kv, kv, block=32)
    pool = BlockPool(1, kvh, d, 8, k_type=kv, v_type=kv, block=16)
    seq = PagedSequence(pool, 128)
    outs = []
    for s, n in ((0, 40), (40, 30)):
        plan = AttentionPlan.causal(s, n)
        cache.begin(n)
        want = cache.attend(0, q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], plan, scale)
        cache.commit()
        step = PagedBatch(pool, [Segment(seq, 0, n, plan)])
        outs.append((step.attend(0, q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], scale), want))
        step.commit()
    for got, want in outs:
        assert torch.allclose(got, want, atol=3e-5), (got - want).abs().max().item()


@pytest.mark.parametrize("kv", ["f32", "q8_0", "tbq4_0", "turbo4"])  # queries rounded for integer keys (scale 1)
def test_paged_prompt_chunks_equal_sdpa(kv, monkeypatch):
    """PagedBatch.attend for prompt chunks of two sequences (one after committed positions): the flash blocks
    equal SDPA over the gathered positions."""
    d, kvh, h = 64, 2, 6
    monkeypatch.setattr(fused, "PREFILL_BLOCK", 32)

    def run():
        g = torch.Generator().manual_seed(11)
        pool = BlockPool(1, kvh, d, 8, k_type=kv, v_type=kv, block=16)
        a, b = PagedSequence(pool, 128), PagedSequence(pool, 128)
        first = PagedBatch(pool, [Segment(a, 0, 40, AttentionPlan.causal(0, 40))])
        first.attend(0, torch.randn(h, 40, d, generator=g), torch.randn(kvh, 40, d, generator=g),
                     torch.randn(kvh, 40, d, generator=g), 1.0 / math.sqrt(d))
        first.commit()
        step = PagedBatch(pool, [Segment(a, 0, 30, AttentionPlan.causal(40, 30)),
                                 Segment(b, 30, 20, AttentionPlan.causal(0, 20))])
        out = step.attend(0, torch.randn(h, 50, d, generator=g), torch.randn(kvh, 50, d, generator=g),
                          torch.randn(kvh, 50, d, generator=g), 1.0 / math.sqrt(d))
        step.commit()
        return out

    flash = run()
    monkeypatch.setattr(fused, "_FLASH", None)
    assert torch.allclose(flash, run(), atol=2e-5)
