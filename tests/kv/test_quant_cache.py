"""QuantKVCache: packed K/V formats with block-wise attention (vs dense attention over decoded K/V)."""

import math

import pytest
import torch
import torch.nn.functional as F

from turbospec.config import EngineConfig, SpecConfig
from turbospec.demo import make_demo_model, qwen3_config, random_qwen3_weights, write_checkpoint
from turbospec.engine import Engine
from turbospec.kv import kernel_args
from turbospec.kv.cache import KVCache
from turbospec.kv.formats import FORMATS
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache, make_kv_cache
from turbospec.kv.query_rounding import key_block, round_queries
from turbospec.model import load_model
from turbospec.sampling import SamplingParams

ALL = list(FORMATS)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small ops under a busy shared machine: one thread avoids thread-pool spinning (10x faster here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# relative L2 error of the attention output vs full precision on random data (measured ~0.5-0.6x these)
LOOSE = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2, "q8_0": 0.03, "q4_0": 0.25, "tbq4_0": 0.3, "tbq4_0d": 0.4,
         "turbo4": 0.3, "turbo4p": 0.3, "turbo3": 0.45, "turbo3p": 0.5, "turbo2": 0.7, "turbo2p": 0.75}


def dense_ref(q, k, v, plan, scale=None):
    """SDPA (`scale` None: 1 / sqrt(D))."""
    mask, causal = plan.sdpa_mask()
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[0] != k.shape[0], scale=scale)[0]


def as_read(cache, layer, q, s, e):
    """(q, K, V of positions [s, e), SDPA scale) as the cache's attention multiplies them: K/V decoded; against keys
    whose queries are read at 8 bits (turbospec.kv.query_rounding) q scaled and rounded per key block -- for turbo4
    in the rotated domain (q rotated as the cache rotates it: a float32 ulp decides a rounding tie now and then)."""
    d = cache.head_dim
    kd, vd = cache.read(layer, s, e)
    qb = key_block(cache.k_fmt, d)
    if qb is None:
        return q, kd, vd, None
    if not cache.k_fmt.rotated:
        return round_queries(q / d ** 0.5, qb), kd, vd, 1.0
    kr = cache.k_fmt.decode_rotated(cache._slice(cache.k, layer, s, e))
    return round_queries(kernel_args.rotate_fast(q) * (1.0 / math.sqrt(d)), qb), kr, vd, 1.0


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def run_steps(cache, q_all, k_all, v_all, sizes):
    """Feed the positions in steps of `sizes`; compare every step with dense attention over the decoded
    cache (tight) and over the full-precision K/V (loose). Returns the worst (tight, loose) errors."""
    tight = loose = 0.0
    pos = 0
    for n in sizes:
        sl = slice(pos, pos + n)
        plan = AttentionPlan.causal(cache.length, n)
        cache.begin(n)
        out = cache.attend(0, q_all[:, sl], k_all[:, sl], v_all[:, sl], plan)
        qr, kd, vd, scale = as_read(cache, 0, q_all[:, sl], 0, pos + n)
        tight = max(tight, (out - dense_ref(qr, kd, vd, plan, scale)).abs().max().item())
        loose = max(loose, rel(out, dense_ref(q_all[:, sl], k_all[:, :pos + n], v_all[:, :pos + n], plan)))
        cache.commit()
        pos += n
    return tight, loose


@pytest.mark.parametrize("fmt", ALL)
def test_attention_matches_dense_over_decoded(fmt):
    g = torch.Generator().manual_seed(1)
    h, kvh, d, total = 4, 2, 64, 119
    q, k, v = (torch.randn(n, total, d, generator=g) for n in (h, kvh, kvh))
    cache = QuantKVCache(1, kvh, d, 160, fmt, fmt, block=32)  # steps and lengths cross block boundaries
    tight, loose = run_steps(cache, q, k, v, [45, 1, 70, 3])
    assert tight < 2e-5, fmt
    assert loose < LOOSE[fmt], (fmt, loose)


@pytest.mark.parametrize("kt,vt", [("q8_0", "turbo3"), ("turbo4", "f16"), ("f32", "q4_0"), ("turbo2", "turbo4p")])
@pytest.mark.parametrize("d", [80, 128])
def test_mixed_types_and_padded_heads(kt, vt, d):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 70, d, generator=g) for n in (6, 2, 2))
    cache = QuantKVCache(1, 2, d, 80, kt, vt, block=16)
    tight, loose = run_steps(cache, q, k, v, [33, 1, 36])
    assert tight < 2e-5
    assert loose < max(LOOSE[kt], LOOSE[vt]) * 1.5


@pytest.mark.parametrize("block", [3, 64, 1024])
def test_block_size_does_not_change_the_result(block):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 100, 32, generator=g) for n in (4, 1, 1))
    ref = QuantKVCache(1, 1, 32, 100, "turbo3", "q4_0", block=100)
    got = QuantKVCache(1, 1, 32, 100, "turbo3", "q4_0", block=block)
    for c in (ref, got):
        c.begin(99)
        c.attend(0, q[:, :99], k[:, :99], v[:, :99], AttentionPlan.causal(0, 99))
        c.commit()
        c.begin(1)
    a = ref.attend(0, q[:, 99:], k[:, 99:], v[:, 99:], AttentionPlan.causal(99, 1))
    b = got.attend(0, q[:, 99:], k[:, 99:], v[:, 99:], AttentionPlan.causal(99, 1))
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "turbo3"])
def test_tree_mask_and_commit_compaction(fmt):
    g = torch.Generator().manual_seed(4)
    d, start = 32, 37
    parents = [-1, 0, 0, 1, 2, 3]  # root, two branches, ...
    n = len(parents)
    k0, v0 = torch.randn(2, start, d, generator=g), torch.randn(2, start, d, generator=g)
    qn, kn, vn = torch.randn(4, n, d, generator=g), torch.randn(2, n, d, generator=g), torch.randn(2, n, d, generator=g)
    cache = QuantKVCache(2, 2, d, 64, fmt, fmt, block=16)
    cache.begin(start)
    for layer in range(2):
        cache.attend(layer, torch.randn(4, start, d, generator=g), k0, v0, AttentionPlan.causal(0, start))
    cache.commit()
    plan = AttentionPlan.tree(start, parents)
    cache.begin(n)
    out = cache.attend(1, qn, kn, vn, plan)
    cache.attend(0, qn, kn, vn, plan)
    qr, kd, vd, scale = as_read(cache, 1, qn, 0, start + n)
    assert (out - dense_ref(qr, kd, vd, plan, scale)).abs().max().item() < 2e-5
    keep = [0, 2, 4]
    before = {(kv, name): t[:, :, start:start + n].clone() for kv, buf in (("k", cache.k), ("v", cache.v))
              for name, t in buf.items()}
    cache.commit(keep)
    assert cache.length == start + 3 and cache.pending == 0
    for (kv, name), b in before.items():  # packed entries moved, not re-encoded
        assert torch.equal(getattr(cache, kv)[name][:, :, start:start + 3], b[:, :, keep])
    # a fresh cache fed only the accepted path holds exactly the same packed entries
    ref = QuantKVCache(2, 2, d, 64, fmt, fmt, block=16)
    ref.begin(start + 3)
    for layer in range(2):
        ks, vs = torch.cat([k0, kn[:, keep]], 1), torch.cat([v0, vn[:, keep]], 1)
        ref.attend(layer, torch.randn(4, start + 3, d, generator=g), ks, vs, AttentionPlan.causal(0, start + 3))
    ref.commit()
    for name in cache.k:
        assert torch.equal(cache.k[name][:, :, :start + 3], ref.k[name][:, :, :start + 3])
    for name in cache.v:
        assert torch.equal(cache.v[name][:, :, :start + 3], ref.v[name][:, :, :start + 3])


def test_masked_prefix_base_and_truncate():
    """MTP-style: positions before `base` are skipped (the plan masks them); truncate drops committed ones."""
    g = torch.Generator().manual_seed(5)
    c = QuantKVCache(1, 1, 16, 40, "q8_0", "q8_0", block=4)
    c.length = c.base = 10
    q, k, v = torch.randn(2, 5, 16, generator=g), torch.randn(1, 5, 16, generator=g), torch.randn(1, 5, 16, generator=g)
    plan = AttentionPlan.causal(10, 5)
    keys, rows = torch.arange(15), torch.arange(10, 15)
    plan.mask = (keys[None, :] <= rows[:, None]) & (keys[None, :] >= 10)
    c.begin(5)
    out = c.attend(0, q, k, v, plan)
    qr, kd, vd, scale = as_read(c, 0, q, 10, 15)
    assert (out - dense_ref(qr, kd, vd, AttentionPlan.causal(0, 5), scale)).abs().max().item() < 2e-5
    c.commit()
    c.truncate(12)
    assert c.length == 12


# bytes per vector of one head, from the format table in docs/kv-formats.md
# bytes per head vector at head_dim 64 / 128 / 256 (turbo* at head_dim 64: one 64-value rotation block)
TABLE = {
    "f32": (256, 512, 1024), "f16": (128, 256, 512), "bf16": (128, 256, 512), "q8_0": (68, 136, 272),
    "q4_0": (36, 72, 144), "tbq4_0": (34, 68, 136), "tbq4_0d": (34, 68, 136), "turbo4": (34, 66, 132),
    "turbo3": (26, 50, 100), "turbo2": (18, 34, 68), "turbo4p": (36, 68, 136), "turbo3p": (28, 52, 104),
    "turbo2p": (20, 36, 72),
}


@pytest.mark.parametrize("fmt", ALL)
def test_bytes_per_token_per_layer(fmt):
    assert set(TABLE) == set(FORMATS)
    for d, bpv in zip((64, 128, 256), TABLE[fmt]):
        for other in ("f16", "q8_0"):
            c = QuantKVCache(3, 2, d, 10, fmt, other)
            expect = 2 * (bpv + TABLE[other][(64, 128, 256).index(d)])
            assert c.bytes_per_token_per_layer() == expect
            assert c.nbytes == expect * 3 * 10
            assert c.bytes_per_token() == expect * 3


def test_bad_values_raise():
    c = QuantKVCache(1, 1, 16, 8, "q4_0", "turbo3")
    k = torch.randn(1, 2, 16)
    k[0, 1, 3] = float("nan")
    c.begin(2)
    with pytest.raises(ValueError, match="non-finite"):
        c.attend(0, torch.randn(2, 2, 16), k, torch.randn(1, 2, 16), AttentionPlan.causal(0, 2))


def test_make_kv_cache_dispatch():
    f32 = torch.float32
    assert isinstance(make_kv_cache(2, 2, 16, 8, f32), KVCache)
    assert isinstance(make_kv_cache(2, 2, 16, 8, f32, "f32", "f32"), KVCache)
    assert isinstance(make_kv_cache(2, 2, 16, 8, torch.float16, "f16", "f16"), KVCache)
    c = make_kv_cache(2, 2, 16, 8, f32, "q8_0")
    assert isinstance(c, QuantKVCache) and (c.k_type, c.v_type) == ("q8_0", "f32")
    assert isinstance(make_kv_cache(2, 2, 16, 8, f32, "f16", "f16"), QuantKVCache)  # f16 storage, f32 math
    with pytest.raises(ValueError, match="unknown KV format"):
        make_kv_cache(2, 2, 16, 8, f32, "q3_k")


# ---- through a tiny model ---------------------------------------------------------------------------------

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_demo_model(tmp_path_factory.mktemp("qc") / "m", seed=3, **SHAPE), "float32")


def chunked_logits(model, cache, ids, ubatch, split):
    rows = []
    for s in range(0, split, ubatch):
        chunk = ids[s:min(s + ubatch, split)]
        rows.append(model.logits(model.forward(chunk, AttentionPlan.causal(cache.length, chunk.numel()), cache)))
        cache.commit()
    for t in range(split, ids.numel()):
        rows.append(model.logits(model.forward(ids[t:t + 1], AttentionPlan.causal(cache.length, 1), cache)))
        cache.commit()
    return torch.cat(rows)


def quant_cache(model, n, kt, vt, block=16):
    c = model.cfg
    return QuantKVCache(c.num_layers, c.num_kv_heads, c.head_dim, n, kt, vt, block=block)


def test_model_chunked_prefill_and_decode(tiny):
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(6))
    ref = chunked_logits(tiny, tiny.new_cache(80), ids, 64, 64)  # dense f32 KVCache
    got = chunked_logits(tiny, quant_cache(tiny, 80, "f32", "f32"), ids, 13, 50)
    assert (got - ref).abs().max().item() < 1e-4
    q8 = chunked_logits(tiny, quant_cache(tiny, 80, "q8_0", "q8_0"), ids, 13, 50)
    assert (q8 - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    assert torch.equal(q8.argmax(-1), ref.argmax(-1))
    t3 = chunked_logits(tiny, tiny.new_cache(80, k_type="turbo3", v_type="turbo3"), ids, 13, 50)
    assert (t3 - ref).abs().max().item() < 0.2 * ref.abs().max().item()


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A model with large weights: peaked, repetitive distributions that n-gram drafts can hit."""
    shape = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 64}
    cfg = qwen3_config(**shape)
    w = random_qwen3_weights(cfg, seed=11, dtype=torch.float32)
    for k in w:
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 12
    return load_model(write_checkpoint(tmp_path_factory.mktemp("qcspec") / "t", cfg, w), "float32")


PROMPTS = [[(7 * i + j) % 64 for j in range(10)] * 3 for i in range(3)] + [
    [(i * i + 3 * j) % 64 for j in range(17)] for i in range(3)]


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("turbo3", "q4_0")])
def test_speculative_greedy_equals_plain_with_quantized_cache(peaked, kt, vt):
    from turbospec.speculative.ngram import PromptLookup

    plain = Engine(peaked, None, EngineConfig(ctx=128, ubatch=8, cache_type_k=kt, cache_type_v=vt))
    spec = Engine(peaked, None, EngineConfig(ctx=128, ubatch=8, cache_type_k=kt, cache_type_v=vt, spec=SpecConfig(n_max=4)), drafter=PromptLookup(2, 4))
    assert isinstance(plain.cache, QuantKVCache) and plain.cache.k_type == kt and plain.cache.v_type == vt
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        a = plain.generate([prompt], p)[0]["tokens"]
        b = spec.generate([prompt], p)[0]["tokens"]
        assert a == b, (kt, vt, prompt)
        accepted += spec.last_stats.spec.accepted
    assert accepted > 0


def test_draft_caches_with_their_own_types(tmp_path):
    """-ctkd/-ctvd: the draft-model and MTP drafters get packed caches; greedy output is unchanged."""
    from tests.test_spec import add_mtp
    from turbospec.config import SpecConfig
    from turbospec.speculative import make_drafter
    from turbospec.speculative.draft_model import DraftModelDrafter
    from turbospec.speculative.mtp import MTPDrafter

    shape = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 64}
    cfg = qwen3_config(**shape, mtp_num_hidden_layers=1)
    w = random_qwen3_weights(cfg, seed=11, dtype=torch.float32)
    for k in w:
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 12
    add_mtp(w, cfg)
    target = load_model(write_checkpoint(tmp_path / "t", cfg, w), "float32")
    plain = Engine(target, None, EngineConfig(ctx=96, ubatch=8))
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    drafters = [MTPDrafter(target.mtp, 100, prompt_window=8, k_type="q8_0", v_type="turbo3"),
                DraftModelDrafter(target, 100, k_type="q4_0", v_type="f16")]
    sc = SpecConfig(types=("draft-mtp",), draft_k_type="float16", draft_v_type="q8_0")
    drafters.append(make_drafter(sc, target, 100))
    for d in drafters:
        assert isinstance(d.cache, QuantKVCache)
        eng = Engine(target, None, EngineConfig(ctx=96, ubatch=8, spec=SpecConfig(n_max=3)), drafter=d)
        for prompt in PROMPTS[:2] + PROMPTS[-1:]:
            assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
    assert (drafters[2].cache.k_type, drafters[2].cache.v_type) == ("f16", "q8_0")


@pytest.mark.parametrize("fmt", ALL)
def test_decode_step_fast_path_is_the_general_path_bit_for_bit(fmt):
    """One decode token takes a shortcut (lookups done once, no block loop); its output and the stored K/V equal the
    general path's exactly, in every format (those without a kernel keep the general path)."""
    g = torch.Generator().manual_seed(3)
    h, kvh, d, total = 4, 2, 64, 300
    q, k, v = (torch.randn(n, total, d, generator=g) for n in (h, kvh, kvh))
    fast, slow = (QuantKVCache(2, kvh, d, 320, fmt, fmt) for _ in range(2))
    slow.__dict__["_one_row"] = None  # the cached lookup, switched off: the general path
    for c in (fast, slow):
        c.begin(290)
        c.attend(1, q[:, :290], k[:, :290], v[:, :290], AttentionPlan.causal(0, 290))
        c.commit()
    for t in range(290, total):
        outs = []
        for c in (fast, slow):
            c.begin(1)
            outs.append(c.attend(1, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], AttentionPlan.causal(t, 1)))
            c.commit()
        assert torch.equal(outs[0], outs[1]), (fmt, t)
    for name in fast.k:
        assert torch.equal(fast.k[name], slow.k[name]) and torch.equal(fast.v[name], slow.v[name])
