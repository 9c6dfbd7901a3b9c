"""Write a checkpoint directory as a llama.cpp GGUF file, laid out as llama.cpp's convert_hf_to_gguf.py lays it out
(its tensor names, metadata keys and tensor transforms, the inverse of what `turbospec.model.gguf` undoes), so that
llama.cpp loads and runs it — the hybrid with its MTP block, which llama.cpp's `--spec-type draft-mtp` uses — and
turbospec loads it back to the same tensors. Architectures: qwen3, qwen2, llama, qwen3moe (Qwen3-MoE), qwen35
(Qwen3.5) and qwen35moe (Qwen3.5-MoE); a MoE layer's experts are stacked into llama.cpp's 3-D `ffn_*_exps`.

Types: f32, f16, bf16, q8_0, q4_0 (the `gguf` package's quantizers) and q4_k (turbospec's port of llama.cpp's
reference quantizer, `turbospec.weights.quantize`) for the matrices and experts; 1-D tensors, the conv1d kernel and
the routers stay f32, as llama.cpp keeps them. Rows that are not whole blocks stay f32, except q4_k's, which fall
back to Q5_0 as `llama-quantize` does."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from turbospec.errors import TurboSpecError
from turbospec.layers.rope import inv_freq_and_scale
from turbospec.model import draft_vocab
from turbospec.model.config import ModelConfig
from turbospec.model.gguf import (
    GLOBAL_NAMES,
    HYBRID,
    HYBRID_LAYER_NAMES,
    LAYER_NAMES,
    MOE,
    MOE_LAYER_NAMES,
    MTP_NAMES,
    PHI3_LAYER_NAMES,
)
from turbospec.model.hybrid import split_qkvz
from turbospec.model.loader import WeightSource
from turbospec.tokenizer import (
    _DEEPSEEK_CODER_RES,
    _DEEPSEEK_LLM_RES,
    _GPT4O_RE,
    _LLAMA3_RE,
    _QWEN2_RE,
    _QWEN35_RE,
    _TEKKEN_RE,
)
from turbospec.weights import quantize

EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k")
log = logging.getLogger("turbospec")


def tile_v_heads(x: torch.Tensor, dim: int, nk: int, r: int, d: int) -> torch.Tensor:
    """Value heads along `dim` from the checkpoint's grouped order to llama.cpp's tiled order (the inverse of
    `turbospec.model.gguf.untile_v_heads`)."""
    shape = list(x.shape)
    return x.reshape(*shape[:dim], nk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation of a llama q/k projection (inverse of `gguf.unpermute_rope`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pre_tokenizer_name(tok: dict[str, Any]) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json: its converter names pre-tokenizers by hashing known
    vocabularies, so ours are named by their structure instead."""
    pre = tok.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else [pre.get("type")]
    if kinds == ["ByteLevel"] and pre.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and pre["pretokenizers"][0].get("individual_digits"):
        return "smollm"
    splits = [p.get("pattern", {}).get("Regex") for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
    # (a tokenizer.json may hold the line break characters themselves where the lists here escape them)
    escaped = tuple(r.replace("\r", "\\r").replace("\n", "\\n") if isinstance(r, str) else r for r in splits)
    for name, res in (("deepseek-llm", _DEEPSEEK_LLM_RES), ("deepseek-coder", _DEEPSEEK_CODER_RES)):
        if escaped == res:
            return name
    regexes = set(splits)
    for name, regex in (("qwen35", _QWEN35_RE), ("qwen2", _QWEN2_RE), ("llama-bpe", _LLAMA3_RE), ("tekken", _TEKKEN_RE),
                        ("gpt-4o", _GPT4O_RE)):
        if regex in regexes:
            return name
    raise TurboSpecError(f"cannot name this tokenizer's pre-tokenizer for llama.cpp ({json.dumps(pre)[:120]})")


def tokenizer_metadata(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """The tokenizer of a checkpoint directory as llama.cpp's GGUF keys (byte-level BPE only): tokens padded to the
    model's vocabulary, their types, merges, special token ids, chat template."""
    import gguf

    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
        conf_file = model_dir / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text(encoding="utf-8")) if conf_file.exists() else {}
    except (OSError, ValueError) as e:
        raise TurboSpecError(f"{model_dir}: cannot read the tokenizer ({type(e).__name__})") from None
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise TurboSpecError(f"{model_dir}: only byte-level BPE tokenizers can be exported (this one is "
                             f"{model.get('type')!r})")
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    vocab.update({t: a["id"] for t, a in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif t in added:
            special = added[t].get("special") or (t.startswith("<|") and t.endswith("|>"))
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre_tokenizer_name(tok),
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
    }
    for kind in ("bos", "eos"):
        t = conf.get(f"{kind}_token")
        t = t.get("content") if isinstance(t, dict) else t
        if t in vocab:
            meta[f"tokenizer.ggml.{kind}_token_id"] = vocab[t]
    meta["tokenizer.ggml.add_bos_token"] = bool(conf.get("add_bos_token", False))
    if conf.get("chat_template"):
        meta["tokenizer.chat_template"] = conf["chat_template"]
    return meta


def export_gguf(model_dir: str | Path, out: str | Path, kind: str = "f16",
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write `model_dir` (a dense, Qwen3-MoE, Qwen3.5 or Qwen3.5-MoE checkpoint, with its tokenizer) as the GGUF file
    `out`. Tensors are converted and written one at a time (a MoE layer's experts one stacked tensor at a time,
    read expert by expert): the export holds one output tensor, not the model."""
    import gguf

    if kind not in EXPORT_TYPES:
        hint = " (quantize an f16 export with llama.cpp's llama-quantize)" if kind.endswith("_k") else ""
        raise TurboSpecError(f"cannot export type {kind!r}{hint}; types: {', '.join(EXPORT_TYPES)}")
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    model_dir, out = Path(model_dir), Path(out)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    arch = EXPORT_ARCHS.get(cfg.arch)
    if arch is None:
        raise TurboSpecError(f"cannot export architecture {cfg.arch!r} (dense models, Qwen3-MoE, Qwen3.5 and "
                             "Qwen3.5-MoE)")
    hybrid, moe = arch in HYBRID, arch in MOE
    ws = WeightSource(model_dir)
    prefix = "model.language_model" if ws.has("model.language_model.embed_tokens.weight") else "model"
    n = cfg.num_layers
    names = {hf.replace("model.", f"{prefix}.", 1): g for hf, g in GLOBAL_NAMES.items()}
    layer = HYBRID_LAYER_NAMES if hybrid else PHI3_LAYER_NAMES if arch == "phi3" else LAYER_NAMES
    if moe:  # the router and the shared expert; the routed experts are stacked below
        layer = {**layer, **{hf: g for hf, g in MOE_LAYER_NAMES.items() if ".experts." not in hf}}
    if arch == "qwen3next":  # in_proj_qkvz is written as attn_qkv and attn_gate (below)
        layer = {**layer, "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight"}
    for i in range(n):
        names.update({f"{prefix}.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in layer.items()})
    has_mtp = hybrid and ws.has("mtp.fc.weight")
    if has_mtp:
        names.update({hf: f"blk.{n}.{g}" for hf, g in MTP_NAMES.items()})
        names.update({f"mtp.layers.0.{hf}": f"blk.{n}.{g}" for hf, g in layer.items()})
    # MoE feed-forwards: (Hugging Face prefix, GGUF block)
    moe_blocks = [(f"{prefix}.layers.{i}.mlp", i) for i in range(n)
                  if moe and ws.has(f"{prefix}.layers.{i}.mlp.gate.weight")]
    if has_mtp and moe and ws.has("mtp.layers.0.mlp.gate.weight"):
        moe_blocks.append(("mtp.layers.0.mlp", n))

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    write_metadata(w, cfg, arch, kind, has_mtp, [b for _, b in moe_blocks],
                   model_dir if (model_dir / "tokenizer.json").exists() else None)
    ranked = draft_vocab.load(model_dir)
    if ranked is not None:  # the MTP drafter's reduced vocabulary travels with the file
        w.add_array(draft_vocab.GGUF_KEY, ranked)
    lin = {**cfg.linear_dims(), "tiled": arch != "qwen3next"} if hybrid else {}
    m = cfg.moe()

    shapes = _Shapes(ws)
    jobs: list[tuple[str, tuple[int, ...], Callable[[Any], Any]]] = []  # (GGUF name, shape, encode(qtype))
    for hf in sorted(hf for hf in ws.names() if hf in names):
        g, shape = names[hf], shapes(hf)
        if hybrid and hf.endswith("conv1d.weight"):  # squeezed
            shape = (shape[0], math.prod(shape[1:]))
        if hf.endswith("in_proj_qkvz.weight"):  # Qwen3-Next: z apart, as the converter does
            gate = g.replace("attn_qkv", "attn_gate")
            z = lin["num_v_heads"] * lin["v_head_dim"]
            jobs.append((gate, (z, shape[1]), partial(_one, ws, cfg, hf, gate, lin)))
            shape = (shape[0] - z, shape[1])
        jobs.append((g, shape, partial(_one, ws, cfg, hf, g, lin)))
    e, h, inter = m["experts"], cfg.hidden_size, m["inter"]
    for p, b in moe_blocks:
        read = _expert_reader(ws, f"{p}.experts")
        for proj in ("gate", "up", "down"):
            mat = (h, inter) if proj == "down" else (inter, h)
            jobs.append((f"blk.{b}.ffn_{proj}_exps.weight", (e, *mat), partial(_stack, read, proj, e, mat)))

    freqs = rope_freqs(cfg)
    extra = {"rope_freqs.weight": freqs} if freqs is not None else rope_factors(cfg)
    for g, t in extra.items():
        jobs.append((g, tuple(t.shape), partial(lambda t, qt: t.numpy(), t)))
    types = [_tensor_type(g, shape, kind, qtype) for g, shape, _ in jobs]
    for (g, shape, _), qt in zip(jobs, types):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor_info(g, shape, np.dtype(np.float32), math.prod(shape[:-1]) * (shape[-1] // block) * size, qt)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for done, ((_, _, encode), qt) in enumerate(zip(jobs, types)):
            w.write_tensor_data(encode(qt))
            if progress is not None:
                progress(done + 1, len(jobs))
    except BaseException:  # a tensor that cannot be read or converted: no half-written file is left behind
        w.close()
        out.unlink(missing_ok=True)
        raise
    w.close()
    return out


def write_metadata(w, cfg: ModelConfig, arch: str, kind: str, has_mtp: bool, moe_blocks: list[int],
                   tokenizer_dir: Path | None) -> None:
    """The key-value metadata llama.cpp reads for `arch` (a GGUFWriter `w`): sizes, RoPE, the hybrid's recurrent
    layers, the experts' keys (`moe_blocks`: the blocks whose feed-forward is a MoE), the file type and the
    tokenizer of `tokenizer_dir` (its vocabulary padded to the config's)."""
    hybrid, moe = arch in HYBRID, arch in MOE
    n = cfg.num_layers
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n + int(has_mtp))
    if not moe or cfg.raw.get("intermediate_size") is not None:  # (llama.cpp's converter: when the config has it)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    if arch != "phi3":  # (llama.cpp's converter writes none for phi3: head_dim is hidden / heads there)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if arch in ("llama", "phi3"):  # (as llama.cpp's converter writes them)
        w.add_rope_dimension_count(int(cfg.head_dim * float(cfg.rope.get("partial_rotary_factor", 1.0))))
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
    if arch == "phi3":
        w.add_sliding_window(int(cfg.raw.get("sliding_window") or 0))
        w.add_rope_scaling_orig_ctx_len(int(cfg.raw.get("original_max_position_embeddings")
                                            or cfg.max_position_embeddings))
    _rope_scaling(w, cfg, arch)
    lin = cfg.linear_dims() if hybrid else {}
    if hybrid:
        w.add_rope_dimension_count(int(cfg.head_dim * float(cfg.rope.get("partial_rotary_factor", 1.0))))
        if arch != "qwen3next":
            w.add_rope_dimension_sections([11, 11, 10, 0])  # llama.cpp's default M-RoPE split for Qwen3.5 text
        w.add_ssm_conv_kernel(lin["conv_kernel"])
        w.add_ssm_state_size(lin["k_head_dim"])
        w.add_ssm_group_count(lin["num_k_heads"])
        w.add_ssm_time_step_rank(lin["num_v_heads"])
        w.add_ssm_inner_size(lin["v_head_dim"] * lin["num_v_heads"])
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg.layer_types()] + [False] * int(has_mtp))
        w.add_full_attention_interval(int(cfg.raw.get("full_attention_interval", 4)))
        if has_mtp:
            w.add_nextn_predict_layers(1)
    m = cfg.moe()
    if moe:
        _moe_metadata(w, arch, cfg, m, moe_blocks)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k": 15}[kind])
    if tokenizer_dir is not None:
        for key, value in tokenizer_metadata(tokenizer_dir, cfg.vocab_size).items():
            _add(w, key, value)


EXPORT_ARCHS = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3moe",
                "qwen3_5_text": "qwen35", "qwen3_5": "qwen35", "qwen3_5_moe_text": "qwen35moe",
                "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next", "phi3": "phi3"}  # model_type -> llama.cpp
F32_MATRICES = ("ssm_conv1d.weight",  # llama.cpp's ssm_conv needs F32
                "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # routers: F32, as llama.cpp's converter


def _rope_scaling(w, cfg: ModelConfig, arch: str) -> None:
    """RoPE scaling as llama.cpp's converter writes it: linear and YaRN as `rope.scaling.*` keys; llama3's schedule
    as the `rope_freqs` tensor (`rope_freqs` below; in llama files only: llama.cpp reads it in no other of these)."""
    import gguf

    r = cfg.rope
    kind = r.get("rope_type", "default")
    if kind == "llama3" and arch != "llama":
        raise TurboSpecError(f"cannot export llama3 RoPE scaling in a {arch} file (llama.cpp reads its rope_freqs "
                             "tensor in llama files only)")
    if kind in ("default", "llama3"):
        return
    if kind == "longrope" and arch == "phi3":  # the factors as tensors (`rope_factors`), the cos/sin scale as a key
        factor = cfg.max_position_embeddings / float(r["original_max_position_embeddings"])
        orig = float(r["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0)
        return
    if kind not in ("linear", "yarn"):
        raise TurboSpecError(f"cannot export RoPE scaling {kind!r}")
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(r["factor"]))
    if kind == "yarn":
        w.add_rope_scaling_orig_ctx_len(int(r.get("original_max_position_embeddings") or cfg.max_position_embeddings))
        for hf, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                        ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                        ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if r.get(hf) is not None:
                add(float(r[hf]))


def rope_factors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LongRoPE's short and long divisors as llama.cpp's converter writes them (`rope_factors_short` / `_long`)."""
    if cfg.rope.get("rope_type") != "longrope":
        return {}
    return {f"rope_factors_{k}.weight": torch.tensor(cfg.rope[f"{k}_factor"], dtype=torch.float32)
            for k in ("long", "short")}


def rope_freqs(cfg: ModelConfig) -> torch.Tensor | None:
    """llama3's schedule as llama.cpp's per-frequency divisors (its `rope_freqs` tensor): 1 for wavelengths below
    the original context / high_freq_factor, `factor` above original / low_freq_factor, 1 / ((1 - s) / factor + s)
    between, s the position of original / wavelength between low and high -- computed in float32 as the converter
    does, so the file has its bytes; None for the other schedules."""
    r = cfg.rope
    if r.get("rope_type", "default") != "llama3":
        return None
    default, _ = inv_freq_and_scale({**r, "rope_type": "default"}, cfg.head_dim)
    factor, low, high = float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"])
    old = float(r["original_max_position_embeddings"])
    wavelen = 2 * math.pi / default
    smooth = (old / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, medium)).float()


def _moe_metadata(w, arch: str, cfg: ModelConfig, m: dict[str, Any], blocks: list[int]) -> None:
    """The expert keys llama.cpp's converter writes (expert_count, expert_used_count, expert_feed_forward_length,
    expert_shared_feed_forward_length when the config has it). llama.cpp runs every qwen3moe block as a MoE and
    renormalises the top-k weights: a checkpoint that does neither still exports (turbospec loads it as it is, with
    `expert_weights_norm` false), with a warning that llama.cpp will not run it as transformers does."""
    w.add_expert_count(m["experts"])
    w.add_expert_used_count(m["top_k"])
    w.add_expert_feed_forward_length(m["inter"])
    if cfg.raw.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(m["shared_inter"])
    if arch not in ("qwen3moe", "qwen3next"):
        return
    if arch == "qwen3moe" and not m["norm_topk"]:
        w.add_expert_weights_norm(False)
        log.warning("norm_topk_prob is false: llama.cpp renormalises the top-k expert weights of qwen3moe files "
                    "regardless, so its output will differ from transformers' (turbospec follows the checkpoint)")
    dense = [i for i in range(cfg.num_layers) if i not in blocks]
    if dense:
        log.warning("layers %s have a dense feed-forward (mlp_only_layers / decoder_sparse_step): turbospec loads "
                    "the file, llama.cpp's %s needs every layer to be a MoE and will not", dense, arch)


class _Shapes:
    """Tensor shapes from the safetensors headers (no data read)."""

    def __init__(self, ws: WeightSource):
        self.ws = ws
        self.handles: dict[Path, Any] = {}

    def __call__(self, name: str) -> tuple[int, ...]:
        f = self.ws.index[name]
        if f not in self.handles:
            self.handles[f] = safe_open(str(f), framework="pt")
        return tuple(self.handles[f].get_slice(name).get_shape())


def _one(ws: WeightSource, cfg: ModelConfig, hf: str, g: str, lin: dict[str, int], qt) -> Any:
    """Tensor `hf` as llama.cpp's converter writes it (`g`), in type `qt`."""
    x = ws.get(hf, torch.float32)
    if cfg.arch == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        x = permute_rope(x, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
    if lin:  # the hybrids
        x = _convert_qwen35(hf, g, x, lin)
    return _encode(x.contiguous(), qt)


def _expert_reader(ws: WeightSource, x: str) -> Callable[[str, int], torch.Tensor]:
    """proj ("gate", "up", "down"), expert -> its matrix, from per-expert tensors (`experts.{e}.gate_proj.weight`,
    as transformers saves them), transformers-5's stacked `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj`,
    or stacked `experts.gate_proj` [E, I, H]: that expert's bytes only."""
    if ws.has(f"{x}.gate_up_proj"):
        def read(proj: str, e: int) -> torch.Tensor:
            if proj == "down":
                return ws.stacked_part(f"{x}.down_proj", e)
            gu = ws.stacked_part(f"{x}.gate_up_proj", e)
            half = gu.shape[0] // 2
            return gu[:half] if proj == "gate" else gu[half:]
        return read
    if ws.has(f"{x}.gate_proj"):
        return lambda proj, e: ws.stacked_part(f"{x}.{proj}_proj", e)
    return lambda proj, e: ws.get(f"{x}.{e}.{proj}_proj.weight")


def _stack(read: Callable[[str, int], torch.Tensor], proj: str, experts: int, shape: tuple[int, int], qt) -> Any:
    """The experts' `proj` matrices as one [E, out, in] tensor in `qt`, converted one expert at a time."""
    out = None
    for e in range(experts):
        x = read(proj, e)
        if tuple(x.shape) != shape:
            raise TurboSpecError(f"expert {e}'s {proj}_proj has shape {tuple(x.shape)}, the config implies {shape}")
        a = _encode(x.float().contiguous(), qt)
        if out is None:
            out = np.empty((experts, *a.shape), a.dtype)
        out[e] = a
    return out


def _tensor_type(g: str, shape: tuple[int, ...], kind: str, qtype):
    """A tensor's type in the file: matrices (and stacked experts) in the chosen type, vectors, the conv1d kernel
    and the routers in F32; rows that are not whole blocks F32, except q4_k's, which fall back to Q5_0 as
    `llama-quantize` does."""
    import gguf

    q = gguf.GGMLQuantizationType
    if kind == "f32" or len(shape) < 2 or g.endswith(F32_MATRICES):
        return q.F32
    cols = shape[-1]
    if kind == "q4_k":
        return q.Q4_K if cols % 256 == 0 else q.Q5_0 if cols % 32 == 0 else q.F32
    return qtype if cols % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else q.F32


def _encode(x: torch.Tensor, qt) -> Any:
    """A float32 tensor as the bytes (or values) of type `qt`, rows along the last dimension."""
    import gguf

    q = gguf.GGMLQuantizationType
    if qt == q.F32:
        return x.numpy()
    if qt == q.Q4_K:  # turbospec's port of llama.cpp's reference quantizer
        return quantize(x.reshape(-1, x.shape[-1]), "q4_k").numpy().reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x.numpy(), qt)


def _convert_qwen35(hf: str, g: str, x: torch.Tensor, lin: dict[str, int]) -> torch.Tensor:
    """What llama.cpp's converter does to a Qwen3.5 or Qwen3-Next tensor (undone by `GGUFWeights._undo_qwen35`):
    the +1 norms, -exp(A_log), the squeezed conv1d; Qwen3.5's value heads tiled; Qwen3-Next's in_proj_qkvz taken
    apart (`hybrid.split_qkvz`)."""
    if g.endswith("norm.weight") and not g.endswith("ssm_norm.weight"):
        return x + 1
    nk, nv, dk, dv = lin["num_k_heads"], lin["num_v_heads"], lin["k_head_dim"], lin["v_head_dim"]
    if hf.endswith("in_proj_qkvz.weight"):  # Qwen3-Next: attn_qkv or attn_gate
        qkv, z = split_qkvz(x, nk, nv, dk, dv)
        return z if g.endswith("attn_gate.weight") else qkv
    if nv != nk and ".linear_attn." in hf and lin.get("tiled", True):
        r = nv // nk
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
        x = x.reshape(x.shape[0], -1)
    return x


def _add(w, key: str, value: Any) -> None:
    """One metadata value under its llama.cpp key."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif key == "tokenizer.ggml.token_type":
        w.add_array(key, [int(t) for t in value])
    elif isinstance(value, list):
        w.add_array(key, value)
    else:  # pragma: no cover - the callers pass only the kinds above
        raise TypeError(f"{key}: {type(value).__name__}")
