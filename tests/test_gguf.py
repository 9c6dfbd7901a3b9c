"""GGUF files (llama.cpp's format) for the dense architectures: F32 files give the transformers checkpoint's
logits; quantized tensors load as exactly the `gguf` package's dequantization; bad files are one-line errors.

The files are written here the way llama.cpp's convert_hf_to_gguf.py writes them (its tensor names and metadata
keys, llama's q/k rows permuted for its RoPE layout); by hand, F32 and Q8_0 files written by that converter itself
(llama-cpp-python 0.3.36's copy) for qwen3 / qwen2 / llama load with the checkpoint's logits (max abs difference
4e-7 for F32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.hf_tiny import hf_logits  # noqa: E402
from turbospec.errors import TurboSpecError  # noqa: E402
from turbospec.kv.plan import AttentionPlan  # noqa: E402
from turbospec.model.gguf import GLOBAL_NAMES, LAYER_NAMES, GGUFFile, unpermute_rope  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402

ARCH = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of a llama q/k projection."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, qtype: Q = Q.F32, arch_name: str | None = None) -> Path:
    """A GGUF file of a transformers checkpoint, as llama.cpp's converter lays it out; matrices in `qtype`,
    1-D tensors (norms, biases) in F32 as llama.cpp keeps them."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch_name or ARCH[cfg["model_type"]]
    tensors: dict[str, np.ndarray] = {}
    for f in hf_dir.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = dict(GLOBAL_NAMES)
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in LAYER_NAMES.items()})
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    for hf, x in sorted(tensors.items()):
        x = x.astype(np.float32)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute(x, heads if "q_proj" in hf else kv)
        if x.ndim == 2 and qtype != Q.F32:
            w.add_tensor(names[hf], gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[hf], x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    h = model.forward(ids, AttentionPlan.causal(0, len(ids)), model.new_cache(64))
    return model.logits(h)


IDS = torch.tensor([3, 17, 99, 5, 64, 2, 127, 8, 41, 41, 12, 0])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied_bias", "qwen3_gqa3", "qwen2", "llama"])
def test_f32_file_gives_the_checkpoint_logits(hf_models, tmp_path, name):
    path = write_gguf(hf_models[name], tmp_path / f"{name}.gguf")
    got = logits(load_model(path, "float32"), IDS)
    want = hf_logits(hf_models[name], IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_quantized_tensors_load_as_the_reference_dequantization(hf_models, tmp_path, name, qtype):
    path = write_gguf(hf_models[name], tmp_path / f"{name}.gguf", qtype)
    f = GGUFFile(path)
    cfg = f.config()
    ws = f.weights(cfg)
    seen = 0
    for hf_name in ws.names():
        t = f.tensors[ws.index[hf_name]]
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
        ref = ref.reshape(tuple(reversed(t.shape.tolist())))
        if name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            ref = unpermute_rope(ref, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
        assert torch.equal(ws.get(hf_name, torch.float32), ref), hf_name  # bit-exact
        seen += t.tensor_type == qtype
    assert seen > 0
    got, want = logits(load_model(path, "float32"), IDS), hf_logits(hf_models[name], IDS)
    assert torch.isfinite(got).all() and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


def k_quant_bytes(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks (finite fp16 scales), `rows` x `cols` values."""
    block, size = gguf.quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = rng.uniform(1e-3, 2e-2, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., -2:] = scale[..., :2]
    else:  # d, dmin first
        raw[..., :4] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_tensors_load_as_the_reference_dequantization(tmp_path, qtype):
    """A qwen3-shaped file whose matrices are K-quant blocks (256 values a block: every matrix is 256 wide)."""
    rng = np.random.default_rng(0)
    h, layers, vocab, heads, hd = 256, 2, 64, 4, 64
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    for add, v in ((w.add_context_length, 256), (w.add_embedding_length, h), (w.add_block_count, layers),
                   (w.add_feed_forward_length, 256), (w.add_head_count, heads), (w.add_head_count_kv, 2),
                   (w.add_key_length, hd), (w.add_value_length, hd), (w.add_layer_norm_rms_eps, 1e-6),
                   (w.add_rope_freq_base, 10000.0)):
        add(v)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, h)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        for g, rows in (("attn_q", heads * hd), ("attn_k", 2 * hd), ("attn_v", 2 * hd), ("attn_output", h),
                        ("ffn_gate", 256), ("ffn_up", 256), ("ffn_down", h)):
            w.add_tensor(f"blk.{i}.{g}.weight", k_quant_bytes(rows, 256, qtype, rng), raw_dtype=qtype)
        for g, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            w.add_tensor(f"blk.{i}.{g}.weight", np.ones(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    ws = f.weights(f.config())
    for hf_name in ws.names():
        t = f.tensors[ws.index[hf_name]]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        assert torch.equal(ws.get(hf_name, torch.float32), torch.from_numpy(ref.reshape(ws.get(hf_name).shape)))
    model = load_model(path, "float32")
    assert model.cfg.tie_word_embeddings and torch.isfinite(logits(model, torch.tensor([1, 2, 3]))).all()


@pytest.fixture()
def good_file(hf_models, tmp_path) -> Path:
    return write_gguf(hf_models["qwen3"], tmp_path / "good.gguf")


def test_truncated_file_is_a_one_line_error(good_file, tmp_path):
    data = good_file.read_bytes()
    for cut in (10, len(data) // 3, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(TurboSpecError) as e:
            load_model(bad)
        assert "\n" not in str(e.value) and bad.name in str(e.value)


def test_unsupported_architecture_and_tensor_type(hf_models, tmp_path):
    with pytest.raises(TurboSpecError, match="architecture 'gpt2' is not supported"):
        load_model(write_gguf(hf_models["qwen3"], tmp_path / "a.gguf", arch_name="gpt2"))
    with pytest.raises(TurboSpecError, match="type Q4_1, which is not supported"):
        load_model(write_gguf(hf_models["qwen3"], tmp_path / "b.gguf", Q.Q4_1))


def test_cli_reports_a_bad_file_in_one_line(good_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:1000])
    r = subprocess.run([sys.executable, "-m", "turbospec.cli", "run", "-m", str(bad), "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr


# ---- the qwen35 hybrid ------------------------------------------------------------------------------------------
def tile_v_heads(x: torch.Tensor, dim: int, nk: int, r: int, d: int) -> torch.Tensor:
    """llama.cpp's converter order for value heads: grouped by key head -> tiled."""
    shape = list(x.shape)
    return x.reshape(*shape[:dim], nk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def write_hybrid_gguf(hf_dir: Path, out: Path) -> Path:
    """A Qwen3.5 checkpoint (with its mtp.* block) as llama.cpp's converter writes it: the MTP block as layer n
    ("nextn"), zero-centred norm weights + 1, A_log as -exp(A_log), conv1d squeezed, value heads tiled."""
    from safetensors.torch import load_file

    from turbospec.model.gguf import HYBRID_LAYER_NAMES, MTP_NAMES

    cfg = json.loads((hf_dir / "config.json").read_text())
    n, nk, nv = cfg["num_hidden_layers"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    names = dict(GLOBAL_NAMES)
    for i in range(n):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in HYBRID_LAYER_NAMES.items()})
    names.update({hf: f"blk.{n}.{g}" for hf, g in MTP_NAMES.items()})
    names.update({f"mtp.layers.0.{hf}": f"blk.{n}.{g}" for hf, g in HYBRID_LAYER_NAMES.items()})
    w = gguf.GGUFWriter(str(out), "qwen35")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n + 1)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    for k, v in (("conv_kernel", cfg["linear_conv_kernel_dim"]), ("state_size", dk), ("group_count", nk),
                 ("time_step_rank", nv), ("inner_size", dv * nv)):
        w.add_uint32(f"qwen35.ssm.{k}", v)
    w.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]] + [False])
    w.add_uint32("qwen35.full_attention_interval", cfg.get("full_attention_interval", 4))
    for hf, x in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        x = x.float()
        if names[hf].endswith("norm.weight") and not names[hf].endswith("ssm_norm.weight"):  # MTP enorm/hnorm too
            x = x + 1
        if nv != nk and ".linear_attn." in hf:
            if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                x = torch.cat([x[:2 * nk * dk], tile_v_heads(x[2 * nk * dk:], 0, nk, r, dv)])
            elif hf.endswith("in_proj_z.weight"):
                x = tile_v_heads(x, 0, nk, r, dv)
            elif hf.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                x = tile_v_heads(x, 0, nk, r, 1)
            elif hf.endswith("out_proj.weight"):
                x = tile_v_heads(x, 1, nk, r, dv)
        if hf.endswith("A_log"):
            x = -torch.exp(x)
        if hf.endswith("conv1d.weight"):
            x = x.squeeze(1)
        w.add_tensor(names[hf], x.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_qwen35_file_with_mtp_gives_the_checkpoint(tmp_path):
    """Every tensor (the MTP block's included) equals the checkpoint's after the converter's transforms are
    undone, with more value than key heads (the tiled order); logits equal transformers'."""
    from safetensors.torch import load_file, save_file

    from tests.hf_hybrid import build, mtp_tensors
    from turbospec.model.loader import WeightSource

    src = build("qwen3_5", tmp_path)  # 2 key heads, 4 value heads
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["linear_num_value_heads"] > cfg["linear_num_key_heads"]
    sd = load_file(str(src / "model.safetensors"))
    sd.update(mtp_tensors(cfg))
    save_file(sd, str(src / "model.safetensors"))
    cfg["mtp_num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    f = GGUFFile(write_hybrid_gguf(src, tmp_path / "h.gguf"))
    mcfg = f.config()
    assert mcfg.layer_types() == cfg["layer_types"]
    ws, ref = f.weights(mcfg), WeightSource(src)
    assert sorted(ws.names()) == sorted(ref.names())
    for name in ref.names():
        want = ref.get(name, torch.float32)
        assert torch.allclose(ws.get(name, torch.float32, tuple(want.shape)), want, atol=1e-6, rtol=0), name
    model = load_model(f.path, "float32")
    assert model.mtp is not None
    got, want = logits(model, IDS), hf_logits(src, IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())
