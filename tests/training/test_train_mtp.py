"""`python -m training.heads --kind mtp`: self-distillation of a checkpoint's own MTP module onto its frozen base."""

import json

import pytest
import torch
from safetensors.torch import load_file

from turbospec.config import EngineConfig, SpecConfig
from turbospec.demo import qwen3_config, random_qwen3_weights, write_checkpoint
from turbospec.engine import Engine
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter

pytest.importorskip("transformers")

TEXT = ("def add(x, y):\n    return x + y\n\n" + "The quick brown fox jumps over the lazy dog. " * 2) * 40


def _add_mtp(w: dict, cfg: dict) -> None:
    layer = random_qwen3_weights({**cfg, "num_hidden_layers": 1}, seed=3, dtype=torch.float32)
    for k, v in layer.items():
        if k.startswith("model.layers.0."):
            w["mtp.layers.0." + k[len("model.layers.0."):]] = v
    g = torch.Generator().manual_seed(3)
    w["mtp.fc.weight"] = torch.randn(cfg["hidden_size"], 2 * cfg["hidden_size"], generator=g) * 0.1
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{n}.weight"] = torch.ones(cfg["hidden_size"])


@pytest.fixture
def model_with_mtp(tmp_path):
    cfg = qwen3_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=272, mtp_num_hidden_layers=1)
    w = random_qwen3_weights(cfg, seed=1, dtype=torch.float32)
    for k in w:  # peaked distributions: a learnable two-ahead target
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 20
    _add_mtp(w, cfg)
    path = write_checkpoint(tmp_path / "m", cfg, w)
    (tmp_path / "t.txt").write_text(TEXT)
    return path, tmp_path / "t.txt"


def test_distils_mtp_in_place_resumes_and_stays_lossless(model_with_mtp, tmp_path):
    from training.heads import main

    path, text = model_with_mtp
    before = load_file(str(path / "model.safetensors"))
    js = tmp_path / "s.json"
    common = ["--kind", "mtp", "-m", str(path), "--text", str(text), "--seq-len", "32", "--batch",
              "4", "--lr", "3e-3", "--save-every", "5", "--no-progress", "--eval-windows", "4"]
    assert main(common + ["--steps", "5"]) == 0
    assert main(common + ["--steps", "30", "--resume", "--json", str(js)]) == 0
    s = json.loads(js.read_text())
    assert s["start_step"] == 5 and s["steps_done"] == 30
    after = load_file(str(path / "model.safetensors"))
    assert set(after) == set(before)
    for k in before:  # only mtp.* changed, dtypes kept
        assert after[k].dtype == before[k].dtype
        assert torch.equal(after[k], before[k]) != k.startswith("mtp.") or k.endswith("norm.weight"), k
    # the first run's 5 steps already moved the loss: compare the resumed run's eval with a fresh model's
    assert s["eval_loss_after"] < s["eval_loss_before"]
    assert s["eval_agreement_after"] >= s["eval_agreement_before"]
    # the distilled MTP drives greedy generation losslessly
    target = load_model(path, "float32")
    drafter = make_drafter(SpecConfig.parse("draft-mtp", n_max=3), target, 300, str(path))
    spec = Engine(target, None, EngineConfig(ctx=256, ubatch=16, spec=SpecConfig(n_max=3)), drafter=drafter)
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=16))
    prompt = [t + 3 for t in TEXT[:40].encode()]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert spec.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]


def test_checkpoint_without_mtp_is_a_clear_error(tmp_path):
    from training.heads import main

    cfg = qwen3_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=272)
    path = write_checkpoint(tmp_path / "m", cfg, random_qwen3_weights(cfg, seed=1, dtype=torch.float32))
    (tmp_path / "t.txt").write_text(TEXT)
    rc = main(["--kind", "mtp", "-m", str(path), "--text", str(tmp_path / "t.txt"), "--steps", "1",
               "--no-progress"])
    assert rc != 0
