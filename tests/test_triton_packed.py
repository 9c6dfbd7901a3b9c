"""Packed weight blocks off the C++ kernels (turbospec.kernels.packed, triton_packed): the torch and Triton
dequantizers against the gguf package bit for bit (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K); the fused Triton product against the
float product of the dequantized weights, a row's result independent of its batch; prefill tiles; `Linear`,
embedding rows and a whole packed model on the GPU's code path (C++ kernels off, Triton on), greedy speculation
there equal to plain decoding. On a GPU where there is one, else in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from turbospec import device
from turbospec import weights as W
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.kernels import gpu, packed
from turbospec.kernels import triton_packed as tp
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.linear import Linear, SplitLinear
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = Path(__file__).resolve().parents[1] / "models"
# block bytes, values per block, the byte offsets of float16 scales, gguf type
FORMATS = {"q8_0": (34, 32, (0,), "Q8_0"), "q4_0": (18, 32, (0,), "Q4_0"), "q4_k": (144, 256, (0, 2), "Q4_K"),
           "q5_k": (176, 256, (0, 2), "Q5_K"), "q6_k": (210, 256, (208,), "Q6_K")}


@pytest.fixture
def on_gpu_path(monkeypatch):
    monkeypatch.setattr(gpu, "ON_CPU", DEV == "cpu")


def blocks(fmt: str, rows: int, nb: int, seed: int = 0) -> torch.Tensor:
    """Random packed rows: random bytes, the scales set to finite float16 values (one block's scale 0)."""
    size, _, scales, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, nb, size), generator=g, dtype=torch.uint8)
    for off in scales:
        s = (torch.rand(rows, nb, generator=g) * 0.02 + 0.001).to(torch.float16)
        s[0, 0] = 0.0
        b[..., off:off + 2] = s.unsqueeze(-1).view(torch.uint8)
    return b


def reference(b: torch.Tensor, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(b.numpy().reshape(b.shape[0], -1), getattr(gguf.GGMLQuantizationType,
                                                                             FORMATS[fmt][3]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantizers_are_the_gguf_reference_bit_for_bit(on_gpu_path, fmt):
    b = blocks(fmt, 37, 3 if FORMATS[fmt][1] == 256 else 9)
    ref = reference(b, fmt)
    assert np.array_equal(packed.dequantize_torch(b).numpy(), ref)
    ids = torch.tensor([36, 0, 5, 5, 17])
    assert np.array_equal(packed.dequantize_torch(b, ids).numpy(), ref[ids.numpy()])
    got = tp.dequantize(b.to(DEV), ids.to(DEV)).cpu()
    assert np.array_equal(got.numpy(), ref[ids.numpy()])
    every = tp.dequantize(b.to(DEV), torch.arange(37, device=DEV), torch.float16).cpu()
    assert torch.equal(every, torch.from_numpy(ref).to(torch.float16))  # rounded once from the exact values


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_product_matches_the_float_product(on_gpu_path, fmt, dtype):
    nb = 2 if FORMATS[fmt][1] == 256 else 13  # 416 values: the last value tile is partly masked
    b = blocks(fmt, 45, nb, seed=1)
    wf = torch.from_numpy(reference(b, fmt)).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, wf.shape[1], generator=g).to(dtype)
    bias = torch.randn(45, generator=g).to(dtype)
    got = tp.matmul(x.to(DEV), b.to(DEV), bias.to(DEV)).cpu()
    assert got.dtype == dtype and got.shape == (19, 45)
    ref = x.double() @ wf.T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_a_rows_result_does_not_depend_on_its_batch(on_gpu_path, fmt):
    b = blocks(fmt, 40, 2 if fmt == "q4_k" else 16, seed=3).to(DEV)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(4)).to(DEV)
    batch = tp.matmul(x, b, None)
    for i in (0, 7, 16, 20):
        assert torch.equal(tp.matmul(x[i:i + 1], b, None), batch[i:i + 1])
    assert torch.equal(tp.matmul(x[3:9], b, None), batch[3:9])


def test_linear_takes_the_fused_product_then_prefill_tiles(on_gpu_path, monkeypatch):
    w = W.random_blocks(W.PACKED["q4_k"], (48, 256), std=1.0, generator=torch.Generator().manual_seed(5))
    lin = Linear(w.to(DEV), hugepages=False)
    lin.kernel = None  # as on a GPU
    wf = packed.dequantize_torch(w).double()
    calls = []
    real = tp.matmul
    monkeypatch.setattr(tp, "matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(packed, "TILE_VALUES", 256 * 20)  # three tiles of weight rows
    for rows in (1, 64, 65, 130):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEV)
        ref = x.cpu().double() @ wf.T
        torch.testing.assert_close(lin(x).cpu().double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    assert calls == [1, 64]  # 65 and 130 rows: dequantized tiles and torch's GEMM


def test_without_triton_the_torch_path_gives_the_same_values(monkeypatch):
    monkeypatch.setattr(gpu, "ON_CPU", False)
    b = blocks("q6_k", 8, 1, seed=6)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ torch.from_numpy(reference(b, "q6_k")).double().T
    torch.testing.assert_close(packed.linear(x, b, None).double(), ref, rtol=1e-5, atol=1e-4)
    ids = torch.tensor([[1, 7], [0, 0]])
    got = packed.dequantize(b, ids, torch.float16)
    assert torch.equal(got, torch.from_numpy(reference(b, "q6_k"))[ids.reshape(-1)].to(torch.float16))


def test_a_packed_model_on_the_gpu_path_speculates_losslessly(request):
    """The bundled hybrid quantized to q8_0 as it loads, run as on a GPU (C++ kernels off: Triton products, embedding
    rows through the Triton dequantizer): its logits are the CPU path's for the same blocks up to rounding (the C++
    kernels round the activations to int8), and MTP speculation gives plain greedy decoding's tokens."""
    path = MODELS / "turbospec-tiny-hybrid"
    ids = [5, 9, 17, 33, 5, 9, 17, 33, 101, 7]
    logp = [log_probs(load_model(path, "float32", weights="q8_0"), ids)]
    request.getfixturevalue("gpu_path")
    model = load_model(path, "float32", weights="q8_0")
    linears = [v for v in vars(model.layers[0].mlp).values() if isinstance(v, Linear)]
    assert linears and all(lin.packed and lin.kernel is None for lin in linears)
    logp.append(log_probs(model, ids))
    kld = float((logp[0].exp() * (logp[0] - logp[1])).sum(-1).mean())
    assert kld < 1e-3, kld
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = Engine(model, None, EngineConfig(ctx=128)).generate([ids], params)[0]["tokens"]
    sc = SpecConfig.parse("draft-mtp", n_max=3)
    spec = Engine(model, None, EngineConfig(ctx=128, spec=sc), drafter=make_drafter(sc, model, 128)).generate(
        [ids], params)[0]
    assert spec["tokens"] == plain
    assert spec["stats"].spec.draft_tokens > 0  # drafts were verified in multi-row steps


def log_probs(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(64)
    h = model.forward(torch.tensor(ids, device=device.current()), AttentionPlan.causal(0, len(ids)), cache)
    return torch.log_softmax(model.logits(h).float(), -1).cpu()


def test_a_q4_k_m_style_gguf_file_stays_packed_on_the_gpu_path(tmp_path, gpu_path):
    """A qwen3 GGUF file laid out like Q4_K_M (Q4_K and Q6_K matrices) loaded as on a GPU: every matrix stays in its
    file's blocks, and prefill and decode logits equal those of the same weights dequantized to float32."""
    from tests.gguf_files import qwen3_gguf

    q = gguf.GGMLQuantizationType
    g = torch.Generator().manual_seed(0)

    def matrix(i, name, rows, cols):
        fmt = W.Q6_K if name in ("attn_v", "ffn_down") else W.PACKED["q4_k"]
        return W.random_blocks(fmt, (rows, cols), 0.05, g).numpy().reshape(rows, -1), getattr(q, fmt.gguf_type)

    head = W.random_blocks(W.Q6_K, (300, 256), 0.05, g).numpy().reshape(300, -1)
    path = qwen3_gguf(tmp_path / "m.gguf", matrix, hidden=256, ffn=512, layers=2, heads=4, kv_heads=2,
                      head_dim=64, vocab=300, output=(head, q.Q6_K))
    m = load_model(path, "float32")
    assert m.layers[0].mlp.down.packed and m.lm_head.packed and m.layers[0].mlp.gate_up.packed
    ids = list(range(3, 40))

    def logits(model):
        cache, dev = model.new_cache(64), device.current()
        out = [model.logits(model.forward(torch.tensor(ids, device=dev), AttentionPlan.causal(0, len(ids)), cache))]
        cache.commit()
        for j, t in enumerate((7, 8)):
            out.append(model.logits(model.forward(torch.tensor([t], device=dev), AttentionPlan.causal(len(ids) + j, 1),
                                                  cache)))
            cache.commit()
        return torch.cat(out).cpu()

    got = logits(m)
    for layer in m.layers:  # the same weights as float32 matrices
        for obj in (layer.attn, layer.mlp):
            for name, lin in list(vars(obj).items()):
                if isinstance(lin, Linear | SplitLinear) and lin.packed:
                    parts = lin.parts if isinstance(lin, SplitLinear) else [lin]
                    setattr(obj, name, Linear(torch.cat([W.dequantize(p.weight) for p in parts]), hugepages=False))
    m.lm_head = Linear(W.dequantize(m.lm_head.weight), hugepages=False)
    want = logits(m)
    assert float((got - want).norm() / want.norm()) < 1e-4
