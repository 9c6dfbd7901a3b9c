"""llama.cpp GGUF files: the hyperparameters as a `ModelConfig`, and the tensors under their Hugging Face names
(dequantized by the `gguf` package to the model's dtype), so that the model classes build from a `.gguf` file
exactly as from a checkpoint directory.

Architectures: `qwen3`, `qwen2`, `llama` (dense), `qwen3moe` (Qwen3-MoE), `qwen35` and `qwen35moe` (the Qwen3.5
hybrid and its mixture-of-experts variant, with the `nextn` MTP block as the checkpoint's `mtp.*`). Tensor types:
`TYPES`. `get` undoes what llama.cpp's converter did to a tensor (llama's permuted q/k rows; for qwen35 / qwen35moe
the +1 on norm weights, -exp(A_log), the squeezed conv1d, the tiled value heads), so the tensors are the
checkpoint's again. Matrices stored as Q8_0, Q4_0, Q4_K, Q5_K or Q6_K stay packed (`matrix`: the file's blocks, rows
reordered where the converter reordered them); other quantized types are dequantized by the `gguf` package to the
model's dtype. A MoE layer's experts are the file's stacked `ffn_{gate,up,down}_exps` (or a fused
`ffn_gate_up_exps`) tensors under the names `decoder.load_moe` asks for (`experts.gate_proj` [E, I, H], ...), read
one expert at a time (`expert_matrix`: a view of the memory map for packed types)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turbospec.errors import TurboSpecError
from turbospec.model.config import ModelConfig
from turbospec.model.loader import IndexedSource, _one_line
from turbospec.weights import BY_GGUF_TYPE, packable, packed_here, release, trim_heap

ARCHS = ("qwen3", "qwen2", "llama", "mistral3", "phi3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")
LLAMA = ("llama", "mistral3")  # llama's layout (q/k rows permuted by the converter; rope_freqs read)
HYBRID = ("qwen35", "qwen35moe", "qwen3next")  # Gated DeltaNet + gated attention (the converter reorders tensors)
MOE = ("qwen3moe", "qwen35moe", "qwen3next")
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",  # else the same
               "mistral3": "llama",  # (Mistral Small 3.1 / 3.2, Ministral 3: llama layers)
               "qwen3next": "qwen3_next"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K",
         # what llama-quantize falls back to for rows not a multiple of 256 values, and other common ones
         "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")

GLOBAL_NAMES = {  # Hugging Face name -> GGUF name
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {  # per layer: Hugging Face suffix -> GGUF suffix
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}


PHI3_LAYER_NAMES = {  # phi3 (Phi-3, Phi-4): q/k/v and gate/up fused, as in the checkpoint
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HYBRID_LAYER_NAMES = {  # qwen35 (Qwen3.5 / 3.6 hybrid), per layer: Hugging Face suffix -> GGUF suffix
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",  # qwen3next: b and a in one, in the checkpoint's order
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MOE_LAYER_NAMES = {  # qwen3moe / qwen35moe, per layer: Hugging Face suffix -> GGUF suffix
    "mlp.gate.weight": "ffn_gate_inp.weight",  # the router [E, H]
    # the experts stacked [E, out, in], as `decoder.load_moe` names them (no .weight)
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight",  # llama.cpp's fused variant: [E, 2I, H], gate rows first
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",  # [1, H] (ggml: {H, 1})
}
MTP_NAMES = {  # the MTP block, stored by llama.cpp as layer n_layers ("nextn"): Hugging Face -> GGUF suffix
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}


def is_gguf(path: str | Path) -> bool:
    """A path that names a GGUF file (by its magic bytes, or its suffix when it cannot be read)."""
    p = Path(path)
    if not p.is_file():
        return p.suffix.lower() == ".gguf"
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One GGUF file: its metadata, config and tensors (read lazily through a memory map)."""

    def __init__(self, path: str | Path):
        from turbospec.model.gguf_reader import GGUFContents

        self.path = Path(path)
        if not self.path.is_file():
            raise TurboSpecError(f"{self.path}: no such GGUF file")
        try:
            contents = GGUFContents(self.path)
        except Exception as e:  # noqa: BLE001 -- ValueError / IndexError / struct.error / OSError on bad files
            raise TurboSpecError(f"{self.path.name}: corrupt or truncated GGUF file ({_one_line(e)})") from None
        self.meta = contents.meta
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCHS:
            raise TurboSpecError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHS)})")
        self.tensors = {t.name: t for t in contents.tensors}

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's metadata value `name` (e.g. "block_count" -> qwen3.block_count)."""
        return self.meta.get(f"{self.arch}.{name}", default)

    def config(self) -> ModelConfig:
        """The hyperparameters as the Hugging Face config.json the file was converted from would give them."""
        d = self._dense_config()
        if self.arch in MOE:
            d.update(self._moe_config(d))
        d["model_type"] = MODEL_TYPES.get(str(self.arch), self.arch)
        if self.arch not in HYBRID:
            return ModelConfig.from_dict(d)
        # the hybrid: block_count counts the MTP ("nextn") layers too; the rest is the ssm.* keys
        n_mtp = int(self.key("nextn_predict_layers", 0) or 0)
        n = d["num_hidden_layers"] = int(d["num_hidden_layers"]) - n_mtp
        recurrent = self.key("attention.recurrent_layers")
        interval = self.key("full_attention_interval", 4)
        if recurrent is None and self.arch == "qwen3next" and isinstance(interval, int) and interval > 0:
            recurrent = [(i + 1) % interval != 0 for i in range(n)]  # (llama.cpp's default for Qwen3-Next)
        if not isinstance(recurrent, list) or len(recurrent) < n:
            raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.attention.recurrent_layers is missing or "
                                 "short")
        ssm = {k: self.key(f"ssm.{k}") for k in ("conv_kernel", "state_size", "group_count", "time_step_rank",
                                                   "inner_size")}
        missing = [k for k, v in ssm.items() if not isinstance(v, int) or v <= 0]
        if missing:
            raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.ssm.{missing[0]} is missing or not "
                                 "positive")
        rope_dim = self.key("rope.dimension_count", d["head_dim"])
        d.update(mtp_num_hidden_layers=n_mtp,
                 layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:n]],
                 full_attention_interval=interval,
                 linear_conv_kernel_dim=ssm["conv_kernel"], linear_key_head_dim=ssm["state_size"],
                 linear_num_key_heads=ssm["group_count"], linear_num_value_heads=ssm["time_step_rank"],
                 linear_value_head_dim=ssm["inner_size"] // ssm["time_step_rank"],
                 rope_parameters={**d.pop("rope_parameters"), "rope_theta": d.pop("rope_theta"),
                                  "partial_rotary_factor": rope_dim / d["head_dim"]})
        return ModelConfig.from_dict(d)

    def _rope_scaling(self, context_length: Any, rotated: Any) -> dict[str, Any]:
        """RoPE scaling as llama.cpp reads it from the file, in the config.json spelling: `rope.scaling.type` (absent:
        linear, llama.cpp's default) with `rope.scaling.factor` (or the older `rope.scale_linear`; absent: none);
        for YaRN the original context length (default: context_length), `yarn_beta_fast` / `yarn_beta_slow` and
        the attention factor (`yarn_attn_factor`, the checkpoint's own, else llama.cpp's 0.1 ln(factor) + 1, over
        0.1 m ln(factor) + 1 with a `yarn_log_multiplier` m; times `rope.scaling.attn_factor`); and the llama3
        schedule, which llama.cpp's converter writes as per-frequency divisors, the `rope_freqs` tensor (llama
        layouts only, as llama.cpp reads it; one per pair of the `rotated` dims); LongRoPE as its short and long
        divisors (`rope_factors_short` / `_long`) with `rope.scaling.attn_factor`."""
        name = self.path.name
        if "rope_factors_long.weight" in self.tensors:  # LongRoPE (Phi-3.5, Phi-4-mini; the converter writes no type)
            short, long = (self._rope_factors(f"rope_factors_{k}.weight", rotated) for k in ("short", "long"))
            return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                    "original_max_position_embeddings": self._number("rope.scaling.original_context_length",
                                                                     context_length),
                    "attention_factor": self._number("rope.scaling.attn_factor", 1.0)}
        kind = self.key("rope.scaling.type", "linear")
        factor = self._number("rope.scaling.factor", zero=True)
        if factor is None:
            factor = self._number("rope.scale_linear", zero=True)  # (the older key)
        if kind not in ("none", "linear", "yarn"):
            raise TurboSpecError(f"{name}: RoPE scaling {str(kind)[:40]!r} is not supported (none, linear, yarn, and "
                                 "llama3's rope_freqs)")
        rope: dict[str, Any] = {"rope_type": "default"}
        if factor is not None and kind != "none" and factor not in (0, 1):  # (llama.cpp: 0 is none; 1 scales nothing)
            rope = {"rope_type": kind, "factor": factor}
        scale = self._number("rope.scaling.attn_factor", 1.0)
        if rope["rope_type"] == "yarn":
            rope["original_max_position_embeddings"] = self._number("rope.scaling.original_context_length",
                                                                    context_length)
            for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if self.key(f"rope.scaling.{key}") is not None:
                    rope[hf] = self._number(f"rope.scaling.{key}")
            f = rope["factor"]
            attn = self._number("rope.scaling.yarn_attn_factor")
            if attn is None:  # llama.cpp's: 0.1 ln(f) + 1, or with a log multiplier m (Ministral 3's mscale_all_dim)
                m = self._number("rope.scaling.yarn_log_multiplier", 0.0, zero=True)  # (0.1 ln(f) + 1) / (0.1 m ...)
                attn = (0.1 * math.log(f) + 1) / (0.1 * m * math.log(f) + 1)
            rope["attention_factor"] = attn * scale
        elif scale != 1:
            raise TurboSpecError(f"{name}: rope.scaling.attn_factor {scale:g} without YaRN is not supported")
        if self.key("attention.temperature_scale"):  # (Ministral 3's llama_4_scaling_beta: queries scaled by
            # 1 + beta ln(1 + floor(pos / n)) -- by 1 before position n, the original context; not done here)
            rope["exact_positions"] = int(self._number("rope.scaling.original_context_length", context_length))
        if "rope_freqs.weight" in self.tensors:
            if self.arch not in LLAMA:
                raise TurboSpecError(f"{name}: a rope_freqs tensor in a {self.arch} file (llama.cpp reads it for "
                                     "llama files only)")
            rope["freq_factors"] = self._rope_factors("rope_freqs.weight", rotated)
        return rope

    def _number(self, key: str, default: Any = None, zero: bool = False) -> Any:
        """The metadata number `key` (the architecture's), `default` when absent; positive (or 0 with `zero`), else
        a one-line error."""
        v = self.key(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
                (v == 0 and not zero):
            raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.{key} must be a positive number, got "
                                 f"{str(v)[:40]}")
        return float(v)

    def _rope_factors(self, tensor: str, rotated: Any) -> list[float]:
        """A tensor of per-frequency factors (`rope_freqs`, `rope_factors_long` / `_short`): positive, one per pair
        of the `rotated` dims; a one-line error otherwise."""
        t = self.tensors.get(tensor)
        if t is None:
            raise TurboSpecError(f"{self.path.name}: tensor {tensor} is missing")
        try:
            values = _values(t.data, t.tensor_type).astype(np.float64).ravel()
        except (ValueError, IndexError) as e:
            raise TurboSpecError(f"{self.path.name}: cannot read tensor {tensor} ({_one_line(e)})") from None
        if not np.all(np.isfinite(values)) or not np.all(values > 0):
            raise TurboSpecError(f"{self.path.name}: tensor {tensor} must hold positive numbers")
        if isinstance(rotated, int) and values.size != rotated // 2:
            raise TurboSpecError(f"{self.path.name}: tensor {tensor} has {values.size} values, the {rotated} rotated "
                                 f"dims need {rotated // 2}")
        return values.tolist()

    def _moe_config(self, d: dict[str, Any]) -> dict[str, Any]:
        """The mixture-of-experts fields, as llama.cpp reads them: expert_count, expert_used_count,
        expert_feed_forward_length (else feed_forward_length / experts used), the shared expert's
        expert_shared_feed_forward_length (else feed_forward_length). llama.cpp renormalises the top-k weights for
        both architectures (`expert_weights_norm`, which its converter does not write for them, is honoured when
        present: turbospec's export writes false for a Qwen3-MoE checkpoint with norm_topk_prob false). Qwen3-MoE
        layers without a router (`ffn_gate_inp`) are the checkpoint's mlp_only_layers."""
        experts, used = self._count("expert_count"), self._count("expert_used_count")
        ff = self.key("feed_forward_length")
        inter = self._count("expert_feed_forward_length", False)
        if not inter:
            if not isinstance(ff, int) or ff < used:
                raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.expert_feed_forward_length is missing")
            inter = ff // used
        if d.get("intermediate_size") is None:  # (the converter writes it only when the config.json has it)
            d["intermediate_size"] = inter
        out: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": inter,
                               "norm_topk_prob": bool(self.key("expert_weights_norm", True))}
        if self.arch in ("qwen35moe", "qwen3next"):
            shared = self._count("expert_shared_feed_forward_length", False)
            out["shared_expert_intermediate_size"] = shared or d["intermediate_size"]
        if self.arch != "qwen35moe":
            n = d["num_hidden_layers"] if isinstance(d["num_hidden_layers"], int) else 0
            n -= int(self.key("nextn_predict_layers", 0) or 0)
            out.update(decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors])
        return out

    def _count(self, name: str, required: bool = True) -> int:
        """A positive integer metadata value (llama.cpp also takes one per layer: then all must be equal); 0 when
        it is absent (or 0) and not `required`."""
        v = self.key(name)
        if isinstance(v, list) and v and all(x == v[0] for x in v):
            v = v[0]
        if not required and (v is None or v == 0):
            return 0
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            what = "is missing" if v is None else f"must be a positive integer (the same for every layer), got " \
                f"{str(v)[:40]}"
            raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.{name} {what}")
        return v

    def _dense_config(self) -> dict[str, Any]:
        need = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}
        d: dict[str, Any] = {"model_type": self.arch}
        for k, hf in need.items():
            if self.key(k) is None and not (k == "feed_forward_length" and self.arch in MOE):  # (MoE: optional)
                raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.{k} is missing")
            d[hf] = self.key(k)
        heads = d["num_attention_heads"]
        d["num_key_value_heads"] = self.key("attention.head_count_kv", heads)
        if isinstance(heads, int) and isinstance(d["hidden_size"], int) and heads > 0:
            d["head_dim"] = self.key("attention.key_length", d["hidden_size"] // heads)
        d["rms_norm_eps"] = self.key("attention.layer_norm_rms_epsilon", 1e-6)
        d["rope_theta"] = self.key("rope.freq_base", 10000.0)
        d["max_position_embeddings"] = self.key("context_length", 4096)
        rotated = self.key("rope.dimension_count", d.get("head_dim"))
        d["rope_parameters"] = self._rope_scaling(d["max_position_embeddings"], rotated)
        if self.arch not in HYBRID and isinstance(rotated, int) and isinstance(d.get("head_dim"), int) \
                and rotated != d["head_dim"]:  # partial rotary (Phi-4-mini)
            d["rope_parameters"]["partial_rotary_factor"] = rotated / d["head_dim"]
        if self.arch == "phi3":  # (the converter writes 0 for none: Phi-4)
            d["sliding_window"] = self.key("attention.sliding_window") or None
            d["original_max_position_embeddings"] = self.key("rope.scaling.original_context_length")
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise TurboSpecError(f"{self.path.name}: tensor token_embd.weight is missing")
        d["vocab_size"] = int(emb.shape[1])  # ggml order: (hidden, vocab)
        d["tie_word_embeddings"] = "output.weight" not in self.tensors
        d["attention_bias"] = "blk.0.attn_q.bias" in self.tensors or "blk.0.attn_output.bias" in self.tensors
        d["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensors
        for hf, k in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if k in self.meta:
                d[hf] = self.meta[k]
        return d

    def weights(self, cfg: ModelConfig) -> GGUFWeights:
        return GGUFWeights(self, cfg)


class GGUFWeights(IndexedSource):
    """The file's tensors under Hugging Face names (a `TensorSource`)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig):
        self.f, self.cfg = f, cfg
        self.hybrid = f.arch in HYBRID
        self.index: dict[str, str] = {}
        self.tiled: dict[str, int] = {}  # value_tiling
        for hf, g in GLOBAL_NAMES.items():
            if g in f.tensors:
                self.index[hf] = g
        layer = HYBRID_LAYER_NAMES if self.hybrid else PHI3_LAYER_NAMES if f.arch == "phi3" else LAYER_NAMES
        if f.arch in MOE:
            layer = {**layer, **MOE_LAYER_NAMES}
        for i in range(cfg.num_layers):
            for hf, g in layer.items():
                if f"blk.{i}.{g}" in f.tensors:
                    self.index[f"model.layers.{i}.{hf}"] = f"blk.{i}.{g}"
        if self.hybrid and f"blk.{cfg.num_layers}.nextn.eh_proj.weight" in f.tensors:  # the MTP block
            n = cfg.num_layers
            names = {**MTP_NAMES, **{f"mtp.layers.0.{hf}": g for hf, g in layer.items()}}
            for hf, g in names.items():
                if f"blk.{n}.{g}" in f.tensors:
                    self.index[hf] = f"blk.{n}.{g}"

    def _tensor(self, name: str):
        if name not in self.index:
            raise TurboSpecError(f"{self.f.path.name}: missing tensor {name!r}")
        self._reading(name)
        t = self.f.tensors[self.index[name]]
        kind = t.tensor_type.name
        if kind not in TYPES:
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has type {kind}, which is not supported "
                                 f"(supported: {', '.join(TYPES)})")
        return t

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """The file's blocks [out, blocks, block bytes] for a Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K matrix (a view of the
        memory map unless rows had to be reordered), else `get` (float, or packed per `pack`)."""
        t = self._tensor(name)
        fmt = BY_GGUF_TYPE.get(t.tensor_type.name)
        if fmt is None or not packed_here() or not packable(fmt, shape):
            return super().matrix(name, dtype, shape)  # (trims the heap itself)
        trim_heap()
        col_unit = fmt.block_values
        lin = self.cfg.linear_dims() if self.hybrid else {}
        tiled = (name.endswith("out_proj.weight") and bool(lin) and lin["num_v_heads"] != lin["num_k_heads"]
                 and lin["v_head_dim"] % col_unit != 0)  # a value head is not whole blocks: keep the file's order
        if (int(t.shape[1]), int(t.shape[0])) != tuple(shape):
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has shape {(int(t.shape[1]), int(t.shape[0]))}"
                                 f", the config implies {tuple(shape)}")
        packed_shape = (shape[0], shape[1] // fmt.block_values, fmt.block_bytes)
        try:
            data = t.data.reshape(packed_shape)
        except (ValueError, IndexError) as e:
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has {t.data.size} bytes, a {shape} "
                                 f"{fmt.name} matrix needs {int(np.prod(packed_shape))} ({_one_line(e)})") from None
        out = _mapped(data)
        if tiled:
            self.tiled[name] = lin["num_v_heads"] // lin["num_k_heads"]
            return out
        return self._reorder(name, out, col_unit)

    def value_tiling(self, name: str) -> int:
        return self.tiled.get(name, 1)

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """Expert `index` of a stacked [E, out, in] tensor, only its bytes read: Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K blocks
        [out, blocks, block bytes] as a view of the memory map (no copy: its pages come in as the kernel reads
        them); other types as values in `dtype` (quantized ones dequantized by the `gguf` package), or packed per
        `pack` (--weights)."""
        t, data = self._expert(name, index, shape)
        fmt = BY_GGUF_TYPE.get(t.tensor_type.name)
        if fmt is not None and packed_here() and packable(fmt, shape):
            return _mapped(data.reshape(shape[0], shape[1] // fmt.block_values, fmt.block_bytes))
        return super().expert_matrix(name, index, dtype, shape)  # values via stacked_part, packed per `pack`

    def stacked_part(self, name: str, index: int) -> torch.Tensor:
        """Part `index` of a stacked tensor as values (that part's bytes only)."""
        t = self._tensor(name)
        dims = tuple(int(n) for n in reversed(t.shape.tolist()))
        t, data = self._expert(name, index, dims[1:])
        return self._expert_values(t, data, dims[1:])

    def _expert(self, name: str, index: int, shape: tuple[int, ...]):
        """The tensor behind `name` (checked against [experts, *shape]) and expert `index`'s slice of the map."""
        t = self._tensor(name)
        dims = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        want = (self.cfg.moe()["experts"], *shape)
        if dims != want:
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has shape {dims}, the config implies {want}")
        if not 0 <= index < dims[0]:
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has {dims[0]} experts, no expert {index}")
        return t, t.data[index]

    def _expert_values(self, t, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """One expert's slice as a float tensor of its own (F32 / F16 as stored, others dequantized), its file pages
        dropped."""
        try:
            x = _values(data, t.tensor_type).reshape(shape)
        except (ValueError, IndexError) as e:
            raise TurboSpecError(f"{self.f.path.name}: cannot read tensor {t.name} ({_one_line(e)})") from None
        out = torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else np.array(x))
        _release(data)
        return out

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self._tensor(name)
        rows = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        try:
            x = _values(t.data, t.tensor_type).reshape(rows)
        except (ValueError, IndexError) as e:  # a truncated file maps fewer bytes than the tensor needs
            raise TurboSpecError(f"{self.f.path.name}: cannot read tensor {t.name} ({_one_line(e)})") from None
        out = self._reorder(name, torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else np.array(x)))
        _release(t.data)  # off the map now: drop the file's pages
        if shape is not None and tuple(out.shape) != tuple(shape):
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has shape {tuple(out.shape)}, the config "
                                 f"implies {tuple(shape)}")
        return out.to(dtype) if dtype is not None else out

    def _reorder(self, name: str, out: torch.Tensor, col_unit: int = 1) -> torch.Tensor:
        """Undo the converter's reordering (rows, and columns in units of `col_unit` values for packed rows)."""
        if self.f.arch in LLAMA and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
            out = unpermute_rope(out, heads)
        if self.hybrid:
            out = self._undo_qwen35(name, self.index[name], out, col_unit)
        return out

    def _undo_qwen35(self, name: str, gguf_name: str, x: torch.Tensor, col_unit: int = 1) -> torch.Tensor:
        """Undo llama.cpp's converter for a Qwen3.5 tensor: its +1 on zero-centred norm weights (every GGUF
        `*norm.weight` but the gated DeltaNet's `ssm_norm`, the MTP block's `enorm` / `hnorm` included), A_log
        stored as -exp(A_log), the conv1d weight squeezed, and (when there are more value than key heads) the
        value heads reordered from grouped-by-key-head to tiled."""
        if gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight"):
            return x - 1
        lin = self.cfg.linear_dims()
        nk, nv, dk, dv = lin["num_k_heads"], lin["num_v_heads"], lin["k_head_dim"], lin["v_head_dim"]
        if name.endswith(".A_log"):
            x = torch.log(-x)
        if name.endswith("conv1d.weight"):
            x = x.reshape(x.shape[0], 1, -1)
        if nv == nk or ".linear_attn." not in name or self.f.arch == "qwen3next":  # (Qwen3-Next: grouped, as is)
            return x
        r = nv // nk
        if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
            qk = 2 * nk * dk
            return torch.cat([x[:qk], untile_v_heads(x[qk:], 0, nk, r, dv)])
        if name.endswith("in_proj_z.weight"):
            return untile_v_heads(x, 0, nk, r, dv)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
            return untile_v_heads(x, 0, nk, r, 1)
        if name.endswith("out_proj.weight"):
            return untile_v_heads(x, 1, nk, r, dv // col_unit)
        return x


def _mapped(data: np.ndarray) -> torch.Tensor:
    """A tensor sharing the read-only memory map's bytes (torch warns that it is not writable: nothing writes
    to weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _release(data: np.ndarray) -> None:
    """`turbospec.weights.release` for a tensor's memory-mapped bytes."""
    if data.flags.c_contiguous and data.size:
        release(_mapped(data))


def _values(data: np.ndarray, qtype) -> np.ndarray:
    """A tensor's values: float arrays as they are, quantized blocks dequantized by the gguf package."""
    from gguf import GGMLQuantizationType, quants

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data
    return quants.dequantize(data, qtype)


def untile_v_heads(x: torch.Tensor, dim: int, nk: int, r: int, d: int) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order [v0 of every key head, v1 of every key head, ...] back
    to the checkpoint's grouped order [all v of key head 0, all v of key head 1, ...] (`r` value heads per key
    head, `d` values each)."""
    shape = list(x.shape)
    y = x.reshape(*shape[:dim], r, nk, d, *shape[dim + 1:])
    return y.transpose(dim, dim + 1).reshape(shape)


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of a llama q/k projection (each head's rows interleaved from two
    halves), giving the checkpoint's rows back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
