"""Model configuration read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbospec.errors import TurboSpecError

DENSE_ARCHS = ("qwen3", "qwen2", "llama")
HYBRID_ARCHS = ("qwen3_5_text", "qwen3_5", "qwen3_next")
SUPPORTED_ARCHS = DENSE_ARCHS + HYBRID_ARCHS


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rope_theta(self) -> float:
        return float(self.rope.get("rope_theta", 10000.0))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- hybrid (Gated DeltaNet) fields, read from the raw config -----------------------------------------
    def layer_types(self) -> list[str]:
        """'full_attention' or 'linear_attention' per layer (all full attention for dense archs)."""
        if self.arch not in HYBRID_ARCHS:
            return ["full_attention"] * self.num_layers
        types = self.raw.get("layer_types")
        if types is None:
            every = int(self.raw.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention"
                     for i in range(self.num_layers)]
        types = list(types)[: self.num_layers]
        kinds = ("full_attention", "linear_attention")
        if len(types) != self.num_layers or any(t not in kinds for t in types):
            raise TurboSpecError(f"config layer_types must list full_attention/linear_attention for each of "
                                 f"{self.num_layers} layers, got {types}")
        return types

    def linear_dims(self) -> dict[str, int]:
        """Gated DeltaNet sizes: key/value heads, key/value head dims, conv kernel."""
        r = self.raw
        return {
            "num_k_heads": int(r.get("linear_num_key_heads", 16)),
            "num_v_heads": int(r.get("linear_num_value_heads", 32)),
            "k_head_dim": int(r.get("linear_key_head_dim", 128)),
            "v_head_dim": int(r.get("linear_value_head_dim", 128)),
            "conv_kernel": int(r.get("linear_conv_kernel_dim", 4)),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = d.get("model_type")
        if arch == "qwen3_5" and "text_config" in d:
            inner = dict(d["text_config"])
            inner.setdefault("model_type", "qwen3_5_text")
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):  # outer values govern
                if d.get(key) is not None:
                    inner[key] = d[key]
            return cls.from_dict({**inner, "_outer_model_type": "qwen3_5"})
        if arch not in SUPPORTED_ARCHS:
            raise TurboSpecError(
                f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            cfg = cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope_params(d, hybrid=arch in HYBRID_ARCHS),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=arch in ("llama", "qwen3") + HYBRID_ARCHS and bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=arch in ("qwen3",) + HYBRID_ARCHS,
                hidden_act=str(d.get("hidden_act", "silu")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_as_tuple(d.get("eos_token_id")),
                raw=d,
            )
        except KeyError as e:
            raise TurboSpecError(f"config.json is missing required field {e.args[0]!r}") from None
        if cfg.hidden_act not in ("silu", "swish"):
            raise TurboSpecError(f"unsupported activation {cfg.hidden_act!r} (only silu)")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise TurboSpecError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise TurboSpecError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)


def _as_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _rope_params(d: dict[str, Any], hybrid: bool = False) -> dict[str, Any]:
    """Merge the old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) spellings."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(d.get("rope_theta", 10000.0))}
    for key in ("rope_scaling", "rope_parameters"):
        extra = d.get(key)
        if isinstance(extra, dict):
            rope.update(extra)
    if "type" in rope and rope.get("rope_type", "default") == "default":
        rope["rope_type"] = rope.pop("type")
    if "partial_rotary_factor" in d:
        rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    if hybrid:  # Qwen3.5 / Qwen3-Next rotate a quarter of each head unless the config says otherwise
        rope.setdefault("partial_rotary_factor", 0.25)
    rope.setdefault("max_position_embeddings", d.get("max_position_embeddings", 32768))
    if rope["rope_type"] not in ("default", "llama3", "yarn", "linear"):
        raise TurboSpecError(f"unsupported rope type {rope['rope_type']!r} (default, linear, llama3, yarn)")
    return rope
