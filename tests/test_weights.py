"""Packed weights (turbospec.weights, kernels/quant.cpp): llama.cpp's block bytes, the gguf package's
dequantization, the fused products against float products of the same weights, rows in a batch equal to rows
alone, the AVX2 and AVX-512 paths, and models loaded packed (--weights, GGUF files) against their references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_files import qwen3_gguf
from turbospec import weights as W
from turbospec.config import EngineConfig
from turbospec.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.kernels import packed
from turbospec.kernels.gemv import load_kernel
from turbospec.layers.linear import Linear
from turbospec.model import load_model
from turbospec.model.gguf_export import export_gguf
from turbospec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="packed weights need the AVX2 kernel")

FORMATS = list(W.PACKED)
MODELS = Path(__file__).resolve().parents[1] / "models"


def matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0, :40] = 0.0  # an all-zero block (scale 0)
    w[1, 5] = 30.0  # an outlier
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_gives_the_gguf_reference_bytes(fmt, dtype):
    w = matrix(24, 512).to(dtype)
    p = W.quantize(w, fmt)
    ref = gguf.quants.quantize(w.float().numpy(), getattr(gguf.GGMLQuantizationType, W.PACKED[fmt].gguf_type))
    assert p.shape == (24, 512 // 32, W.PACKED[fmt].block_bytes)
    assert np.array_equal(p.numpy().reshape(24, -1), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_the_gguf_reference_bit_for_bit(fmt):
    p = W.quantize(matrix(16, 768 if fmt != "q4_k" else 512), fmt)
    ref = gguf.quants.dequantize(p.numpy().reshape(16, -1), getattr(gguf.GGMLQuantizationType, W.PACKED[fmt].gguf_type))
    assert np.array_equal(W.dequantize(p).numpy(), ref)
    assert np.array_equal(W.dequantize(p, slice(3, 7)).numpy(), ref[3:7])


def test_q4_k_blocks_round_trip_closely():
    """The Q4_K quantizer (llama.cpp's make_qkx2 search) keeps the error of 4.5-bit weights."""
    w = matrix(32, 1024)
    err = (W.dequantize(W.quantize(w, "q4_k")) - w).norm() / w.norm()
    err4_0 = (W.dequantize(W.quantize(w, "q4_0")) - w).norm() / w.norm()
    assert err < err4_0 < 0.15


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cols", [512, 768, 2304])
def test_fused_product_matches_the_float_product(fmt, cols):
    if cols % W.PACKED[fmt].block_values:
        pytest.skip("not whole blocks")
    w, k = matrix(67, cols), load_kernel()
    p = W.quantize(w, fmt)
    ref_w = W.dequantize(p)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(1))
    b = torch.randn(67)
    for m in (1, 2, 3, 16, 20):  # 20 > the skinny limit: the dequantized-tile path
        y = k.packed_linear(x[:m], p, b, 16)
        want = x[:m] @ ref_w.T + b
        rel = float((y - want).norm() / want.norm())
        assert rel < (1e-6 if m > 16 else 2e-2), (m, rel)  # int8 activations: ~0.5% like llama.cpp's Q8 inputs
    solo = torch.cat([k.packed_linear(x[i:i + 1], p, b, 16) for i in range(16)])
    assert torch.equal(k.packed_linear(x[:16], p, b, 16), solo)  # a row's result does not depend on its batch


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_weight_rows_result_does_not_depend_on_its_neighbours(fmt):
    """The kernels take 4 weight rows per step (1 at a range's end): rows moved to other positions of a step, or
    into a tail, give the same bits."""
    w, k = matrix(71, 768), load_kernel()
    p = W.quantize(w, fmt)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(2))
    for m in (1, 2, 5):
        full = k.packed_linear(x[:m], p, None, 16)
        for a, b in ((1, 71), (2, 9), (3, 4), (5, 70)):
            assert torch.equal(k.packed_linear(x[:m], p[a:b].contiguous(), None, 16), full[:, a:b]), (m, a, b)


@pytest.mark.parametrize("fmt", [*FORMATS, "q5_k", "q6_k"])
def test_long_rows_one_at_a_time_give_the_batch_bits(fmt):
    """Rows longer than 1152 bytes go through one at a time for a few input rows (faster streamed from memory) and
    4 at a time for more: a row's result is the same bits either way."""
    k = load_kernel()
    p = blocks(fmt, 37, 2304, 5)
    assert p.shape[1] * p.shape[2] > 1152
    x = torch.randn(20, 2304, generator=torch.Generator().manual_seed(3))
    batch = k.packed_linear(x, p, None, 64)  # 20 rows: 4 weight rows at a time
    assert torch.equal(batch, torch.cat([k.packed_linear(x[i:i + 1], p, None, 64) for i in range(20)]))
    assert torch.equal(batch[:3], k.packed_linear(x[:3], p, None, 64))


def test_avx2_and_avx512_paths_agree():
    """The same products with TURBOSPEC_NO_AVX512=1 (the AVX2 path) in a child process, every packed format: the
    same int8 sums, float sums in another order."""
    code = ("import torch,sys; sys.path.insert(0,'.'); from turbospec import weights as W\n"
            "from turbospec.kernels.gemv import load_kernel; from tests.test_weights import blocks\n"
            "torch.manual_seed(0); x=torch.randn(3,2304); out=[]\n"
            "for f in ('q8_0','q4_0','q4_k'):\n"
            "  w=torch.randn(50,2304); out.append(load_kernel().packed_linear(x,W.quantize(w,f),None,16))\n"
            "for f in ('q5_k','q6_k'): out.append(load_kernel().packed_linear(x,blocks(f,37,2304,3),None,16))\n"
            "torch.save(out, sys.argv[1])\n")
    got = {}
    for flag in ("0", "1"):
        path = f"{os.environ.get('TMPDIR', '/tmp')}/avx_{flag}_{os.getpid()}.pt"
        env = {**os.environ, "TURBOSPEC_NO_AVX512": "1"} if flag == "1" else dict(os.environ)
        env.pop("TURBOSPEC_NO_AVX512", None) if flag == "0" else None
        subprocess.run([sys.executable, "-c", code, path], env=env, check=True, cwd=Path(__file__).parents[1])
        got[flag] = torch.load(path, weights_only=True)
        os.unlink(path)
    for a, b in zip(got["0"], got["1"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


x8 = pytest.mark.skipif(load_kernel() is None or not load_kernel().interleaved_here(),
                        reason="TURBOSPEC_NO_INTERLEAVE is set")


def blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A packed matrix: Q5_K / Q6_K as random blocks (no quantizer here), the other formats quantized from
    `matrix`."""
    if fmt in ("q5_k", "q6_k"):
        return torch.from_numpy((q5_k_blocks if fmt == "q5_k" else q6_k_blocks)(rows, cols, seed))
    return W.quantize(matrix(rows, cols, seed), fmt)


@x8
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k"])
def test_linear_interleaves_blocks_and_keeps_every_rows_bytes(fmt, monkeypatch):
    """`Linear` rearranges a Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K matrix into 8-row interleaved blocks (the same bytes
    in another order; Q8_0's values + 128): every row comes back as its ggml blocks, and dequantizes and looks up
    bit for bit as before; the caller's tensor is untouched, and matrices whose rows (or Q8_0 / Q4_0's columns, in
    128s) do not fit stay as they are."""
    p = blocks(fmt, 72, 1024)
    before = p.clone()
    lin = Linear(p)
    assert torch.equal(p, before)
    x8 = W.INTERLEAVED[W.format_of(p)]
    assert W.format_of(lin.weight) is x8 and tuple(lin.weight.shape) == (9, 1024 // x8.block_values, x8.block_bytes)
    assert (lin.out_features, lin.in_features) == (72, 1024) and lin.nbytes == p.numel()
    assert torch.equal(W.ggml_blocks(lin.weight), p)
    ids = torch.tensor([71, 0, 8, 13, 13])
    assert torch.equal(W.ggml_blocks(lin.weight, ids), p[ids])
    assert torch.equal(W.dequantize(lin.weight), W.dequantize(p))
    assert torch.equal(W.dequantize(lin.weight, slice(5, 17)), W.dequantize(p, slice(5, 17)))
    assert torch.equal(W.rows_of(lin.weight, ids, torch.float32), W.dequantize(p)[ids])
    assert torch.equal(lin.take(ids).weight, p[ids])
    assert W.format_of(Linear(blocks(fmt, 68, 512)).weight).name == fmt
    from turbospec import env  # without huge pages Linear keeps no copy of its own: the rearrangement copies
    monkeypatch.setattr(env, "HUGEPAGES", False)
    assert torch.equal(W.ggml_blocks(Linear(p).weight), before) and torch.equal(p, before)
    if fmt in ("q8_0", "q4_0"):
        assert W.format_of(Linear(W.quantize(matrix(72, 96), fmt)).weight).name == fmt


@x8
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k"])
def test_interleaved_products_equal_the_one_row_kernels(fmt):
    """The same int8 sums as the kernels over the file's layout, added in float32 in another order; a row's result
    does not depend on its batch or on the rows beside it; above the skinny limit both take the same dequantized
    tiles (equal bits)."""
    k = load_kernel()
    p = blocks(fmt, 72, 1024)
    w8 = Linear(p).weight
    x = torch.randn(20, 1024, generator=torch.Generator().manual_seed(4))
    b = torch.randn(72)
    for m in (1, 2, 3, 7, 16):  # (Q4_0 / Q8_0 on AVX-512: rows in fours, then a pair, then one)
        y, want = k.packed_linear(x[:m], w8, b, 16), k.packed_linear(x[:m], p, b, 16)
        assert float((y - want).norm() / want.norm()) < 1e-6, m
    assert torch.equal(k.packed_linear(x, w8, b, 16), k.packed_linear(x, p, b, 16))
    solo = torch.cat([k.packed_linear(x[i:i + 1], w8, b, 16) for i in range(16)])
    assert torch.equal(k.packed_linear(x[:16], w8, b, 16), solo)
    assert torch.equal(k.packed_linear(x[:7], w8, b, 16), solo[:7])
    part = Linear(blocks(fmt, 72, 1024)[16:48].contiguous()).weight  # groups 2-5 alone
    assert torch.equal(k.packed_linear(x[:3], part, None, 16), k.packed_linear(x[:3], w8, None, 16)[:, 16:48])


@x8
def test_interleaved_avx2_kernels_equal_the_file_layouts():
    """With TURBOSPEC_NO_AVX512=1 (the AVX2 kernels, in a child process) interleaved Q8_0 / Q4_0 / Q4_K / Q5_K /
    Q6_K products equal the products over the file's layout (float sums in another order) and a row's result does
    not depend on its batch."""
    code = ("import torch,sys; sys.path.insert(0,'.'); from turbospec import weights as W\n"
            "from turbospec.layers.linear import Linear; from turbospec.kernels.gemv import load_kernel\n"
            "from tests.test_weights import blocks\n"
            "k=load_kernel(); torch.manual_seed(0); x=torch.randn(16,1024); b=torch.randn(72); bad=[]\n"
            "for f in ('q8_0','q4_0','q4_k','q5_k','q6_k'):\n"
            "  p=blocks(f,72,1024,1); w8=Linear(p).weight\n"
            "  assert W.format_of(w8).rows==8, W.format_of(w8)\n"
            "  for m in (1,2,3,16):\n"
            "    y,want=k.packed_linear(x[:m],w8,b,16),k.packed_linear(x[:m],p,b,16)\n"
            "    if float((y-want).norm()/want.norm())>=1e-6: bad.append((f,m))\n"
            "  solo=torch.cat([k.packed_linear(x[i:i+1],w8,b,16) for i in range(16)])\n"
            "  if not torch.equal(k.packed_linear(x,w8,b,16),solo): bad.append((f,'batch'))\n"
            "assert not bad, bad\n")
    env = {**os.environ, "TURBOSPEC_NO_AVX512": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=Path(__file__).parents[1])


def test_linear_and_embedding_rows():
    w = matrix(64, 256)
    p = W.quantize(w, "q4_k")
    lin = Linear(p)
    assert (lin.out_features, lin.in_features, lin.nbytes) == (64, 256, 64 * 144)
    x = torch.randn(2, 256)
    assert torch.allclose(lin(x), x @ W.dequantize(p).T, rtol=0, atol=0.05 * float((x @ w.T).abs().max()))
    x40 = torch.randn(40, 256)  # a 40-node verification step: every row as a single-token step gives it
    assert torch.equal(lin(x40), torch.cat([lin(x40[i:i + 1]) for i in range(40)]))
    ids = torch.tensor([[3, 0], [63, 3]])
    rows = W.rows_of(p, ids, torch.float32)
    assert rows.shape == (2, 2, 256) and torch.equal(rows[0, 0], W.dequantize(p)[3])
    with pytest.raises(TurboSpecError, match="whole 256-value blocks"):
        W.quantize(torch.zeros(4, 100), "q4_k")


def test_fused_parts_of_different_formats_stay_packed_apart():
    """q/k/v (gate/up) parts in different formats (a Q4_K_M file's Q6_K attn_v) are not widened: a SplitLinear
    multiplies each packed part and concatenates; parts in one format are concatenated into one matrix."""
    from turbospec.layers.linear import SplitLinear

    a, b = W.quantize(matrix(32, 256), "q8_0"), W.quantize(matrix(16, 256, 1), "q4_0")
    lin = Linear.fused([a, b], [None, None], torch.float32)
    assert isinstance(lin, SplitLinear) and lin.out_features == 48 and lin.nbytes == a.numel() + b.numel()
    x = torch.randn(3, 256)
    assert torch.equal(lin(x), torch.cat([Linear(a)(x), Linear(b)(x)], -1))
    same = Linear.fused([a, W.quantize(matrix(8, 256, 2), "q8_0")], [None, None], torch.float32)
    assert isinstance(same, Linear) and same.packed and W.ggml_blocks(same.weight).shape == (40, 8, 34)


def q6_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    raw[..., -2:] = rng.uniform(1e-3, 2e-2, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return raw


def q5_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 176), dtype=np.uint8)
    raw[..., :4] = rng.uniform(1e-3, 2e-2, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)  # d, dmin
    return raw


@pytest.mark.parametrize("fmt", ["q5_k", "q6_k"])
def test_k_blocks_from_files_multiply_packed(fmt):
    """Q5_K / Q6_K as GGUF files hold them: dequantization bit-exact with the gguf package (C++ and the torch
    reference), products as the float ones."""
    raw = (q5_k_blocks if fmt == "q5_k" else q6_k_blocks)(24, 512)
    p = torch.from_numpy(raw)
    ref = gguf.quants.dequantize(raw.reshape(24, -1), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    assert W.format_of(p).name == fmt and np.array_equal(W.dequantize(p).numpy(), ref)
    assert np.array_equal(packed.dequantize_torch(p).numpy(), ref)
    x = torch.randn(20, 512)
    want = x @ torch.from_numpy(ref).T
    got = load_kernel().packed_linear(x, p, None, 64)  # 20 rows: 4 weight rows at a time; 1 row: one at a time
    assert float((got - want).norm() / want.norm()) < 2e-2
    solo = torch.cat([load_kernel().packed_linear(x[i:i + 1], p, None, 64) for i in range(20)])
    assert torch.equal(got, solo)


@pytest.mark.parametrize("base", ["q4_k", "q5_k"])
def test_k_m_style_file_runs_with_mixed_blocks(tmp_path, base):
    """A qwen3 file laid out like Q4_K_M / Q5_K_M (Q4_K or Q5_K q/k/gate/up/o, Q6_K v/down/output): every matrix
    stays packed in its file type, the split q/k/v layer runs op by op, and greedy decoding equals the same model
    with every matrix dequantized to float32 (up to the int8 rounding of the inputs: compared on logits)."""
    from turbospec.kv.plan import AttentionPlan

    rng = np.random.default_rng(0)
    h, vocab = 256, 300

    def matrix(i, name, rows, cols):  # Q6_K for v and down (as the _M mixes do in half the layers), base otherwise
        if name in ("attn_v", "ffn_down"):
            return q6_k_blocks(rows, cols, 2 + i + 10 * (name == "ffn_down")).reshape(rows, -1), Q.Q6_K
        if base == "q5_k":  # random blocks, scaled as the quantized Q4_K ones (values of ~0.05)
            raw = q5_k_blocks(rows, cols, 20 + i + 10 * len(name))
            raw[..., :4] = np.array([0.0015, 0.024], dtype=np.float16).view(np.uint8)
            return raw.reshape(rows, -1), Q.Q5_K
        x = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)
        return W.quantize(x, "q4_k").numpy().reshape(rows, -1), Q.Q4_K

    Q = gguf.GGMLQuantizationType
    path = qwen3_gguf(tmp_path / "m.gguf", matrix, hidden=h, ffn=512, layers=2, heads=4, kv_heads=2, head_dim=64,
                      vocab=vocab, output=(q6_k_blocks(vocab, h, 1).reshape(vocab, -1), Q.Q6_K))
    from turbospec.layers.linear import SplitLinear

    m = load_model(path, "float32")
    assert isinstance(m.layers[0].attn.qkv, SplitLinear) and m.layers[0].mlp.down.packed and m.lm_head.packed
    assert W.format_of(m.layers[0].mlp.down.weight).gguf_type == "Q6_K"  # (interleaved where the CPU can)
    assert W.format_of(m.layers[0].mlp.gate_up.weight).gguf_type == base.upper()
    ids = list(range(3, 40))

    def logits(model):
        cache = model.new_cache(64)
        out = [model.logits(model.forward(torch.tensor(ids), AttentionPlan.causal(0, len(ids)), cache))]
        cache.commit()
        for j, t in enumerate((7, 8, 9)):  # decode steps: the packed products
            out.append(model.logits(model.forward(torch.tensor([t]), AttentionPlan.causal(len(ids) + j, 1), cache)))
            cache.commit()
        return torch.cat(out)

    got = logits(m)
    for layer in m.layers:  # the same weights as float32
        parts = layer.attn.qkv.parts
        layer.attn.qkv = Linear(torch.cat([W.dequantize(p.weight) for p in parts]))
        for name in ("o",):
            setattr(layer.attn, name, Linear(W.dequantize(getattr(layer.attn, name).weight)))
        layer.mlp.gate_up = Linear(W.dequantize(layer.mlp.gate_up.weight))
        layer.mlp.down = Linear(W.dequantize(layer.mlp.down.weight))
    m.lm_head = Linear(W.dequantize(m.lm_head.weight))
    want = logits(m)
    assert float((got - want).norm() / want.norm()) < 6e-2  # int8 inputs through 2 random layers: ~3%
def greedy(model, ids, n=24, spec=None):
    from turbospec.config import SpecConfig
    from turbospec.speculative.registry import make_drafter

    cfg = EngineConfig(ctx=256, prefix_cache=False, spec=spec or SpecConfig())
    drafter = make_drafter(cfg.spec, model, 256) if spec else None
    eng = Engine(model, None, cfg, drafter)
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]["tokens"]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_bundled_hybrid_packed_close_to_float_and_mtp_lossless(fmt):
    """--weights on the bundled hybrid: the logits stay near the float model's (KLD small), and MTP drafting over
    the packed model gives exactly its own greedy tokens."""
    from turbospec.config import SpecConfig
    from turbospec.kv.plan import AttentionPlan

    path = MODELS / "turbospec-tiny-hybrid"
    ref, packed = load_model(path, "float32"), load_model(path, "float32", fmt)
    assert packed.weight_bytes < ref.weight_bytes / (3 if fmt == "q8_0" else 6)
    ids = list(range(5, 45))
    lp = []
    for m in (ref, packed):
        cache = m.new_cache(64)
        h = m.forward(torch.tensor(ids), AttentionPlan.causal(0, len(ids)), cache)
        lp.append(torch.log_softmax(m.logits(h), -1))
    kld = float((lp[0].exp() * (lp[0] - lp[1])).sum(-1).mean())
    assert kld < (0.01 if fmt == "q8_0" else 0.1), kld
    plain = greedy(packed, ids)
    assert greedy(packed, ids, spec=SpecConfig(types=("draft-mtp",), n_max=3)) == plain


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_gguf_blocks_load_packed_as_the_files_bytes(tmp_path, kind):
    """An exported Q8_0 / Q4_0 file loads with its matrices packed, byte for byte the file's blocks, and the model
    equals the checkpoint quantized at load (the same reference quantizer)."""
    path = MODELS / "turbospec-tiny"
    out = tmp_path / f"m-{kind}.gguf"
    export_gguf(path, out, kind)
    from_file, at_load = load_model(out, "float32"), load_model(path, "float32", kind)
    qkv = from_file.layers[0].attn.qkv
    assert qkv.packed and W.format_of(W.ggml_blocks(qkv.weight)).name == kind  # (interleaved where the CPU can)
    for a, b in ((from_file.layers[0].mlp.down, at_load.layers[0].mlp.down),
                 (from_file.layers[1].attn.qkv, at_load.layers[1].attn.qkv)):
        assert torch.equal(a.weight, b.weight)
    f = gguf.GGUFReader(str(out))
    raw = next(t for t in f.tensors if t.name == "blk.0.ffn_down.weight")
    down = W.ggml_blocks(from_file.layers[0].mlp.down.weight)
    assert np.array_equal(down.numpy().reshape(raw.data.shape), raw.data)
    ids = list(range(3, 30))
    assert greedy(from_file, ids, 12) == greedy(at_load, ids, 12)


def test_weights_flag_is_validated():
    with pytest.raises(TurboSpecError, match="--weights"):
        EngineConfig(weights="q3_k")
    assert EngineConfig(weights="Q4_K").weights == "q4_k"


INT8_ANY = ("q8_0", "q4_0", "q4_k", "q5_k")  # interleaved, these take the int8 kernel for 16-bit prefill rows


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k"])
def test_bf16_prefill_rows(fmt):
    """Prefill rows of a bfloat16 model: through the int8 kernel at any row count for the formats of
    `weights.INT8_ANY_ROWS` (each row's result is the row's alone, close to the float product), else through tiles
    dequantized straight to bfloat16, row by row: the same bits as dequantizing to float32 and rounding with torch
    (file layout and interleaved); scales of inf / NaN (a damaged file) give the same infinities and NaNs. float32
    rows take the tiles whatever the format."""
    k = load_kernel()
    p = blocks(fmt, 72, 1024, 6)
    if fmt == "q8_0":  # row 3: a block scaled by inf (inf and NaN weights), row 9: one scaled by NaN
        p[3, 1, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)
        p[9, 0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(2)).bfloat16()
    tiles = k.packed_linear(x, p, None, 16)  # 40 rows, above the skinny limit: the file's layout takes tiles
    if fmt == "q8_0":
        assert bool(torch.isnan(tiles[:, 3]).all()) and bool(torch.isnan(tiles[:, 9]).all())
    for w in (p, Linear(p).weight):
        got = k.packed_linear(x, w, None, 16)
        want = torch.mm(x, W.dequantize(w).to(torch.bfloat16).t())
        if W.format_of(w) in W.INT8_ANY_ROWS:
            solo = torch.cat([k.packed_linear(x[i:i + 1], w, None, 16) for i in range(40)])
            assert torch.equal(torch.isnan(got), torch.isnan(solo))
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(solo))
            ok = slice(10, None) if fmt == "q8_0" else slice(None)  # (q8_0's damaged rows 3 and 9: inf / NaN)
            assert float((got[:, ok].float() - want[:, ok].float()).norm() / want[:, ok].float().norm()) < 3e-2
            f32 = k.packed_linear(x.float(), w, None, 16)[:, ok]
            assert torch.allclose(f32, (x.float() @ W.dequantize(w).t())[:, ok], rtol=1e-4, atol=1e-3)  # tiles
            continue
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert any(W.format_of(w) in W.INT8_ANY_ROWS for w in (p, Linear(p).weight)) == (
        fmt in INT8_ANY and load_kernel().interleaved_here())


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_moe_experts_kernel_takes_k_quant_experts(fmt):
    """A MoE layer's routed experts in a K-quant (as a Q4_K_M / Q5_K_M file's experts stay, in the file's layout)
    through `moe_experts`: each pair's result is its expert's products one by one (float32 intermediates; within
    rounding)."""
    k = load_kernel()
    h, inter = 256, 512
    gate = [blocks(fmt, inter, h, 10 + i) for i in range(3)]
    up = [blocks(fmt, inter, h, 20 + i) for i in range(3)]
    down = [blocks(fmt, h, inter, 30 + i) for i in range(3)]
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(5))
    rows, weights = [0, 0, 1], [0.5, 0.25, 1.0]
    got = k.moe_experts(x, gate, up, down, rows, weights)
    want = torch.zeros(2, h)
    for e, (r, wt) in enumerate(zip(rows, weights)):
        xr = x[r:r + 1]
        act = torch.nn.functional.silu(k.packed_linear(xr, gate[e], None, 16)) * k.packed_linear(xr, up[e], None, 16)
        want[r] += wt * k.packed_linear(act, down[e], None, 16)[0]
    assert float((got - want).norm() / want.norm()) < 1e-3
