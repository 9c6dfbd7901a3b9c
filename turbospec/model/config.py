"""Model configuration read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbospec.errors import TurboSpecError

DENSE_ARCHS = ("qwen3", "qwen2", "llama", "phi3", "qwen3_moe")
HYBRID_ARCHS = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
MOE_ARCHS = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # outer model_type -> its text part
SUPPORTED_ARCHS = DENSE_ARCHS + HYBRID_ARCHS
# ModelConfig field -> its config.json name, for error messages
CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads"}


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

    def __post_init__(self) -> None:
        """Every value the model builders rely on, checked once: a bad config.json is a one-line error here,
        not a traceback (or a huge allocation) later."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            _int(getattr(self, name), CONFIG_NAMES.get(name, name), 1)
        if self.num_heads % self.num_kv_heads:
            raise TurboSpecError(f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        _number(self.rms_norm_eps, "rms_norm_eps", positive=True)
        for tok in (() if self.bos_token_id is None else (self.bos_token_id,)) + tuple(self.eos_token_ids):
            _int(tok, "bos_token_id / eos_token_id", 0)
        _check_rope(self.rope, self.head_dim)
        if self.arch in HYBRID_ARCHS:
            self.layer_types()
            d = self.linear_dims()
            if d["num_v_heads"] % d["num_k_heads"]:
                raise TurboSpecError(f"config.json: linear_num_value_heads ({d['num_v_heads']}) must be a multiple "
                                     f"of linear_num_key_heads ({d['num_k_heads']})")
        if self.arch in MOE_ARCHS:
            _check_moe(self.raw)
        if self.arch == "phi3" and self.raw.get("sliding_window") is not None:
            _int(self.raw["sliding_window"], "sliding_window", 1)

    def exact_limit(self) -> tuple[int, str] | None:
        """(n, why) when the model attends differently from position n on in a way turbospec does not implement
        (so a context of at most n positions is exact), else None: Phi-3's sliding window (every position attends to
        the last n), Ministral 3's attention temperature scaling (queries scaled from its original context on)."""
        if self.arch == "phi3" and self.raw.get("sliding_window"):
            return int(self.raw["sliding_window"]), "a sliding attention window (Phi-3)"
        if self.rope.get("exact_positions"):
            return int(self.rope["exact_positions"]), "attention temperature scaling (Ministral 3)"
        return None

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
            every = _int(self.raw.get("full_attention_interval", 4), "full_attention_interval", 1)
            types = ["linear_attention" if (i + 1) % every else "full_attention"
                     for i in range(self.num_layers)]
        kinds = ("full_attention", "linear_attention")
        if not isinstance(types, list) or len(types) < self.num_layers or any(t not in kinds for t in types):
            raise TurboSpecError(f"config.json: layer_types must list full_attention/linear_attention for each of "
                                 f"{self.num_layers} layers, got {_show(types)}")
        return types[: self.num_layers]

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is a mixture of experts: every layer of Qwen3.5-MoE; Qwen3-MoE and
        Qwen3-Next every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
        r = self.raw
        if self.arch not in MOE_ARCHS or _experts(r) <= 0:
            return False
        if self.arch in ("qwen3_5_moe_text", "qwen3_5_moe"):
            return True
        return i not in (r.get("mlp_only_layers") or []) and (i + 1) % int(r.get("decoder_sparse_step", 1)) == 0

    def moe(self) -> dict[str, Any]:
        """The mixture-of-experts sizes: experts, experts per token, expert and shared-expert intermediate sizes,
        and whether the top-k weights are renormalised (Qwen3-MoE: `norm_topk_prob`, default false as
        transformers; Qwen3.5-MoE always; Qwen3-Next `norm_topk_prob`, default true)."""
        r = self.raw
        norm = True if self.arch in ("qwen3_5_moe_text", "qwen3_5_moe") else \
            bool(r.get("norm_topk_prob", self.arch != "qwen3_moe"))
        return {"experts": _experts(r), "top_k": int(r.get("num_experts_per_tok", 1)),
                "inter": int(r.get("moe_intermediate_size") or 0),
                "shared_inter": int(r.get("shared_expert_intermediate_size") or 0), "norm_topk": norm}

    def linear_dims(self) -> dict[str, int]:
        """Gated DeltaNet sizes: key/value heads, key/value head dims, conv kernel."""
        r = self.raw
        return {
            "num_k_heads": _int(r.get("linear_num_key_heads", 16), "linear_num_key_heads", 1),
            "num_v_heads": _int(r.get("linear_num_value_heads", 32), "linear_num_value_heads", 1),
            "k_head_dim": _int(r.get("linear_key_head_dim", 128), "linear_key_head_dim", 1),
            "v_head_dim": _int(r.get("linear_value_head_dim", 128), "linear_value_head_dim", 1),
            "conv_kernel": _int(r.get("linear_conv_kernel_dim", 4), "linear_conv_kernel_dim", 1),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise TurboSpecError(f"config.json must hold a JSON object, got {type(d).__name__}")
        arch = d.get("model_type")
        if isinstance(arch, str) and arch in MULTIMODAL and "text_config" in d:
            if not isinstance(d["text_config"], dict):
                raise TurboSpecError("config.json: text_config must be a JSON object")
            inner = dict(d["text_config"])
            inner.setdefault("model_type", MULTIMODAL[arch])
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):  # outer values govern
                if d.get(key) is not None:
                    inner[key] = d[key]
            return cls.from_dict({**inner, "_outer_model_type": arch})
        if arch not in SUPPORTED_ARCHS:
            raise TurboSpecError(
                f"unknown architecture {_show(arch)} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        try:
            hidden = _int(d["hidden_size"], "hidden_size", 1)
            heads = _int(d["num_attention_heads"], "num_attention_heads", 1)
            head_dim = d.get("head_dim")
            if head_dim is None:
                if hidden % heads:
                    raise TurboSpecError(f"config.json: hidden_size ({hidden}) is not a multiple of "
                                         f"num_attention_heads ({heads}) and no head_dim is given")
                head_dim = hidden // heads
            kv_heads = d.get("num_key_value_heads")
            attention_bias = _bool(d.get("attention_bias", False), "attention_bias")
            act = d.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise TurboSpecError(f"unsupported activation {_show(act)} (only silu)")
            cfg = cls(
                arch=arch,
                vocab_size=_int(d["vocab_size"], "vocab_size", 1),
                hidden_size=hidden,
                intermediate_size=_int(d["intermediate_size"] if "intermediate_size" in d or arch not in MOE_ARCHS
                                       else _dense_width(d), "intermediate_size", 1),
                num_layers=_int(d["num_hidden_layers"], "num_hidden_layers", 1),
                num_heads=heads,
                num_kv_heads=heads if kv_heads is None else _int(kv_heads, "num_key_value_heads", 1),
                head_dim=_int(head_dim, "head_dim", 1),
                rms_norm_eps=_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", positive=True),
                rope=_rope_params(d, hybrid=arch in HYBRID_ARCHS),
                max_position_embeddings=_int(d.get("max_position_embeddings", 32768), "max_position_embeddings", 1),
                tie_word_embeddings=_bool(d.get("tie_word_embeddings", False), "tie_word_embeddings"),
                attention_bias=arch == "qwen2" or attention_bias,
                o_bias=arch in ("llama", "qwen3", "qwen3_moe") + HYBRID_ARCHS and attention_bias,
                mlp_bias=_bool(d.get("mlp_bias", False), "mlp_bias"),
                qk_norm=arch in ("qwen3", "qwen3_moe") + HYBRID_ARCHS,
                hidden_act=act,
                bos_token_id=None if d.get("bos_token_id") is None else _int(d["bos_token_id"], "bos_token_id", 0),
                eos_token_ids=_as_tuple(d.get("eos_token_id")),
                raw=d,
            )
        except KeyError as e:
            raise TurboSpecError(f"config.json is missing required field {e.args[0]!r}") from None
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TurboSpecError(f"no config.json at {path}") from None
        except ValueError as e:  # bad JSON, bad UTF-8, an integer too long to convert
            raise TurboSpecError(f"{path} is not valid JSON: {e}") from None
        except (OSError, RecursionError) as e:
            raise TurboSpecError(f"{path}: cannot read it ({type(e).__name__})") from None
        return cls.from_dict(d)


def _show(v: Any) -> str:
    """A config value for an error message, cut short."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _int(v: Any, name: str, lo: int) -> int:
    """A JSON integer >= lo (an integral float such as 4096.0 too), else a one-line error naming the field."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise TurboSpecError(f"config.json: {name} must be an integer >= {lo}, got {_show(v)}")
    return v


def _number(v: Any, name: str, positive: bool = False) -> float:
    """A finite JSON number (> 0 if `positive`), else a one-line error naming the field."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise TurboSpecError(f"config.json: {name} must be a finite{' positive' if positive else ''} number, "
                             f"got {_show(v)}")
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise TurboSpecError(f"config.json: {name} must be true or false, got {_show(v)}")
    return v


def _as_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(_int(x, "eos_token_id", 0) for x in v)
    return (_int(v, "eos_token_id", 0),)


def _check_rope(rope: dict[str, Any], head_dim: int) -> None:
    """The rope settings `layers.rope` reads: a positive theta, a partial rotary factor in (0, 1] that rotates
    an even number of dims, and each scaling type's own factors."""
    _number(rope.get("rope_theta", 10000.0), "rope_theta", positive=True)
    frac = _number(rope.get("partial_rotary_factor", 1.0), "partial_rotary_factor", positive=True)
    dim = int(head_dim * frac)
    if frac > 1 or dim < 2 or dim % 2:
        raise TurboSpecError(f"config.json: partial_rotary_factor {frac} with head_dim {head_dim} rotates {dim} "
                             f"dims; it must be in (0, 1] and rotate an even number of dims")
    kind = rope.get("rope_type", "default")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(kind, ())
    for key in need:
        if key not in rope:
            raise TurboSpecError(f"config.json: rope type {kind!r} needs {key!r}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "max_position_embeddings"):
        if rope.get(key) is not None:
            _number(rope[key], f"rope {key}", positive=True)
    if kind == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
        raise TurboSpecError("config.json: rope high_freq_factor must be greater than low_freq_factor")
    for key in ("freq_factors", "short_factor", "long_factor"):  # (freq_factors: a GGUF file's rope_freqs tensor)
        factors = rope.get(key)
        if factors is not None and (not isinstance(factors, list) or len(factors) != dim // 2):
            raise TurboSpecError(f"rope {key} must be a list of {dim // 2} numbers (one per rotated pair)")
        for f in factors or []:
            _number(f, f"rope {key} entry", positive=True)


def _dense_width(d: dict[str, Any]) -> Any:
    """A MoE config without `intermediate_size` (Qwen3.5-MoE's has none: every layer is MoE): the width of a plain
    MLP layer, should one appear, taken as the shared expert's (else one expert's)."""
    return d.get("shared_expert_intermediate_size") or d.get("moe_intermediate_size")


def _experts(r: dict[str, Any]) -> Any:
    """`num_experts` (released Qwen checkpoints) or `num_local_experts` (transformers 5's Qwen3-MoE config)."""
    return r.get("num_experts") or r.get("num_local_experts") or 0


def _check_moe(r: dict[str, Any]) -> None:
    """The mixture-of-experts fields (read by `decoder.load_moe` when num_experts > 0)."""
    experts = _int(_experts(r), "num_experts", 0)
    if not experts:
        return
    _int(r.get("moe_intermediate_size"), "moe_intermediate_size", 1)
    top = _int(r.get("num_experts_per_tok", 1), "num_experts_per_tok", 1)
    if top > experts:
        raise TurboSpecError(f"config.json: num_experts_per_tok ({top}) exceeds num_experts ({experts})")
    _int(r.get("decoder_sparse_step", 1), "decoder_sparse_step", 1)
    _int(r.get("shared_expert_intermediate_size") or 0, "shared_expert_intermediate_size", 0)
    only = r.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise TurboSpecError(f"config.json: mlp_only_layers must be a list of layer indices, got {_show(only)}")
    for i in only:
        _int(i, "mlp_only_layers entry", 0)


def _rope_params(d: dict[str, Any], hybrid: bool = False) -> dict[str, Any]:
    """Merge the old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) spellings."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _number(d.get("rope_theta", 10000.0), "rope_theta")}
    for key in ("rope_scaling", "rope_parameters"):
        extra = d.get(key)
        if isinstance(extra, dict):
            rope.update(extra)
    if "type" in rope and rope.get("rope_type", "default") == "default":
        rope["rope_type"] = rope.pop("type")
    if rope["rope_type"] == "su":  # (Phi-3's first name for LongRoPE)
        rope["rope_type"] = "longrope"
    if rope["rope_type"] == "longrope":  # (Phi-3 keeps the pretrained context beside the config's rope settings)
        rope.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if "partial_rotary_factor" in d:
        rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    if hybrid:  # Qwen3.5 / Qwen3-Next rotate a quarter of each head unless the config says otherwise
        rope.setdefault("partial_rotary_factor", 0.25)
    rope.setdefault("max_position_embeddings", d.get("max_position_embeddings", 32768))
    if not isinstance(rope["rope_type"], str) or rope["rope_type"] not in ("default", "llama3", "yarn", "linear",
                                                                             "longrope"):
        raise TurboSpecError(f"unsupported rope type {_show(rope['rope_type'])} (default, linear, llama3, yarn, "
                             "longrope)")
    return rope
