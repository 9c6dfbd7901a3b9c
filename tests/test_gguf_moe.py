"""GGUF files of the mixture-of-experts architectures (llama.cpp's `qwen3moe`, `qwen35moe` and `qwen3next`), both
ways: a tiny Qwen3-MoE / Qwen3.5-MoE / Qwen3-Next checkpoint (MTP layer with experts included) exported by
`export_gguf` loads back with the checkpoint's logits (F32) or the `gguf` package's dequantization of each expert (packed types stay views of the
file); the expert budget works on mapped experts; the MTP layer drafts; bad files are one-line errors.

By hand (llama.cpp is not installed in CI; llama-cpp-python 0.3.36's copy): for a tiny Qwen3-MoE (every layer MoE) and
Qwen3.5-MoE with MTP (vocabulary 8192, key and value head dims equal and head_dim 256, which llama.cpp's qwen35moe
assumes), llama.cpp's own converter writes the same tensors (names, shapes, types, bytes) and metadata as these
exports (F32 and Q8_0, apart from `general.*` labels, two tokenizer keys, and rows that are not whole blocks: F16
there, F32 here); llama-bench runs the f32 / f16 / q8_0 / q4_0 / q4_k exports of both, and llama-server's greedy
tokens equal turbospec's on the f32 exports (32 of 32 on 4 prompts each; --spec-type draft-mtp on qwen35moe too).
For a tiny Qwen3-Next MoE with an MoE MTP layer (vocabulary 8192), the converter's f32 file and this export have the
same tensors (names, shapes, bytes) and `qwen3next.*` metadata; the converter's file gives the checkpoint's logits
and MTP drafts."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.hf_moe import build, moe_layers  # noqa: E402
from tests.hf_moe import prefill_then_decode as _prefill_then_decode  # noqa: E402
from tests.hf_tiny import hf_logits  # noqa: E402
from turbospec.errors import TurboSpecError  # noqa: E402
from turbospec.kv.plan import AttentionPlan  # noqa: E402
from turbospec.layers.moe import MoE  # noqa: E402
from turbospec.model import load_model  # noqa: E402
from turbospec.model.gguf import GGUFFile  # noqa: E402
from turbospec.model.gguf_export import export_gguf  # noqa: E402
from turbospec.model.gguf_reader import GGUFContents  # noqa: E402
from turbospec.model.loader import WeightSource  # noqa: E402
from turbospec.model.registry import load_gguf  # noqa: E402
from turbospec.weights import dequantize, is_packed  # noqa: E402

IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))
NAMES = ("qwen3_moe", "qwen3_moe_sparse", "qwen3_5_moe_mtp", "qwen3_next_mtp")
ARCH = {"qwen3_moe": "qwen3moe", "qwen3_moe_sparse": "qwen3moe", "qwen3_5_moe_mtp": "qwen35moe",
        "qwen3_next_mtp": "qwen3next"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_gguf")
    paths = {name: build(name, out) for name in ("qwen3_moe", "qwen3_moe_sparse")}
    paths["qwen3_5_moe_mtp"] = build("qwen3_5_moe", out, mtp=True)
    paths["qwen3_next_mtp"] = build("qwen3_next", out, mtp=True)
    return paths


@pytest.fixture(scope="module")
def exports(ckpts, tmp_path_factory):
    """(checkpoint, type) -> its export, written once."""
    out, made = tmp_path_factory.mktemp("moe_exports"), {}

    def get(name: str, kind: str) -> Path:
        if (name, kind) not in made:
            made[name, kind] = export_gguf(ckpts[name], out / f"{name}-{kind}.gguf", kind)
        return made[name, kind]
    return get


def prefill_then_decode(model, ids=IDS):
    return _prefill_then_decode(model, ids)


def expert_weights(mlp):
    return [lin.weight for lin in (*mlp.gate_up.parts, mlp.down)]


@pytest.mark.parametrize("name", NAMES)
def test_f32_export_gives_the_checkpoint(ckpts, exports, name):
    """The f32 export's config is the checkpoint's (experts, top-k, sizes, which layers are MoE, renormalised top-k
    or not), every expert matrix is the checkpoint's, and chunked prefill + decode give transformers' logits.
    (qwen3_moe_sparse: dense layers and norm_topk_prob false, which llama.cpp's qwen3moe cannot run; turbospec
    loads its export as the checkpoint.)"""
    path = exports(name, "f32")
    f = GGUFFile(path)
    qwen3 = name.startswith("qwen3_moe")
    assert f.arch == ARCH[name]
    model = load_model(path, "float32")
    ref = load_model(ckpts[name], "float32")
    assert model.cfg.moe() == ref.cfg.moe()
    kinds = [isinstance(la.mlp, MoE) for la in model.layers]
    assert kinds == [isinstance(la.mlp, MoE) for la in ref.layers]
    if name == "qwen3_moe":
        assert kinds == [True, False, True, True]  # mlp_only_layers [1]
    elif name == "qwen3_moe_sparse":
        assert kinds == [False, True, False, True] and not model.cfg.moe()["norm_topk"]
        assert f.key("expert_weights_norm") is False
    else:
        assert model.mtp is not None and isinstance(model.mtp.layers[0].mlp, MoE)
        assert moe_layers(model)[0].shared is not None
    ws, src = f.weights(model.cfg), WeightSource(ckpts[name])
    for p in ("model.layers.3.mlp",) if qwen3 else ("model.layers.3.mlp", "mtp.layers.0.mlp"):
        for e in (0, 5):
            for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                got = ws.expert_matrix(f"{p}.experts.{proj}", e, torch.float32, shape)
                assert torch.equal(got, src.get(f"{p}.experts.{e}.{proj}.weight")), (p, e, proj)
    got, want = prefill_then_decode(model), hf_logits(ckpts[name], IDS)
    assert want.abs().max() > 0.5
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()  # (relative: logits up to ~4)
    assert (got - prefill_then_decode(ref)).abs().max().item() < 1e-6


def test_export_reads_stacked_experts(ckpts, exports, tmp_path):
    """A checkpoint whose experts are transformers-5's stacked `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I] exports to the same file as per-expert tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = ckpts["qwen3_5_moe_mtp"]
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    for p in sorted({k.split(".experts.")[0] for k in sd if ".experts." in k}):
        gu = [torch.cat([sd.pop(f"{p}.experts.{e}.gate_proj.weight"), sd.pop(f"{p}.experts.{e}.up_proj.weight")])
              for e in range(8)]
        sd[f"{p}.experts.gate_up_proj"] = torch.stack(gu)
        sd[f"{p}.experts.down_proj"] = torch.stack([sd.pop(f"{p}.experts.{e}.down_proj.weight") for e in range(8)])
    save_file(sd, str(dst / "model.safetensors"))
    a = GGUFContents(exports("qwen3_5_moe_mtp", "q8_0"))
    b = GGUFContents(export_gguf(dst, tmp_path / "stacked.gguf", "q8_0"))
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors, strict=True))


def test_export_layout_is_llama_cpps(exports):
    """Tensor names, ggml shapes and types as llama.cpp's converter writes a Qwen3.5-MoE (q8_0): stacked experts
    {in, out, experts}, routers and the shared-expert gate F32, the MTP block as layer n with its experts; the
    expert keys in the metadata."""
    f = GGUFFile(exports("qwen3_5_moe_mtp", "q8_0"))
    t = {name: (tuple(int(d) for d in x.shape), x.tensor_type) for name, x in f.tensors.items()}
    for b in (0, 3, 4):  # 4: the MTP block
        assert t[f"blk.{b}.ffn_gate_exps.weight"] == ((64, 32, 8), Q.Q8_0)
        assert t[f"blk.{b}.ffn_up_exps.weight"] == ((64, 32, 8), Q.Q8_0)
        assert t[f"blk.{b}.ffn_down_exps.weight"] == ((32, 64, 8), Q.Q8_0)
        assert t[f"blk.{b}.ffn_gate_inp.weight"] == ((64, 8), Q.F32)
        assert t[f"blk.{b}.ffn_gate_inp_shexp.weight"] == ((64, 1), Q.F32)
        assert t[f"blk.{b}.ffn_gate_shexp.weight"] == ((64, 48), Q.Q8_0)
        assert t[f"blk.{b}.ffn_down_shexp.weight"] == ((48, 64), Q.F32)  # rows of 48: not whole blocks
    assert "blk.4.nextn.eh_proj.weight" in t and not any(".experts." in n or "mlp" in n for n in t)
    assert [f.key(k) for k in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                               "expert_shared_feed_forward_length", "block_count")] == [8, 2, 32, 48, 5]
    assert f.key("nextn_predict_layers") == 1 and f.key("expert_weights_norm") is None


@pytest.mark.parametrize(("name", "kind"), [("qwen3_moe", "q8_0"), ("qwen3_5_moe_mtp", "q4_0")])
def test_packed_experts_are_views_of_the_file(ckpts, exports, name, kind):
    """Q8_0 / Q4_0 experts load as the file's blocks (a view of the memory map: no copy), equal bit for bit to the
    gguf package's dequantization of that expert; the logits are those of the checkpoint packed as it loads
    (`--weights`: llama.cpp's reference quantizer, the same blocks)."""
    path = exports(name, kind)
    f = GGUFFile(path)
    model = load_gguf(f, "float32")
    layer = model.layers[2].mlp
    for e in (0, 7):
        weights = expert_weights(layer.expert(e))
        assert all(is_packed(w) for w in weights)
        for w, g in zip(weights, ("gate", "up", "down"), strict=True):
            t = f.tensors[f"blk.2.ffn_{g}_exps.weight"]
            assert w.data_ptr() == t.data[e].ctypes.data  # expert e's bytes in the map
            ref = gguf.quants.dequantize(t.data[e], t.tensor_type)
            assert torch.equal(dequantize(w), torch.from_numpy(ref.astype(np.float32)))
    want = prefill_then_decode(load_model(ckpts[name], "float32", weights=kind))
    assert torch.equal(prefill_then_decode(model), want)


def test_other_expert_types_dequantize_one_expert(exports):
    """q4_k at this size falls back to Q5_0 (rows of 64 / 32 values, as llama-quantize): experts are dequantized
    one at a time to the gguf package's values; f16 experts are the checkpoint's rounded; --weights q8_0 packs
    float experts as they load."""
    f = GGUFFile(exports("qwen3_moe", "q4_k"))
    t = f.tensors["blk.0.ffn_down_exps.weight"]
    assert t.tensor_type == Q.Q5_0
    ws = f.weights(f.config())
    got = ws.expert_matrix("model.layers.0.mlp.experts.down_proj", 3, torch.float32, (64, 32))
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(t.data[3], Q.Q5_0)))
    model = load_model(f.path, "float32")
    assert not any(is_packed(w) for w in expert_weights(moe_layers(model)[0].expert(3)))
    assert torch.isfinite(prefill_then_decode(model)).all()
    f16 = GGUFFile(exports("qwen3_moe", "f16"))
    assert f16.tensors["blk.0.ffn_up_exps.weight"].tensor_type == Q.F16
    w16 = f16.weights(f16.config()).expert_matrix("model.layers.0.mlp.experts.up_proj", 6, torch.float32, (32, 64))
    f32 = GGUFFile(exports("qwen3_moe", "f32"))
    w32 = f32.weights(f32.config()).expert_matrix("model.layers.0.mlp.experts.up_proj", 6, torch.float32, (32, 64))
    assert torch.equal(w16, w32.half().float())
    packed = load_model(f32.path, "float32", weights="q8_0")
    assert all(is_packed(w) for w in expert_weights(moe_layers(packed)[0].expert(1)))


def test_expert_budget_on_a_gguf_file(exports):
    """A budget below all experts (Q8_0 experts mapped from the file): the same logits as every expert loaded,
    experts evicted and reloaded."""
    path = exports("qwen3_5_moe_mtp", "q8_0")
    full = load_model(path, "float32")
    one = moe_layers(full)[0].expert_bytes
    budget = len(moe_layers(full)) * 8 * one // 2
    small = load_model(path, "float32", moe_cache_mem=budget)
    assert small.experts.used == 0
    assert torch.equal(prefill_then_decode(full), prefill_then_decode(small))
    s = small.experts.stats
    assert s.evictions > 0 and s.hits > 0 and small.experts.used <= budget and s.loaded_bytes == s.misses * one


@pytest.mark.parametrize("name", ["qwen3_5_moe_mtp", "qwen3_next_mtp"])
def test_mtp_drafting_from_the_export_is_lossless(ckpts, exports, name):
    """Greedy output with MTP drafting equals plain decoding, and the file's MTP drafts what the checkpoint's does."""
    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import Engine
    from turbospec.sampling import SamplingParams
    from turbospec.speculative import make_drafter

    model = load_model(exports(name, "f32"), "float32")
    assert model.mtp is not None and isinstance(model.mtp.layers[0].mlp, MoE)
    plain = Engine(model, None, EngineConfig(ctx=128, ubatch=8))
    sc = SpecConfig.parse("draft-mtp", n_max=3)
    eng = Engine(model, None, EngineConfig(ctx=128, ubatch=8, spec=sc), drafter=make_drafter(sc, model, 140))
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    drafts = 0
    for i in range(2):
        prompt = [(7 * i + j) % 128 for j in range(8)] * 2
        assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
        drafts += eng.last_stats.spec.drafts
    assert drafts > 0
    ref = load_model(ckpts[name], "float32")
    a, b = make_drafter(sc, model, 140), make_drafter(sc, ref, 140)
    prompt = list(range(3, 19))
    for d, m in ((a, model), (b, ref)):
        h = m.forward(torch.tensor(prompt), AttentionPlan.causal(0, len(prompt)), m.new_cache(32))
        d.begin(prompt, h)
    drafted = a.propose(prompt, 3).tokens
    assert len(drafted) == 3 and drafted == b.propose(prompt, 3).tokens


# ---- files written by hand: llama.cpp's fused gate/up experts, bad files --------------------------------------
def rewrite(src: Path, dst: Path, edit) -> Path:
    """`src` rewritten with the gguf package: the same metadata, tensors through `edit(name, values, type)` ->
    [(name, array, raw type or None)]."""
    c = GGUFContents(src)
    w = gguf.GGUFWriter(str(dst), c.meta["general.architecture"])
    for k, v in c.meta.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for t in c.tensors:
        for name, arr, raw in edit(t.name, np.array(t.data), t.tensor_type):
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_fused_gate_up_experts(exports, tmp_path):
    """llama.cpp's fused `ffn_gate_up_exps` [E, 2I, H] (gate rows first) gives the same model."""
    pending: dict[str, np.ndarray] = {}

    def fuse(name, arr, qtype):
        if "_exps" not in name or "down" in name:
            return [(name, arr, qtype)]
        pending[name] = arr
        blk = name.split(".")[1]
        gate, up = (pending.get(f"blk.{blk}.ffn_{g}_exps.weight") for g in ("gate", "up"))
        if gate is None or up is None:
            return []
        pending.clear()
        return [(f"blk.{blk}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1), qtype)]

    for kind in ("f32", "q8_0"):
        src = exports("qwen3_5_moe_mtp", kind)
        fused = rewrite(src, tmp_path / f"fused-{kind}.gguf", fuse)
        f = GGUFFile(fused)
        assert "blk.0.ffn_gate_up_exps.weight" in f.tensors and "blk.0.ffn_gate_exps.weight" not in f.tensors
        a, b = load_model(src, "float32"), load_model(fused, "float32")
        assert torch.equal(prefill_then_decode(a), prefill_then_decode(b))
        assert b.mtp is not None and isinstance(b.mtp.layers[0].mlp, MoE)


def patch(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    data = src.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    dst.write_bytes(data.replace(old, new))
    return dst


def tensor_info(name: str, dims: tuple[int, ...], qtype: int) -> bytes:
    """A tensor's info in the header, up to (and including) its type."""
    return (struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<I", qtype))


def one_line_error(path: Path) -> str:
    with pytest.raises(TurboSpecError) as e:
        load_model(path, "float32")
    msg = str(e.value)
    assert "\n" not in msg and path.name in msg
    return msg


def test_bad_moe_files_are_one_line_errors(exports, tmp_path):
    src = exports("qwen3_moe", "f32")
    data = src.read_bytes()
    for cut in (len(data) // 2, len(data) - 64):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "corrupt or truncated" in one_line_error(bad)
    # an expert tensor of a type turbospec does not read (I32: as many bytes as F32)
    info = tensor_info("blk.2.ffn_up_exps.weight", (64, 32, 8), int(Q.F32))
    bad = patch(src, tmp_path / "i32.gguf", info, info[:-4] + struct.pack("<I", int(Q.I32)))
    assert "blk.2.ffn_up_exps.weight has type I32, which is not supported" in one_line_error(bad)
    # an expert tensor missing (renamed)
    bad = patch(src, tmp_path / "missing.gguf", b"blk.2.ffn_up_exps.weight", b"blk.2.ffn_up_exps.weighx")
    assert "missing tensor 'model.layers.2.mlp.experts.up_proj'" in one_line_error(bad)
    # stacked experts of the wrong shape (8 experts of [64, 32] read as [32, 64])
    info = tensor_info("blk.3.ffn_down_exps.weight", (32, 64, 8), int(Q.F32))
    bad = patch(src, tmp_path / "shape.gguf", info, tensor_info("blk.3.ffn_down_exps.weight", (64, 32, 8),
                                                               int(Q.F32)))
    assert "blk.3.ffn_down_exps.weight has shape (8, 32, 64), the config implies (8, 64, 32)" in one_line_error(bad)
    # the expert count missing from the metadata
    bad = patch(src, tmp_path / "nokey.gguf", b"qwen3moe.expert_count", b"qwen3moe.expert_cou_t")
    assert "metadata qwen3moe.expert_count is missing" in one_line_error(bad)


def test_feed_forward_length_is_optional(exports, tmp_path):
    """llama.cpp's converter writes feed_forward_length only when config.json has intermediate_size (Qwen3.5-MoE's
    has not): without it the file loads the same."""
    src = exports("qwen3_5_moe_mtp", "f32")
    path = patch(src, tmp_path / "noff.gguf", b"qwen35moe.feed_forward_length", b"qwen35moe.feed_forward_lengtx")
    assert GGUFFile(path).key("feed_forward_length") is None
    assert torch.equal(prefill_then_decode(load_model(path, "float32")), prefill_then_decode(load_model(src)))


def test_export_of_a_checkpoint_missing_an_expert(ckpts, tmp_path):
    """A one-line error naming the tensor, and no half-written file."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "broken"
    shutil.copytree(ckpts["qwen3_moe"], src)
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(src / "model.safetensors"))
    out = tmp_path / "broken.gguf"
    with pytest.raises(TurboSpecError, match=r"missing tensor 'model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight'"):
        export_gguf(src, out, "q8_0")
    assert not out.exists()
