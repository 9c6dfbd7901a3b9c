"""The fused C++ attention kernel against torch references, for every format it reads."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from turbospec.kernels import attention as fused
from turbospec.kv.formats import get_format, rotate
from turbospec.kv.kernel_args import attention_spec
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.kv.query_rounding import key_block, round_queries
from turbospec.layers.attention import _decode_attention

pytestmark = pytest.mark.skipif(fused.load() is None, reason="attention kernel not available on this machine")

FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "tbq4_0", "tbq4_0d", "turbo2", "turbo3", "turbo4"]


def _decoded(fmt, packed):
    if fmt.rotated:
        return fmt.decode_rotated(packed)
    return fmt.decode(packed, packed.dim)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("d", [40, 64, 80, 128, 192, 256])  # 40: odd chunk count; 192: three 64-value turbo blocks
def test_partial_softmax_matches_torch_on_decoded_cache(name, d):
    g = torch.Generator().manual_seed(d)
    fmt = get_format(name)
    spec = attention_spec(fmt, d)
    assert spec is not None
    kvh, t, rows = 2, 600, 5  # 600 positions: three tiles, the last one partial
    kp = fmt.encode(torch.randn(kvh, t, d, generator=g))
    vp = fmt.encode(torch.randn(kvh, t, d, generator=g))
    q = torch.randn(kvh, rows, d, generator=g) * 0.3
    width = fmt.padded_dim(d)
    kd = fmt.decode_rotated(kp) if fmt.rotated else fmt._decode_padded(kp)
    vd = fmt.decode_rotated(vp) if fmt.rotated else fmt._decode_padded(vp)
    kd, vd = kd.reshape(kvh, t, width), vd.reshape(kvh, t, width)
    qq = rotate(q) if fmt.rotated else F.pad(q, (0, width - d))
    s, e = 7, 590
    scores = round_queries(qq, key_block(fmt, d)) @ kd[:, s:e].transpose(1, 2)  # integer keys: q read at 8 bits
    m_ref = scores.amax(-1)
    p = torch.exp(scores - m_ref[..., None])
    out_ref = (p @ vd[:, s:e]) / p.sum(-1, keepdim=True)
    m, lsum, acc = fused.partial(qq.contiguous(), spec, [kp[f] for f in spec[2]], spec, [vp[f] for f in spec[2]],
                                 width, s, e)
    assert m.shape == (kvh, rows) and acc.shape == (kvh, rows, width)
    assert torch.allclose(m, m_ref, atol=1e-5)
    assert torch.allclose(acc / lsum[..., None], out_ref, atol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("d", [40, 64, 80, 128, 192])
def test_decode_rows_equals_the_formats_decoder(name, d):
    """The C++ decoder (prefill's committed blocks) gives the torch decoders' float32 values bit for bit."""
    g = torch.Generator().manual_seed(d + 1)
    fmt = get_format(name)
    spec = attention_spec(fmt, d)
    kp = fmt.encode(torch.randn(3, 50, d, generator=g) * 2)
    width = fmt.padded_dim(d)
    ref = fmt.decode_rotated(kp) if fmt.rotated else fmt._decode_padded(kp)
    out = fused.decode(spec, [kp[f] for f in spec[2]], width, 7, 43)
    assert out.shape == (3, 36, width) and out.dtype == torch.float32
    assert torch.equal(out, ref.reshape(3, 50, width)[:, 7:43])


def test_turbo_prod_has_no_kernel_path():
    assert attention_spec(get_format("turbo4p"), 64) is None


@pytest.mark.parametrize("heads", [8, 6])  # 6: three query heads per KV head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_decode_matches_softmax_reference(dtype, heads):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(heads, 1, 64, generator=g).to(dtype)
    keys = torch.randn(2, 300, 64, generator=g).to(dtype)
    values = torch.randn(2, 300, 64, generator=g).to(dtype)
    got = _decode_attention(q, keys, values)
    qg = q.float().reshape(2, heads // 2, 64)
    ref = torch.softmax(qg @ keys.float().transpose(1, 2) / math.sqrt(64), -1) @ values.float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref.reshape(heads, 1, 64), atol=tol)


@pytest.mark.parametrize("h", [4, 6])  # 6: three query heads per KV head (the bundled model)
@pytest.mark.parametrize("kv", [("q4_0", "turbo3"), ("tbq4_0", "q8_0"), ("f16", "turbo4")])
def test_cache_attend_same_with_and_without_kernel(kv, h, monkeypatch):
    """QuantKVCache.attend: kernel (committed part) + torch (scratch part, causal / tree masks) equals the
    all-torch block loop, for a chunked prefill, a decode step and a tree step."""
    g = torch.Generator().manual_seed(2)
    d, kvh = 64, 2

    def run():
        cache = QuantKVCache(1, kvh, d, 128, kv[0], kv[1], block=16)
        outs = []
        for n, tree in ((40, False), (30, False), (1, False), (3, True)):
            q = torch.randn(h, n, d, generator=g)
            k = torch.randn(kvh, n, d, generator=g)
            v = torch.randn(kvh, n, d, generator=g)
            cache.begin(n)
            plan = AttentionPlan.tree(cache.length, [-1, 0, 0]) if tree else AttentionPlan.causal(cache.length, n)
            outs.append(cache.attend(0, q, k, v, plan, 1.0 / math.sqrt(d)))
            cache.commit()
        return outs

    state = g.get_state()
    with_kernel = run()
    g.set_state(state)
    monkeypatch.setenv("TURBOSPEC_NO_ATTN_KERNEL", "1")
    without = run()
    for a, b in zip(with_kernel, without):
        assert torch.allclose(a, b, atol=2e-5)


def test_dense_decode_torch_fallback_agrees_with_kernel(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 1, 64, generator=g)
    keys = torch.randn(2, 100, 64, generator=g).to(torch.bfloat16)
    values = torch.randn(2, 100, 64, generator=g).to(torch.bfloat16)
    with_kernel = _decode_attention(q, keys, values)
    monkeypatch.setenv("TURBOSPEC_NO_ATTN_KERNEL", "1")
    assert fused.dense_decode(q, keys, values, 0.125) is None
    assert torch.allclose(_decode_attention(q, keys, values), with_kernel, atol=1e-5)


def test_round_queries_puts_each_block_on_an_8_bit_grid():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 64, generator=g)
    q[1, 32:] = 0.0
    r = round_queries(q, 32)
    for x, y in zip(q.unflatten(-1, (-1, 32)).reshape(-1, 32), r.unflatten(-1, (-1, 32)).reshape(-1, 32)):
        if not x.any():
            assert not y.any()  # a zero block stays zero
            continue
        scale = x.abs().max() / 127
        steps = y / scale
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= 127.001
        assert (y - x).abs().max() <= scale / 2 + 1e-6
    # a partial last block is rounded as the kernels' zero-padded rows are
    assert torch.equal(round_queries(q[:, :40], 32), round_queries(F.pad(q[:, :40], (0, 24)), 32)[:, :40])
    assert round_queries(q, None) is q


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tbq4_0", "turbo3", "turbo4"])
def test_a_position_scores_the_same_in_any_range(name):
    """The AVX-512 score kernels take 16 positions per vector (a partial group repeats its last position): a
    position's score depends on that position alone. The max over one position is its score; over a range, the max
    of those, bit for bit, whatever the range's start and length."""
    g = torch.Generator().manual_seed(5)
    fmt, d, t = get_format(name), 64, 50
    spec, width = attention_spec(fmt, d), fmt.padded_dim(d)
    kp, vp = fmt.encode(torch.randn(1, t, d, generator=g)), fmt.encode(torch.randn(1, t, d, generator=g))
    q = torch.randn(1, 4, d, generator=g) * 0.3
    q = (rotate(q) if fmt.rotated else F.pad(q, (0, width - d))).contiguous()
    kf, vf = [kp[f] for f in spec[2]], [vp[f] for f in spec[2]]
    single = torch.stack([fused.partial(q, spec, kf, spec, vf, width, i, i + 1)[0] for i in range(t)])
    for s, e in ((0, 50), (3, 50), (5, 21), (17, 33), (1, 2)):
        assert torch.equal(fused.partial(q, spec, kf, spec, vf, width, s, e)[0], single[s:e].amax(0)), (s, e)


def test_avx2_and_avx512_attention_agree():
    """The same attention with TURBOSPEC_NO_AVX512=1 (AVX2: float products of the rounded queries) in a child
    process: integer keys give the same scores through int8 products, the others the same sums in another order;
    plain values (f32 / f16 / bf16: the AVX-512 pass over 64 values at a time) the same sums in the same order."""
    code = ("import torch,sys,torch.nn.functional as F; from turbospec.kernels import attention as A\n"
            "from turbospec.kv.formats import get_format, rotate; from turbospec.kv.kernel_args import attention_spec\n"
            "g=torch.Generator().manual_seed(6); out=[]\n"
            "for n in ('q8_0','q4_0','tbq4_0','turbo3','turbo4','f16','bf16','f32'):\n"
            "  f=get_format(n); s=attention_spec(f,128); w=f.padded_dim(128)\n"
            "  k=f.encode(torch.randn(2,300,128,generator=g)); v=f.encode(torch.randn(2,300,128,generator=g))\n"
            "  q=torch.randn(2,6,128,generator=g)*0.2; q=(rotate(q) if f.rotated else q).contiguous()\n"
            "  m,l,a=A.partial(q,s,[k[x] for x in s[2]],s,[v[x] for x in s[2]],w,0,300); out.append(a/l[...,None])\n"
            "torch.save(out, sys.argv[1])\n")
    got = {}
    for flag in ("0", "1"):
        path = f"{os.environ.get('TMPDIR', '/tmp')}/attn_avx_{flag}_{os.getpid()}.pt"
        env = dict(os.environ)
        env.pop("TURBOSPEC_NO_AVX512", None)
        if flag == "1":
            env["TURBOSPEC_NO_AVX512"] = "1"
        subprocess.run([sys.executable, "-c", code, path], env=env, check=True, cwd=Path(__file__).parents[1])
        got[flag] = torch.load(path, weights_only=True)
        os.unlink(path)
    for a, b in zip(got["0"], got["1"]):
        assert torch.allclose(a, b, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got["0"][-3:], got["1"][-3:]))  # plain keys and values
