"""Mixture-of-experts layers on the GPU's code path (turbospec.kernels.triton_moe): the pair kernel against float64
products of the same experts (float and packed stacks), and MoE models loaded as on a GPU (C++ kernels off, Triton
interpreted here): experts stacked, the layer's output equal to the grouped path's, a row's output independent of
its batch, the model's logits those of the CPU path, and no host read of the router's choice."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from turbospec import device
from turbospec import weights as W
from turbospec.kernels import packed
from turbospec.kernels import triton_moe as tm
from turbospec.layers import moe as moe_mod
from turbospec.model import load_model

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    pytest.importorskip("transformers")  # (writes the tiny checkpoints; a GPU machine may lack it)
    from tests.hf_moe import build

    out = tmp_path_factory.mktemp("moe")
    return {name: build(name, out) for name in ("qwen3_moe", "qwen3_5_moe")}


def run(model, ids, cache):
    from tests.hf_moe import run

    return run(model, ids, cache)


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "q8_0", "q4_k"])
def test_pair_kernel_matches_the_float_products(gpu_path, weights):
    g = torch.Generator().manual_seed(1)
    e, n, k = 5, 40, 512
    if weights in W.PACKED:
        w = torch.stack([W.random_blocks(W.PACKED[weights], (n, k), 1.0, g) for _ in range(e)])
        wf = torch.stack([packed.dequantize_torch(x) for x in w]).double()
    else:
        w = torch.randn(e, n, k, generator=g).to(getattr(torch, weights))
        wf = w.double()
    x = torch.randn(3, k, generator=g)
    rows, experts = torch.tensor([0, 0, 1, 2, 2, 1]), torch.tensor([4, 1, 1, 0, 3, 4])
    got = tm.expert_rows(x.to(DEV), rows.to(DEV), w.to(DEV), experts.to(DEV)).cpu()
    ref = torch.stack([wf[ex] @ x[r].double() for r, ex in zip(rows, experts)])
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name,weights", [("qwen3_moe", "auto"), ("qwen3_5_moe", "auto"), ("qwen3_moe", "q8_0")])
def test_moe_model_on_the_gpu_path(ckpts, monkeypatch, request, name, weights):
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))

    def logits(model):
        cache, x = model.new_cache(64), ids.to(device.current())
        return [run(model, x[:12], cache).cpu()] + [run(model, x[t:t + 1], cache).cpu() for t in range(12, 20)]

    if weights == "auto":  # the CPU path's logits (packed experts: it rounds activations to int8, so the reference
        want = logits(load_model(ckpts[name], "float32"))  # is this path's own grouped one, below)
    request.getfixturevalue("gpu_path")
    model = load_model(ckpts[name], "float32", weights=weights)
    layer = next(lay.mlp for lay in model.layers if isinstance(lay.mlp, moe_mod.MoE))
    assert layer.stacked is not None and not model.experts.entries
    calls = []
    real = tm.expert_rows
    monkeypatch.setattr(tm, "expert_rows", lambda *a: calls.append(a[1].numel()) or real(*a))
    got = logits(model)
    assert calls  # decode rows took the pair kernel (12-row prefill too: at most 64 rows)
    if weights != "auto":
        monkeypatch.setattr(moe_mod, "DEVICE_ROWS", 0)
        want = logits(model)
        monkeypatch.setattr(moe_mod, "DEVICE_ROWS", 64)
    for a, b in zip(got, want):
        assert float((a - b).norm() / b.norm()) < 1e-4

    # the layer alone: the pair kernel equals the grouped path, and a row's output does not depend on its batch
    x = torch.randn(6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEV)
    batch = layer(x)
    monkeypatch.setattr(moe_mod, "DEVICE_ROWS", 0)
    grouped = layer(x)
    torch.testing.assert_close(batch, grouped, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(moe_mod, "DEVICE_ROWS", 64)
    if layer.shared is None:  # (the router's and a shared expert's rows go through torch's GEMM, which is not
        top, idx = layer.route(x)  # batch-invariant: the routed experts' part is compared, for the same choice)
        pairs = layer._device_call(x, top, idx)
        assert all(torch.equal(layer._device_call(x[i:i + 1], top[i:i + 1], idx[i:i + 1]), pairs[i:i + 1])
                   for i in range(6))


def test_the_router_choice_stays_on_the_device(ckpts, gpu_path):
    """A decode step's MoE layers read nothing back (the grouped path reads the experts chosen for every layer)."""
    from tests.test_gpu_syncs import HostReads

    model = load_model(ckpts["qwen3_moe"], "float32")
    cache = model.new_cache(64)
    run(model, torch.arange(5, 13, device=device.current()), cache)
    with HostReads() as reads:
        run(model, torch.tensor([7], device=device.current()), cache)
    assert not [s for s in reads.sites if s.startswith("moe.py")], reads.sites



def test_moe_decode_makes_no_tensor_without_a_device(ckpts, tmp_path, gpu_path):
    """With its experts stacked, a MoE model's decode and MTP verification steps name the device of every tensor they
    make: the engine runs them with torch's default-device hook off on a GPU (`device.lean`), as for other models."""
    from tests.hf_moe import build
    from tests.test_gpu_syncs import NoDevice
    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import Engine
    from turbospec.sampling import SamplingParams
    from turbospec.speculative import make_drafter

    model = load_model(build("qwen3_5_moe", tmp_path, mtp=True), "float32")
    sc = SpecConfig.parse("draft-mtp", n_max=3)
    eng = Engine(model, None, EngineConfig(ctx=128, ubatch=16, spec=sc), drafter=make_drafter(sc, model, 140))
    assert eng.lean is device.lean
    prompt = [5, 9, 17, 33, 5, 9, 17, 33]
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with NoDevice() as made:
        eng.generate([prompt + [2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert not made.sites, made.sites
