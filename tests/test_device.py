"""--device: names, errors, the CPU default; the tensor sources for other devices and for random real-size models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from turbospec import device
from turbospec.config import EngineConfig
from turbospec.errors import TurboSpecError
from turbospec.model.config import ModelConfig
from turbospec.model.loader import WeightSource
from turbospec.model.placement import OnDevice, RandomSource, layer_names
from turbospec.model.registry import build_model

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "models" / "turbospec-tiny-hybrid"


def test_device_names_and_errors():
    assert device.resolve("cpu") == torch.device("cpu")
    assert device.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(TurboSpecError, match="expected cpu, cuda"):
        device.resolve("tpu:0:1")
    with pytest.raises(TurboSpecError, match="cpu or cuda"):
        device.resolve("meta")
    if not torch.cuda.is_available():
        with pytest.raises(TurboSpecError, match="sees no CUDA GPU"):
            device.resolve("cuda")
    for bad in ("gpu", "cuda:x", ""):
        if bad:
            with pytest.raises(TurboSpecError, match="--device"):
                EngineConfig(device=bad)
    assert EngineConfig(device=" CUDA:1 ").device == "cuda:1"


def test_cpu_keeps_the_kernels_and_the_default_device():
    assert device.use("cpu") == torch.device("cpu")
    assert device.cpu_kernels() and not device.on_gpu()
    assert torch.empty(1).device.type == "cpu"


def test_on_device_moves_tensors_packed_blocks_included():
    ws = OnDevice(WeightSource(HYBRID), torch.device("cpu"))
    assert ws.has("model.norm.weight") and "model.norm.weight" in ws.names()
    assert ws.get("model.norm.weight", torch.float32, (256,)).dtype == torch.float32

    class Packed:
        def matrix(self, name, dtype, shape):
            return torch.ones(4, 2, 18, dtype=torch.uint8)

    blocks = OnDevice(Packed(), torch.device("meta")).matrix("w", torch.float32, (4, 64))
    assert blocks.device.type == "meta" and blocks.shape == (4, 2, 18) and blocks.dtype == torch.uint8


def test_random_source_builds_a_bigger_model_of_the_template_family():
    """layer_names + RandomSource: a hybrid of 12 layers (every 4th attention) with an untied head, from the bundled
    8-layer hybrid's tensor names; it runs a forward."""
    cfg_dict = json.loads((HYBRID / "config.json").read_text())
    template = WeightSource(HYBRID).names()
    big = {**cfg_dict, "num_hidden_layers": 12, "tie_word_embeddings": False, "hidden_size": 128,
           "intermediate_size": 256, "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                     for i in range(12)]}
    cfg = ModelConfig.from_dict(big)
    names = layer_names([n for n in template if not n.startswith("medusa")], cfg, cfg_dict["layer_types"])
    names.append("lm_head.weight")
    assert sum(n.endswith("self_attn.q_proj.weight") and n.startswith("model.") for n in names) == 3
    assert sum(n.endswith("linear_attn.A_log") for n in names) == 9
    model = build_model(cfg, RandomSource(names, seed=1), torch.float32)
    assert model.mtp is not None and len(model.layers) == 12
    from turbospec.kv.plan import AttentionPlan

    cache = model.new_cache(32)
    hidden = model.forward(torch.arange(5), AttentionPlan.causal(0, 5), cache)
    assert hidden.shape == (5, 128) and torch.isfinite(model.logits(hidden)).all()
    with pytest.raises(TurboSpecError, match="missing tensor"):
        RandomSource(names).get("model.layers.0.nope", torch.float32, (2,))
