"""GGUF files (llama.cpp's format) for the dense architectures: F32 files give the transformers checkpoint's
logits; quantized tensors load as exactly the `gguf` package's dequantization; bad files are one-line errors.

The files are written here the way llama.cpp's convert_hf_to_gguf.py writes them (its tensor names and metadata
keys, llama's q/k rows permuted for its RoPE layout); by hand, F32 and Q8_0 files written by that converter itself
(llama-cpp-python 0.3.36's copy) for qwen3 / qwen2 / llama load with the checkpoint's logits (max abs difference
4e-7 for F32)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.gguf_files import qwen3_gguf  # noqa: E402
from tests.hf_tiny import hf_logits  # noqa: E402
from turbospec.errors import TurboSpecError  # noqa: E402
from turbospec.kv.plan import AttentionPlan  # noqa: E402
from turbospec.model.gguf import GLOBAL_NAMES, LAYER_NAMES, GGUFFile, unpermute_rope  # noqa: E402
from turbospec.model.gguf_export import export_gguf, permute_rope  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402

ARCH = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}
LLAMA_LAYOUT = ("llama", "mistral3")  # (the converter permutes their q/k rows)


def write_gguf(hf_dir: Path, out: Path, qtype: Q = Q.F32, arch_name: str | None = None,
               int8_embedding: bool = False, meta: dict | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF file of a transformers checkpoint, as llama.cpp's converter lays it out; matrices in `qtype`,
    1-D tensors (norms, biases) in F32 as llama.cpp keeps them. `meta`: more metadata (keys without the
    architecture prefix); `extra`: more tensors."""
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
    for k, v in (meta or {}).items():
        (w.add_string if isinstance(v, str) else w.add_float32)(f"{arch}.{k}", v)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    for hf, x in sorted(tensors.items()):
        x = x.astype(np.float32)
        if arch in LLAMA_LAYOUT and hf.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute_rope(torch.from_numpy(x), heads if "q_proj" in hf else kv).numpy()
        if int8_embedding and names[hf] == "token_embd.weight":  # a tensor type no loader supports (I8)
            w.add_tensor(names[hf], x.astype(np.int8))
        elif x.ndim == 2 and qtype != Q.F32:
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


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
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
    # 24 prompt rows: above the skinny limit, so packed matrices multiply as exact float32 tiles (the int8 rows
    # of decode are checked in tests/test_weights.py)
    ids = torch.cat([IDS, IDS.flip(0)])
    got, want = logits(load_model(path, "float32"), ids), hf_logits(hf_models[name], ids)
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
    path = qwen3_gguf(tmp_path / "k.gguf", lambda i, name, rows, cols: (k_quant_bytes(rows, cols, qtype, rng), qtype),
                      hidden=256, ffn=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=64)
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
    with pytest.raises(TurboSpecError, match="type I8, which is not supported"):
        load_model(write_gguf(hf_models["qwen3"], tmp_path / "b.gguf", int8_embedding=True))


@pytest.mark.parametrize("name", ["llama3_rope", "qwen3_yarn"])
def test_rope_scaling_files_give_the_checkpoint_logits(hf_models, tmp_path, name):
    """RoPE scaling as llama.cpp's converter writes it -- llama3's schedule as the rope_freqs tensor of per-frequency
    divisors, YaRN as rope.scaling.* keys -- gives transformers' logits, past the original context (32); without it
    the logits differ. (By hand, files written by llama.cpp's converter itself for both checkpoints gave
    transformers' logits within 3.3e-7 over 200 positions.)"""
    from turbospec.model import gguf_reader

    path = export_gguf(hf_models[name], tmp_path / f"{name}.gguf", "f32")
    meta = gguf_reader.GGUFContents(path).meta
    cfg = load_model(path, "float32").cfg
    if name == "llama3_rope":
        assert cfg.rope["freq_factors"][0] == 1.0 and cfg.rope["freq_factors"][-1] == pytest.approx(8.0)
    else:
        assert meta["qwen3.rope.scaling.type"] == "yarn" and meta["qwen3.rope.scaling.original_context_length"] == 32
    ids = (torch.arange(80) * 37) % 128
    want = hf_logits(hf_models[name], ids)

    def file_logits(rope: dict | None = None) -> torch.Tensor:
        model = load_model(path, "float32")
        if rope is not None:
            from turbospec.layers.rope import Rope

            model.rope = Rope(rope, cfg.head_dim, 128, torch.float32)
        return model.logits(model.forward(ids, AttentionPlan.causal(0, len(ids)), model.new_cache(128)))

    got = file_logits()
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    plain = file_logits({"rope_type": "default", "rope_theta": cfg.rope_theta})
    assert (plain - want).abs().max() > 1e-4  # (random tiny models: rope moves logits little)


def test_mistral3_file_is_a_llama_file(hf_models, tmp_path):
    """llama.cpp's `mistral3` (Mistral Small 3.1 / 3.2, Ministral 3): llama's layers and layout; Ministral 3's YaRN
    attention factor from its log multiplier, as llama.cpp computes it; its attention temperature scaling, which
    starts at the original context, limits the context to it (one-line error above)."""
    path = write_gguf(hf_models["llama"], tmp_path / "m.gguf", arch_name="mistral3")
    got, want = logits(load_model(path, "float32"), IDS), hf_logits(hf_models["llama"], IDS)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 64.0,
            "rope.scaling.yarn_log_multiplier": 1.0}
    rope = load_model(write_gguf(hf_models["llama"], tmp_path / "y.gguf", arch_name="mistral3", meta=yarn)).cfg.rope
    assert rope["rope_type"] == "yarn" and rope["attention_factor"] == pytest.approx(1.0)  # log multiplier 1
    rope = load_model(write_gguf(hf_models["llama"], tmp_path / "y0.gguf", arch_name="mistral3",
                                 meta={**yarn, "rope.scaling.yarn_log_multiplier": 0.0})).cfg.rope
    assert rope["attention_factor"] == pytest.approx(0.1 * np.log(16.0) + 1)
    from turbospec import EngineConfig, build_engine

    temp = write_gguf(hf_models["llama"], tmp_path / "t.gguf", arch_name="mistral3",
                      meta={**yarn, "attention.temperature_scale": 0.1})
    assert build_engine(EngineConfig(model=str(temp), ctx=64)).model.cfg.rope["exact_positions"] == 64
    with pytest.raises(TurboSpecError, match="-c 65: this model has attention temperature scaling .* from position 64"):
        build_engine(EngineConfig(model=str(temp), ctx=65))


@pytest.mark.parametrize("name", ["phi3", "phi3_partial"])
def test_phi3_file_gives_the_checkpoint_logits(hf_models, tmp_path, name):
    """llama.cpp's `phi3` (Phi-3, Phi-4): q/k/v and gate/up fused as in the checkpoint (`attn_qkv`, `ffn_up`), the
    partial rotary from rope.dimension_count; a sliding window (Phi-3-mini's) limits the context to it. (By hand, llama.cpp's converter wrote the same tensors, bytes and phi3.* keys for
    both checkpoints, and its files gave transformers' logits within 2.9e-7.)"""
    from turbospec import EngineConfig, build_engine
    from turbospec.model import gguf_reader

    path = export_gguf(hf_models[name], tmp_path / f"{name}.gguf", "f32")
    meta = gguf_reader.GGUFContents(path).meta
    got, want = logits(load_model(path, "float32"), IDS), hf_logits(hf_models[name], IDS)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    if name == "phi3":
        assert meta["phi3.attention.sliding_window"] == 0 and build_engine(EngineConfig(model=str(path), ctx=4096))
        return
    assert meta["phi3.rope.dimension_count"] == 8  # half of head_dim 16
    build_engine(EngineConfig(model=str(path), ctx=64))
    with pytest.raises(TurboSpecError, match="-c 65: this model has a sliding attention window .* from position 64"):
        build_engine(EngineConfig(model=str(path), ctx=65))


def test_longrope_file_gives_the_checkpoint_logits(hf_models, tmp_path):
    """LongRoPE (Phi-3.5, Phi-4-mini) as llama.cpp's converter writes it -- the `rope_factors_short` / `_long`
    tensors, the cos/sin scale as `rope.scaling.attn_factor` -- with the factors llama.cpp picks for the context: the
    short ones up to the pretrained 32 positions, the long ones past them (transformers picks them by the sequence's
    length: both agree where the context is the sequence). By hand, the converter's file of the checkpoint had the
    same tensors, bytes and keys, and gave the same logits."""
    from turbospec import EngineConfig, build_engine

    src = hf_models["phi3_long"]
    path = export_gguf(src, tmp_path / "long.gguf", "f32")
    for n, ctx in ((24, 32), (40, 64)):
        model = build_engine(EngineConfig(model=str(path), ctx=ctx)).model
        ids = (torch.arange(n) * 37) % 128
        got = model.logits(model.forward(ids, AttentionPlan.causal(0, n), model.new_cache(64)))
        want = hf_logits(src, ids)
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (n, float((got - want).abs().max()))
        model.rope.set_context(96 - ctx)  # the other factors: different logits
        other = model.logits(model.forward(ids, AttentionPlan.causal(0, n), model.new_cache(64)))
        assert (other - want).abs().max() > 1e-3
    bad = write_gguf(hf_models["llama"], tmp_path / "bad.gguf", arch_name="phi3",
                     extra={"rope_factors_long.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(TurboSpecError, match="rope_factors_short.weight is missing"):
        load_model(bad)


def test_bad_rope_scaling_is_a_one_line_error(hf_models, tmp_path):
    llama, qwen3 = hf_models["llama"], hf_models["qwen3"]
    halves = np.ones(8, dtype=np.float32)  # head_dim 16: 8 rotated pairs
    cases = [(qwen3, {"rope.scaling.type": "longrope"}, None, "RoPE scaling 'longrope' is not supported"),
             (qwen3, {"rope.scaling.type": "yarn", "rope.scaling.factor": -2.0}, None, "must be a positive number"),
             (qwen3, {}, {"rope_freqs.weight": halves}, "rope_freqs tensor in a qwen3 file"),
             (llama, {}, {"rope_freqs.weight": np.ones(5, dtype=np.float32)}, "has 5 values"),
             (llama, {}, {"rope_freqs.weight": -halves}, "positive numbers"),
             (qwen3, {"rope.scaling.attn_factor": 2.0}, None, "attn_factor 2 without YaRN"),
             (qwen3, {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_beta_fast": "x"},
              None, "yarn_beta_fast must be a positive number, got x"),
             (qwen3, {"rope.scale_linear": "x"}, None, "rope.scale_linear must be a positive number, got x")]
    for i, (src, meta, extra, msg) in enumerate(cases):
        with pytest.raises(TurboSpecError, match=msg) as e:
            load_model(write_gguf(src, tmp_path / f"r{i}.gguf", meta=meta, extra=extra))
        assert "\n" not in str(e.value)
    # linear scaling (the default type when only a factor is given, as llama.cpp reads it) and factor 1 (none)
    for i, (meta, kind) in enumerate([({"rope.scaling.factor": 2.0}, "linear"), ({"rope.scale_linear": 4.0}, "linear"),
                                      ({"rope.scaling.type": "yarn", "rope.scaling.factor": 1.0}, "default"),
                                      ({"rope.scaling.type": "none", "rope.scaling.factor": 2.0}, "default")]):
        cfg = load_model(write_gguf(qwen3, tmp_path / f"ok{i}.gguf", meta=meta), "float32").cfg
        assert cfg.rope["rope_type"] == kind, meta


def test_cli_reports_a_bad_file_in_one_line(good_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:1000])
    r = subprocess.run([sys.executable, "-m", "turbospec.cli", "run", "-m", str(bad), "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr


# ---- the qwen35 hybrid, and export -------------------------------------------------------------------------
def test_qwen35_file_with_mtp_gives_the_checkpoint(tmp_path):
    """An exported Qwen3.5 checkpoint (more value than key heads: the tiled order; an MTP block: the nextn layer)
    loads with every tensor equal to the checkpoint's and transformers' logits. (Exports of the bundled hybrid are
    tensor-for-tensor and key-for-key those of llama.cpp's converter; checked by hand, see docs/gguf.md.)"""
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
    f = GGUFFile(export_gguf(src, tmp_path / "h.gguf", "f32"))
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


@pytest.mark.parametrize(("name", "kind"), [("qwen3", "f32"), ("llama", "f32"), ("qwen3_tied_bias", "f16"),
                                            ("qwen2", "q8_0"), ("llama", "q4_0"), ("llama3_rope", "f32"),
                                            ("phi3", "q8_0"), ("phi3_partial", "f32")])
def test_export_round_trip(hf_models, tmp_path, name, kind):
    """export-gguf then load: f32 gives the checkpoint's tensors (llama's q/k permuted and back), other types
    the gguf package's quantize-dequantize of them."""
    from turbospec.model.loader import WeightSource

    f = GGUFFile(export_gguf(hf_models[name], tmp_path / "x.gguf", kind))
    ws, ref = f.weights(f.config()), WeightSource(hf_models[name])
    assert sorted(ws.names()) == sorted(ref.names())
    qtype = getattr(Q, kind.upper())
    for n in ref.names():
        want = ref.get(n, torch.float32)
        if want.ndim == 2 and kind != "f32":
            if name == "llama" and n.endswith(("q_proj.weight", "k_proj.weight")):
                heads = f.config().num_heads if "q_proj" in n else f.config().num_kv_heads
                want = unpermute_rope(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(
                    permute_rope(want, heads).numpy(), qtype), qtype)), heads)
            else:
                want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), qtype), qtype))
        assert torch.equal(ws.get(n, torch.float32), want.float()), n


@pytest.mark.parametrize("bundled", ["turbospec-tiny", "turbospec-tiny-hybrid"])
def test_export_bundled_models_with_their_tokenizer(tmp_path, bundled, monkeypatch):
    """The bundled models through `turbospec export-gguf`: the file's tokenizer is the checkpoint's (ids, chat
    template, the draft vocabulary's ranking), and greedy decoding from the file equals decoding from the directory
    (MTP drafting too, over the same reduced vocabulary); the engine reads the file's header once."""
    from turbospec import EngineConfig, SamplingParams, SpecConfig, build_engine
    from turbospec.cli.main import main
    from turbospec.model import draft_vocab, gguf_reader

    src = Path(__file__).resolve().parents[1] / "models" / bundled
    out = tmp_path / "b.gguf"
    assert main(["export-gguf", str(src), str(out), "--type", "f32"]) == 0
    assert draft_vocab.load(out) == draft_vocab.load(src) is not None
    spec = SpecConfig(types=("draft-mtp",)) if bundled.endswith("hybrid") else SpecConfig()
    reads: list[Path] = []
    real = gguf_reader.GGUFContents
    monkeypatch.setattr(gguf_reader, "GGUFContents", lambda path: reads.append(path) or real(path))
    a, b = (build_engine(EngineConfig(model=str(p), spec=spec)) for p in (src, out))
    assert reads == [out]  # model, tokenizer and the MTP's draft ranking from one read
    text = "def f(x):\n    return x  # 12345 café 🙂 <|im_end|>"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert a.tokenizer.render_chat(msgs) == b.tokenizer.render_chat(msgs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ga, gb = (list(e.stream("import os\n", params)) for e in (a, b))
    assert [c.tokens for c in ga] == [c.tokens for c in gb]
    if bundled.endswith("hybrid"):
        assert a.last_stats.spec.accepted == b.last_stats.spec.accepted > 0
        assert a.drafter.head_ids == b.drafter.head_ids is not None


def test_export_refuses_what_it_cannot_write(hf_models, tmp_path):
    with pytest.raises(TurboSpecError, match="llama-quantize"):
        export_gguf(hf_models["qwen3"], tmp_path / "k.gguf", "q6_k")
    from turbospec.model.config import ModelConfig
    from turbospec.model.gguf_export import write_metadata

    cfg = json.loads((hf_models["qwen3"] / "config.json").read_text())
    cfg["rope_parameters"] = json.loads((hf_models["llama3_rope"] / "config.json").read_text())["rope_parameters"]
    with pytest.raises(TurboSpecError, match="llama3 RoPE scaling in a qwen3 file"):
        write_metadata(gguf.GGUFWriter(str(tmp_path / "l.gguf"), "qwen3"), ModelConfig.from_dict(cfg), "qwen3", "f32",
                       False, [], None)


def test_lean_reader_equals_gguf_reader(tmp_path):
    """turbospec's GGUF reader (metadata as python values, tensors as map views) against gguf.GGUFReader on a
    file with every value kind and several tensor types; a cut-off file is a ValueError."""
    from turbospec.model.gguf_reader import GGUFContents
    from turbospec.tokenizer import gguf_metadata

    rng = np.random.default_rng(0)
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -5)
    w.add_float32("a.f32", 0.25)
    w.add_float64("a.f64", 1e-300)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, 1.5])
    w.add_array("a.strs", ["x", "", "yz"])
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q4k", k_quant_bytes(2, 512, Q.Q4_K, rng), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFContents(path), gguf.GGUFReader(str(path))
    assert ours.meta == gguf_metadata(ref)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes) == (b.name, b.tensor_type, b.n_elements, b.n_bytes)
        assert list(a.shape) == list(b.shape) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:200])
    with pytest.raises((ValueError, struct.error)):
        GGUFContents(tmp_path / "cut.gguf")


def test_hybrid_export_keeps_the_conv1d_in_f32(tmp_path):
    """llama.cpp's ssm_conv needs an F32 kernel: every export type writes it so (an F16 one aborts llama.cpp)."""
    root = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny-hybrid"
    out = export_gguf(root, tmp_path / "h.gguf", "f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ssm_conv1d.weight"] == Q.F32 and types["blk.0.ffn_up.weight"] == Q.F16


def test_qwen35_q4_k_output_projection_stays_packed_in_file_order(tmp_path):
    """More value than key heads and a value head of 64 values (a quarter of a Q4_K block): the Gated DeltaNet
    output projection cannot be reordered to the checkpoint's columns, so it stays packed in llama.cpp's tiled
    order and the layer permutes its activations instead; logits equal the reordered float weights."""
    from tests.hf_hybrid import build
    from turbospec import weights as W
    from turbospec.kv.plan import AttentionPlan
    from turbospec.layers.linear import Linear
    from turbospec.model.gguf import untile_v_heads

    src = build("qwen3_5", tmp_path, hidden_size=256, intermediate_size=256, linear_key_head_dim=64,
                linear_value_head_dim=64, num_attention_heads=4, head_dim=64)
    f = GGUFFile(export_gguf(src, tmp_path / "h.gguf", "q4_k"))
    m = load_model(f.path, "float32")
    gdns = [layer.mixer for layer in m.layers if layer.kind == "linear_attention"]
    assert gdns and all(g.out_tiling == 2 and g.out.packed for g in gdns)
    ids = torch.arange(3, 3 + 80) % 200  # 80 prompt rows: exact float32 tiles, then one decode row

    def run(model):
        cache = model.new_cache(128)
        a = model.logits(model.forward(ids, AttentionPlan.causal(0, len(ids)), cache))
        cache.commit()
        b = model.logits(model.forward(torch.tensor([5]), AttentionPlan.causal(len(ids), 1), cache))
        return a, b

    got = run(m)
    for g in gdns:  # the checkpoint's column order, float32, as the loader used to do
        g.out = Linear(untile_v_heads(W.dequantize(g.out.weight), 1, g.nk, g.out_tiling, g.dv).contiguous())
        g.out_tiling = 1
    want = run(m)
    assert torch.allclose(got[0], want[0], atol=1e-4, rtol=1e-4)
    # the decode row: int8 inputs to the packed projection against float ones (~5% through 4 random layers; a
    # wrong head order is ~100%)
    assert float((got[1] - want[1]).norm() / want[1].norm()) < 0.15
