"""On a CUDA GPU (skipped elsewhere; benchmarks/gpu_check.sh runs these first): the bundled models' greedy output
equals the CPU's (or first differs at a near-tie), and every drafter's greedy output equals plain greedy decoding
on the GPU, for plain and packed KV formats; sampling runs there with a seeded generator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turbospec import device
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.kv.plan import AttentionPlan
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["turbospec-tiny", "turbospec-tiny-hybrid"]
PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9], [100, 3, 77, 3, 100, 3, 77], list(range(40, 72))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def on():
    """Run under device.use(name); the CPU is put back after."""
    def use(name: str):
        device.use(name)
    yield use
    device.use("cpu")


def tokens(model, prompts, kv=None, spec=None, params=GREEDY, drafter_spec: SpecConfig | None = None):
    drafter = make_drafter(drafter_spec, model, 300) if drafter_spec is not None else None
    cfg = EngineConfig(ctx=300, ubatch=16, cache_type_k=kv, cache_type_v=kv,
                       spec=spec or SpecConfig())
    eng = Engine(model, None, cfg, drafter=drafter)
    return [eng.generate([p], params)[0]["tokens"] for p in prompts]


def tie_gap(model, prompt, out_cpu, out_gpu) -> tuple[int, float]:
    """(index, logit gap in the CPU model) of the first token where the two outputs differ: a near-tie when small."""
    i = next(i for i, (a, b) in enumerate(zip(out_cpu, out_gpu)) if a != b)
    ids = torch.tensor(prompt + out_cpu[:i])
    cache = model.new_cache(len(ids) + 1)
    logits = model.logits(model.forward(ids, AttentionPlan.causal(0, len(ids)), cache, out_rows=1))[0]
    return i, float(logits[out_cpu[i]] - logits[out_gpu[i]])


@pytest.mark.parametrize("kv", [None, "q8_0", "tbq4_0", "turbo3"])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_greedy_equals_cpu(on, name, kv):
    on("cpu")
    cpu_model = load_model(ROOT / "models" / name, "float32")
    cpu = tokens(cpu_model, PROMPTS, kv)
    on("cuda")
    gpu_model = load_model(ROOT / "models" / name, "float32")
    assert gpu_model.embed.is_cuda
    gpu = tokens(gpu_model, PROMPTS, kv)
    for prompt, a, b in zip(PROMPTS, cpu, gpu):
        if a != b:
            on("cpu")
            i, gap = tie_gap(cpu_model, prompt, a, b)
            assert gap < 1e-2, f"first difference at token {i}, CPU logit gap {gap:.4g}: cpu {a} gpu {b}"
            on("cuda")


SPECS = [("draft-mtp", {}), ("draft-mtp", {"mtp_topk": 2}), ("ngram", {}), ("suffix", {}),
         ("ngram-mod,draft-mtp", {}), ("draft-mtp", {"adaptive": True})]


@pytest.mark.parametrize("kv", [None, "f16", "q4_0", "tbq4_0", "turbo3"])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_speculation_is_lossless(on, name, kv):
    on("cuda")
    model = load_model(ROOT / "models" / name, "float32")
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = tokens(model, PROMPTS[:2], kv, params=p)
    for spec_type, kw in SPECS:
        sc = SpecConfig.parse(spec_type, n_max=3, **kw)
        got = tokens(model, PROMPTS[:2], kv, spec=sc, drafter_spec=sc, params=p)
        assert got == plain, (spec_type, kw)


@pytest.mark.parametrize("name", MODELS)
def test_gpu_bf16_and_sampling(on, name):
    on("cuda")
    model = load_model(ROOT / "models" / name, "bfloat16")
    sc = SpecConfig.parse("draft-mtp", n_max=3)
    assert tokens(model, PROMPTS[:2], "tbq4_0", spec=sc, drafter_spec=sc) == tokens(model, PROMPTS[:2], "tbq4_0")
    p = SamplingParams(temperature=0.8, max_tokens=16, seed=7, ignore_eos=True)
    a = tokens(model, PROMPTS[:1], params=p, spec=sc, drafter_spec=sc)
    b = tokens(model, PROMPTS[:1], params=p, spec=sc, drafter_spec=sc)
    assert a == b and len(a[0]) == 16
