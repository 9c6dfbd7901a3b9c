"""The Triton attention kernel (turbospec/kernels/triton_attention.py) against the torch reference, for every format
it reads: on a GPU where there is one, else on the CPU in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before Triton is first imported). And the engine end to end: greedy tokens with the kernel equal the torch path's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbospec.kernels import gpu
from turbospec.kernels import triton_attention as ta
from turbospec.kv import kernel_args
from turbospec.kv.formats import get_format

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3", "turbo2"]


@pytest.fixture
def interpret(monkeypatch):
    """On the CPU: the kernels in Triton's interpreter (tests/conftest.py set TRITON_INTERPRET before Triton loaded)."""
    if DEV == "cpu":
        monkeypatch.setattr(gpu, "ON_CPU", True)


def reference(q, kd, vd, s, e):
    sc = q @ kd[:, s:e].float().transpose(1, 2)
    m = sc.amax(-1)
    p = torch.exp(sc - m[..., None])
    return m, p.sum(-1), p @ vd[:, s:e].float()


@pytest.mark.parametrize("k_name,v_name", [(f, f) for f in FORMATS] + [("q8_0", "turbo3"), ("turbo4", "f16"),
                                                                        ("tbq4_0", "q4_0")])
@pytest.mark.parametrize("dim", [64, 128])
def test_partial_matches_the_decoded_cache(interpret, k_name, v_name, dim):
    """m, l and acc over [start, end) equal the torch computation over the format's own decoded values, with
    several spans per head (a 700-position range) and 1, 5 and 16 query rows."""
    g = torch.Generator().manual_seed(dim)
    kf, vf = get_format(k_name), get_format(v_name)
    kvh, t = 2, 760
    k = torch.randn(kvh, t, dim, generator=g)
    v = torch.randn(kvh, t, dim, generator=g)
    pk, pv = kf.encode(k), vf.encode(v)
    ks, vs = ((*s[:3], s[3].to(DEV)) for s in (kernel_args.attention_spec(kf, dim), kernel_args.attention_spec(vf, dim)))
    kw, vw = kf.padded_dim(dim), vf.padded_dim(dim)
    assert ta.supports(ks, kw) and ta.supports(vs, vw)
    kd = kf.decode_rotated(pk) if kf.rotated else kf.decode(pk, dim)
    vd = vf.decode_rotated(pv) if vf.rotated else vf.decode(pv, dim)
    pk = {n: x.to(DEV) for n, x in pk.items()}
    pv = {n: x.to(DEV) for n, x in pv.items()}
    for rows in (1, 5, 16):
        q = torch.randn(kvh, rows, kw, generator=g) * 0.3
        m, lsum, acc = ta.partial(q.to(DEV), ks, [pk[f] for f in ks[2]], vs, [pv[f] for f in vs[2]], vw, 37, t)
        rm, rl, racc = reference(q, kd, vd, 37, t)
        torch.testing.assert_close(m.cpu(), rm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close((acc / lsum[..., None]).cpu(), racc / rl[..., None], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k_name,v_name", [("f32", "f32"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("tbq4_0", "tbq4_0"),
                                            ("turbo3", "q4_0")])
def test_paged_matches_the_decoded_sequences(interpret, k_name, v_name):
    """Many sequences over a paged pool in one launch: each sequence's output equals softmax attention over its own
    positions, read through its block table (blocks out of order, shared, and of different counts)."""
    g = torch.Generator().manual_seed(3)
    kf, vf = get_format(k_name), get_format(v_name)
    kvh, dim, block, blocks = 2, 64, 32, 12
    k = torch.randn(kvh, blocks * block, dim, generator=g)
    v = torch.randn(kvh, blocks * block, dim, generator=g)
    pk, pv = kf.encode(k), vf.encode(v)
    ks, vs = ((*s[:3], s[3].to(DEV)) for s in (kernel_args.attention_spec(kf, dim), kernel_args.attention_spec(vf, dim)))
    kw, vw = kf.padded_dim(dim), vf.padded_dim(dim)
    kd = kf.decode_rotated(pk) if kf.rotated else kf.decode(pk, dim)
    vd = vf.decode_rotated(pv) if vf.rotated else vf.decode(pv, dim)
    tables = [[7, 2, 9, 0, 11], [3], [2, 5, 1], [10, 4, 6, 8, 0]]  # block 2 and 0 shared by two sequences
    lens = [150, 17, 96, 129]
    table = torch.full((4, 5), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(4, kvh, 3, kw, generator=g) * 0.3
    out = ta.paged(q.to(DEV), ks, [pk[f].to(DEV) for f in ks[2]], vs, [pv[f].to(DEV) for f in vs[2]], vw,
                   table.to(DEV), torch.tensor(lens).to(DEV), block, max(lens)).cpu()
    assert out.shape == (4, kvh, 3, vw)
    for i, (t, n) in enumerate(zip(tables, lens)):
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in t])[:n]
        _, rl, racc = reference(q[i], kd[:, slots], vd[:, slots], 0, n)
        torch.testing.assert_close(out[i], racc / rl[..., None], rtol=1e-4, atol=1e-5)


def test_plain_decode_matches_softmax_attention(interpret):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 1, 128, generator=g)
    keys = torch.randn(2, 300, 128, generator=g).to(torch.bfloat16)
    values = torch.randn(2, 300, 128, generator=g).to(torch.bfloat16)
    out = ta.decode(q.to(DEV), keys.to(DEV), values.to(DEV), 0.125).cpu()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(2, 4, 1, 128), keys.float().unsqueeze(1), values.float().unsqueeze(1), scale=0.125)
    torch.testing.assert_close(out, ref.reshape(8, 1, 128), rtol=1e-4, atol=1e-5)


def test_too_many_rows_is_refused():
    q = torch.zeros(1, ta.MAX_ROWS + 1, 64)
    with pytest.raises(ValueError, match="at most"):
        ta.partial(q, (1, 0, ("data",), torch.empty(0)), [torch.zeros(1, 4, 64)],
                   (1, 0, ("data",), torch.empty(0)), [torch.zeros(1, 4, 64)], 64, 0, 4)


ENGINE_RUN = r"""
import json, os, sys
from turbospec.kernels import gpu
from turbospec.kernels import triton_attention as ta
gpu.ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
calls = [0]
partial = ta.partial
def counted(*a, **k):
    calls[0] += 1
    return partial(*a, **k)
ta.partial = counted
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine.build import build_engine
from turbospec.sampling import SamplingParams
p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = {}
for kv in sys.argv[2].split(","):
    kv = kv or None
    for spec in ("", "draft-mtp"):
        e = build_engine(EngineConfig(model=sys.argv[1], device="cpu", ctx=256, cache_type_k=kv, cache_type_v=kv,
                                      spec=SpecConfig.parse(spec)))
        out[f"{kv}/{spec}"] = e.generate(["The quick brown fox jumps over"], p)[0]["tokens"]
out["calls"] = calls[0]
print(json.dumps(out))
"""


@pytest.mark.skipif(DEV != "cpu", reason="the GPU runs this through tests/test_gpu.py")
@pytest.mark.parametrize("model,kv", [("turbospec-tiny", ",q8_0,tbq4_0,turbo3"), ("turbospec-tiny-hybrid", "")])
def test_engine_greedy_tokens_equal_with_the_kernel(model, kv):
    """The engine without C++ kernels, once on the torch paths and once with the Triton kernels (the interpreter:
    attention, and the hybrid's Gated DeltaNet steps): the same greedy tokens for plain and packed KV, with and
    without MTP drafts."""
    runs = []
    for interp in ("0", "1"):
        env = {**os.environ, "TURBOSPEC_NO_KERNEL": "1", "TRITON_INTERPRET": interp, "TURBOSPEC_TRITON_GDN": "1"}
        r = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(ROOT / "models" / model), kv], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    torch_run, triton_run = runs
    assert torch_run.pop("calls") == 0
    assert triton_run.pop("calls") > 0
    assert triton_run == torch_run
