"""A decode step on the GPU's code path waits for the device only to read the sampled token ids (issue #28: no host
round-trips inside a step), and makes no tensor without naming its device (the step runs with torch's default-device
hook off). Run on the CPU: C++ kernels off as on a GPU, the Triton kernels in the interpreter
(tests/conftest.py); every read of a tensor's value on the host (`aten._local_scalar_dense`: .item(), int(),
bool()) is counted with the turbospec line that asked for it."""

from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from turbospec import device
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.kernels import gpu
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if torch.cuda.is_available():  # the GPU code path with CPU tensors: Triton would compile for the GPU here
    pytest.skip("runs the GPU code path on the CPU (interpreter); a CUDA machine runs tests/test_gpu.py",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            ours = [f for f in traceback.extract_stack() if "/turbospec/" in f.filename]
            site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
            self.sites[site] = self.sites.get(site, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,kv,spec", [("turbospec-tiny", None, ""), ("turbospec-tiny", "tbq4_0", "draft-mtp"),
                                          ("turbospec-tiny-hybrid", "turbo3", "")])
def test_decode_reads_only_the_sampled_tokens(monkeypatch, name, kv, spec):
    monkeypatch.setattr(device, "cpu_kernels", lambda: False)  # as on a GPU: torch and Triton paths
    monkeypatch.setattr(gpu, "ON_CPU", True)
    model = load_model(ROOT / "models" / name, "float32")
    sc = SpecConfig.parse(spec, n_max=3)
    drafter = make_drafter(sc, model, 200) if spec else None
    eng = Engine(model, None, EngineConfig(ctx=192, cache_type_k=kv, cache_type_v=kv, spec=sc), drafter=drafter)
    prompt = [5, 9, 17, 33, 5, 9, 17, 33]
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with HostReads() as reads:
        out = eng.generate([prompt + [2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert reads.sites and all(s.startswith("sampling.py:") for s in reads.sites), reads.sites
    if not spec:
        assert sum(reads.sites.values()) == out["stats"].gen_tokens  # one greedy token id per step


class NoDevice(TorchFunctionMode):
    """Records every tensor made by a factory (torch.zeros, torch.tensor, ...) without a device: on a GPU such a
    tensor would land on the CPU inside a decode step (turbospec.device.lean turns torch's default device off)."""

    def __init__(self):
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            ours = [f for f in traceback.extract_stack() if "/turbospec/" in f.filename]
            site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
            self.sites[site] = self.sites.get(site, 0) + 1
        return func(*args, **kwargs)


SAMPLED = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, seed=1, repeat_penalty=1.1,
                         presence_penalty=0.2, logprobs=2, logit_bias={7: 1.0})


@pytest.mark.parametrize("name,kv,spec,kw", [
    ("turbospec-tiny", None, "", {}), ("turbospec-tiny", "tbq4_0", "draft-mtp", {"mtp_topk": 2}),
    ("turbospec-tiny", "turbo3", "suffix", {"adaptive": True}),
    ("turbospec-tiny-hybrid", None, "ngram-mod,draft-mtp", {}), ("turbospec-tiny-hybrid", "q8_0", "draft-mtp", {}),
    ("turbospec-tiny", None, "draft-mtp", {"draft_vocab": 64}),  # the reduced draft vocabulary's head rows
    ("turbospec-tiny", None, "draft-mtp", {"draft_vocab": 6000})])  # ... and the full head masked outside it
def test_decode_makes_no_tensor_without_a_device(monkeypatch, name, kv, spec, kw):
    """Prompt and decode steps, greedy and sampled (penalties, logit bias, logprobs), every drafter kind: no tensor is
    made without an explicit device, so the steps run with torch's default-device hook off on a GPU."""
    monkeypatch.setattr(device, "cpu_kernels", lambda: False)
    monkeypatch.setattr(gpu, "ON_CPU", True)
    model = load_model(ROOT / "models" / name, "float32")
    sc = SpecConfig.parse(spec, n_max=3, **kw)
    drafter = make_drafter(sc, model, 200) if spec else None
    eng = Engine(model, None, EngineConfig(ctx=192, ubatch=16, cache_type_k=kv, cache_type_v=kv, spec=sc),
                 drafter=drafter)
    prompt = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17]
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with NoDevice() as made:
        eng.generate([prompt + [2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        eng.generate([prompt + [3]], SAMPLED)
    assert not made.sites, made.sites
