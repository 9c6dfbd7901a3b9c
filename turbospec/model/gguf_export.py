"""Write a checkpoint directory as a llama.cpp GGUF file, laid out as llama.cpp's convert_hf_to_gguf.py lays it out
(its tensor names, metadata keys and tensor transforms, the inverse of what `turbospec.model.gguf` undoes), so that
llama.cpp loads and runs it — the hybrid with its MTP block, which llama.cpp's `--spec-type draft-mtp` uses — and
turbospec loads it back to the same tensors.

Types: f32, f16, bf16, q8_0, q4_0 (the `gguf` package's quantizers) and q4_k (turbospec's port of llama.cpp's
reference quantizer, `turbospec.weights.quantize`) for the matrices; 1-D tensors stay f32, as llama.cpp keeps them.
Rows that are not whole blocks stay f32, except q4_k's, which fall back to Q5_0 as `llama-quantize` does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from turbospec.errors import TurboSpecError
from turbospec.model.config import DENSE_ARCHS, HYBRID_ARCHS, ModelConfig
from turbospec.model.gguf import GLOBAL_NAMES, HYBRID_LAYER_NAMES, LAYER_NAMES, MTP_NAMES
from turbospec.model.loader import WeightSource
from turbospec.tokenizer import _LLAMA3_RE, _QWEN2_RE, _QWEN35_RE
from turbospec.weights import quantize

EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k")


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
    regexes = {p.get("pattern", {}).get("Regex") for p in pre.get("pretokenizers", []) if p.get("type") == "Split"}
    for name, regex in (("qwen35", _QWEN35_RE), ("qwen2", _QWEN2_RE), ("llama-bpe", _LLAMA3_RE)):
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
    """Write `model_dir` (a dense or Qwen3.5 checkpoint, with its tokenizer) as the GGUF file `out`."""
    import gguf

    if kind not in EXPORT_TYPES:
        hint = " (quantize an f16 export with llama.cpp's llama-quantize)" if kind.endswith("_k") else ""
        raise TurboSpecError(f"cannot export type {kind!r}{hint}; types: {', '.join(EXPORT_TYPES)}")
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    model_dir, out = Path(model_dir), Path(out)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    hybrid = cfg.arch in HYBRID_ARCHS
    if cfg.arch not in DENSE_ARCHS + ("qwen3_5_text", "qwen3_5"):
        raise TurboSpecError(f"cannot export architecture {cfg.arch!r} (dense models and Qwen3.5)")
    arch = "qwen35" if hybrid else cfg.arch
    ws = WeightSource(model_dir)
    prefix = "model.language_model" if ws.has("model.language_model.embed_tokens.weight") else "model"
    n = cfg.num_layers
    names = {hf.replace("model.", f"{prefix}.", 1): g for hf, g in GLOBAL_NAMES.items()}
    layer = HYBRID_LAYER_NAMES if hybrid else LAYER_NAMES
    for i in range(n):
        names.update({f"{prefix}.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in layer.items()})
    has_mtp = hybrid and ws.has("mtp.fc.weight")
    if has_mtp:
        names.update({hf: f"blk.{n}.{g}" for hf, g in MTP_NAMES.items()})
        names.update({f"mtp.layers.0.{hf}": f"blk.{n}.{g}" for hf, g in HYBRID_LAYER_NAMES.items()})

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n + int(has_mtp))
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope.get("rope_type", "default") != "default":
        raise TurboSpecError(f"cannot export RoPE scaling {cfg.rope['rope_type']!r} yet")
    lin = cfg.linear_dims() if hybrid else {}
    if hybrid:
        w.add_rope_dimension_count(int(cfg.head_dim * float(cfg.rope.get("partial_rotary_factor", 1.0))))
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
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k": 15}[kind])
    if (model_dir / "tokenizer.json").exists():
        for key, value in tokenizer_metadata(model_dir, cfg.vocab_size).items():
            _add(w, key, value)

    todo = [hf for hf in ws.names() if hf in names]
    for done, hf in enumerate(sorted(todo)):
        g = names[hf]
        x = ws.get(hf, torch.float32)
        if cfg.arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute_rope(x, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
        if hybrid:
            x = _convert_qwen35(hf, g, x, lin)
        a = x.numpy()
        # matrices in the chosen type; vectors and the conv1d kernel (llama.cpp's ssm_conv needs F32) in F32
        matrix = a.ndim == 2 and kind != "f32" and not g.endswith("ssm_conv1d.weight")
        q5_0 = gguf.GGMLQuantizationType.Q5_0
        if matrix and kind == "q4_k" and a.shape[1] % 256 == 0:
            w.add_tensor(g, quantize(x, "q4_k").numpy().reshape(a.shape[0], -1), raw_dtype=qtype)
        elif matrix and kind == "q4_k" and a.shape[1] % 32 == 0:  # llama-quantize's fallback
            w.add_tensor(g, gguf.quants.quantize(a, q5_0), raw_dtype=q5_0)
        elif matrix and a.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, a)
        if progress is not None:
            progress(done + 1, len(todo))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _convert_qwen35(hf: str, g: str, x: torch.Tensor, lin: dict[str, int]) -> torch.Tensor:
    """What llama.cpp's converter does to a Qwen3.5 tensor (undone by `GGUFWeights._undo_qwen35`)."""
    if g.endswith("norm.weight") and not g.endswith("ssm_norm.weight"):
        return x + 1
    nk, nv, dk, dv = lin["num_k_heads"], lin["num_v_heads"], lin["k_head_dim"], lin["v_head_dim"]
    if nv != nk and ".linear_attn." in hf:
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
