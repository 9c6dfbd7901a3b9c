"""Model shapes for the memory estimate: `Arch`, read from a config.json, a preset, safetensors headers or a
GGUF tensor table, without loading any tensor data."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.weights import BY_GGUF_TYPE

# bytes per value of the safetensors dtypes that are not float types of turbospec.dtypes (F32, F16, BF16)
_OTHER_ST_BYTES = {"F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                   "F8_E5M2": 1}


def st_dtype_bytes(name: str) -> int:
    """Bytes per value of a safetensors dtype name (F32, BF16, I64, ...; 2 for one not known)."""
    if dtypes.is_dtype_name(name):
        return dtypes.nbytes(name)
    return _OTHER_ST_BYTES.get(name, 2)


@dataclass
class Arch:
    """The numbers the estimate needs. Attention layers: n_attn; Gated DeltaNet layers: n_gdn."""

    name: str
    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_attn: int
    n_gdn: int = 0
    gated_attn: bool = False
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    conv_kernel: int = 4
    tied: bool = False
    mtp_layers: int = 0
    max_pos: int = 32768
    # bytes of the weights as stored (None: compute from params x bpw)
    trunk_bytes: int | None = None
    mtp_bytes: int | None = None
    file_bytes: int = 0  # checkpoint bytes on disk (CPU load transient)
    largest_tensor_params: int = 0
    src_dtype_bytes: float = 2.0
    src_dtypes: list[str] = field(default_factory=list)  # safetensors dtype names of the checkpoint
    # projections turbospec concatenates (q/k/v, gate/up, GDN in_proj_*): copied on load
    fused_params: int = 0
    fused_layer_max: int = 0  # the most fused-projection parameters of one layer
    trunk_params_counted: int | None = None  # from a tensor table (None: computed from the config)
    mtp_params_counted: int | None = None
    preset_bpw: float | None = None  # a preset's assumed bits per weight
    # a GGUF file on the CPU: bytes of the Q8_0 / Q4_0 / Q4_K matrices (kept packed) and parameters of the other
    # tensors (dequantized to --dtype), (trunk, MTP); None for other sources
    gguf_packed_bytes: tuple[int, int] | None = None
    gguf_float_params: tuple[int, int] = (0, 0)
    gguf_float_matrices: bool = False  # some matrix is dequantized (float or an unpacked type)
    # mixture of experts: routed experts per MoE layer, experts per token, their intermediate size, the shared
    # expert's (0: none), trunk layers whose feed-forward is MoE, whether the MTP layer's is
    n_experts: int = 0
    experts_per_tok: int = 0
    expert_inter: int = 0
    shared_inter: int = 0
    moe_layers: int = 0
    mtp_moe: bool = False
    gguf_expert_bytes: tuple[int, int] | None = None  # a GGUF file's routed-expert tensor bytes (trunk, MTP)
    # the longest context turbospec runs exactly (`ModelConfig.exact_limit`: a sliding window, temperature scaling)
    exact_ctx: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    def attn_layer_params(self) -> int:
        h, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return h * q * (2 if self.gated_attn else 1) + 2 * h * kv + q * h + 2 * self.head_dim + 2 * h

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_inter

    def moe_params(self) -> int:
        """One MoE feed-forward: router, every routed expert, the shared expert and its gate."""
        shared = 3 * self.hidden * self.shared_inter + self.hidden if self.shared_inter else 0
        return self.n_experts * (self.hidden + self.expert_params()) + shared

    def ffn_params(self) -> int:
        """The feed-forward parameters of all trunk layers."""
        return (self.n_layers - self.moe_layers) * self.mlp_params() + self.moe_layers * self.moe_params()

    def gdn_layer_params(self) -> int:
        h, vd = self.hidden, self.gdn_v_heads * self.gdn_v_dim
        proj = h * self.conv_dim + h * vd + 2 * h * self.gdn_v_heads  # qkv, z, b, a
        return (proj + self.conv_dim * self.conv_kernel + 2 * self.gdn_v_heads + self.gdn_v_dim + vd * h
                + 2 * h)

    def trunk_params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return (emb + self.hidden + self.n_attn * self.attn_layer_params()
                + self.n_gdn * self.gdn_layer_params() + self.ffn_params())

    def matrices(self, mtp: bool = False) -> list[tuple[int, int, int]]:
        """(rows, columns, how many) of the matrices turbospec multiplies (fused as it fuses them) and the
        embedding, of the trunk or of the MTP block."""
        h, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        vd = self.gdn_v_heads * self.gdn_v_dim
        attn = [(q * (2 if self.gated_attn else 1) + 2 * kv, h), (h, q)]
        mlp = [(2 * self.intermediate, h), (h, self.intermediate)]
        # a MoE layer: each expert's gate, up and down (not fused), the shared expert fused as an MLP
        moe = [(self.expert_inter, h, 2 * self.n_experts), (h, self.expert_inter, self.n_experts)]
        if self.shared_inter:
            moe += [(2 * self.shared_inter, h, 1), (h, self.shared_inter, 1)]
        if mtp:
            if not self.mtp_layers:
                return []
            ffn = [(r, c, k * self.mtp_layers) for r, c, k in moe] if self.mtp_moe else \
                [(r, c, self.mtp_layers) for r, c in mlp]
            return [(h, 2 * h, 1)] + [(r, c, self.mtp_layers) for r, c in attn] + ffn
        gdn = [(self.conv_dim + vd + 2 * self.gdn_v_heads, h), (h, vd)]
        return ([(self.vocab, h, 1 if self.tied else 2)] + [(r, c, self.n_attn) for r, c in attn]
                + [(r, c, self.n_gdn) for r, c in gdn if self.n_gdn]
                + [(r, c, self.n_layers - self.moe_layers) for r, c in mlp if self.n_layers > self.moe_layers]
                + [(r, c, k * self.moe_layers) for r, c, k in moe if self.moe_layers])

    def mtp_params(self) -> int:
        if not self.mtp_layers:
            return 0
        per = self.attn_layer_params() + (self.moe_params() if self.mtp_moe else self.mlp_params())
        return 2 * self.hidden * self.hidden + 3 * self.hidden + self.mtp_layers * per


def arch_from_config(d: dict, name: str = "config") -> Arch:
    """An Arch from a Hugging Face config.json dict (dense Qwen3/Qwen2/Llama or hybrid Qwen3.5/Qwen3-Next)."""
    from turbospec.model.config import HYBRID_ARCHS, ModelConfig

    cfg = ModelConfig.from_dict(d)
    types = cfg.layer_types()
    n_attn = sum(t == "full_attention" for t in types)
    hybrid = n_attn != len(types) or cfg.arch in HYBRID_ARCHS
    lin = cfg.linear_dims() if hybrid else {}
    raw = cfg.raw
    mtp = int(raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0)) or 0)
    moe = cfg.moe() if cfg.moe()["experts"] else {}
    return Arch(
        n_experts=moe.get("experts", 0), experts_per_tok=moe.get("top_k", 0), expert_inter=moe.get("inter", 0),
        shared_inter=moe.get("shared_inter", 0), moe_layers=sum(cfg.moe_layer(i) for i in range(cfg.num_layers)),
        mtp_moe=bool(moe) and cfg.arch in ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"),
        exact_ctx=limit[0] if (limit := cfg.exact_limit()) else None,
        name=name, vocab=cfg.vocab_size, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        n_layers=cfg.num_layers, n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        n_attn=n_attn, n_gdn=len(types) - n_attn, gated_attn=hybrid,
        gdn_k_heads=lin.get("num_k_heads", 0), gdn_v_heads=lin.get("num_v_heads", 0),
        gdn_k_dim=lin.get("k_head_dim", 0), gdn_v_dim=lin.get("v_head_dim", 0),
        conv_kernel=lin.get("conv_kernel", 4), tied=cfg.tie_word_embeddings, mtp_layers=mtp,
        max_pos=cfg.max_position_embeddings,
    )


# Qwen3.6-27B: numbers from shared/reference/speculative-decoding.md section 2 (marked unverified there):
# 64 layers = 16 gated full-attention + 48 Gated DeltaNet (every 4th layer attention), H = 5120,
# 24 Q heads x 256 (q_proj [12288, 5120] incl. the gate), 4 KV heads x 256 (k/v_proj [1024, 5120]),
# vocab 248320, 1 MTP layer. Assumed (not in the reference; Qwen3.5 conventions): GDN 16 K heads / 48 V heads
# x 128 dims, conv kernel 4, intermediate 17408, untied embeddings.
PRESETS: dict[str, dict] = {
    "qwen3.6-27b": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "max_position_embeddings": 262144,
        "_bpw": 4.85,
        "_unverified": "layer split, head counts, GDN dims, intermediate size and bpw are unverified",
    },
}


_FUSED = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_\w+)\.weight$")


def _read_st_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TurboSpecError(f"{path.name}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        try:
            meta = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TurboSpecError(f"{path.name}: corrupt safetensors header ({e})") from None
    meta.pop("__metadata__", None)
    return meta


def arch_from_dir(path: Path) -> Arch:
    """config.json + the tensor table of every *.safetensors file (headers only, no tensor data read)."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise TurboSpecError(f"no config.json in {path}")
    arch = arch_from_config(json.loads(cfg_file.read_text()), path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        arch.notes.append("no safetensors found: weights computed from the config")
        return arch
    trunk = mtp = fused = 0
    biggest, params_total, bytes_total = 0, 0, 0
    dtypes: set[str] = set()
    per_layer: dict[str, int] = {}
    for f in files:
        arch.file_bytes += f.stat().st_size
        for name, t in _read_st_header(f).items():
            numel = math.prod(t["shape"])
            nbytes = numel * st_dtype_bytes(t["dtype"])
            if "visual" in name:
                continue
            params_total += numel
            bytes_total += nbytes
            dtypes.add(t["dtype"])
            if _FUSED.search(name) and not name.startswith("mtp."):
                fused += numel
                lm = re.search(r"layers\.(\d+)\.", name)
                per_layer[lm.group(1) if lm else name] = per_layer.get(lm.group(1) if lm else name, 0) + numel
            biggest = max(biggest, numel)
            if name.startswith("mtp.") or ".mtp." in name:
                mtp += numel
                arch.mtp_moe |= ".mlp.experts." in name
            else:
                trunk += numel
    arch.trunk_params_counted, arch.mtp_params_counted = trunk, mtp
    arch.largest_tensor_params = biggest
    arch.src_dtypes = sorted(dtypes)
    arch.fused_params = fused
    arch.fused_layer_max = max(per_layer.values(), default=0)
    arch.src_dtype_bytes = bytes_total / max(params_total, 1)
    arch.mtp_layers = arch.mtp_layers if mtp else 0
    return arch


def _gguf_field(reader, key: str, default=None):
    return reader.meta.get(key, default)


def arch_from_gguf(path: Path) -> Arch:
    """Metadata + tensor sizes of a GGUF file (the file is mapped; no tensor is read)."""
    from turbospec.model.gguf_reader import GGUFContents

    try:
        r = GGUFContents(path)
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, struct.error, OSError, ...)
        why = " ".join(str(e).split())[:200]
        raise TurboSpecError(f"{path.name}: not a readable GGUF file ({why})") from None
    a = _gguf_field(r, "general.architecture", "llama")

    def g(key, default=None):
        return _gguf_field(r, f"{a}.{key}", default)

    n_layer = int(g("block_count", 0))
    hidden = int(g("embedding_length", 0))
    n_head = g("attention.head_count", 0)
    n_head = int(max(n_head) if isinstance(n_head, list) else n_head)
    n_kv = g("attention.head_count_kv", n_head)
    n_kv = int(max(n_kv) if isinstance(n_kv, list) else n_kv)
    head_dim = int(g("attention.key_length", hidden // max(n_head, 1)))
    tokens = _gguf_field(r, "tokenizer.ggml.tokens")
    vocab = int(g("vocab_size", len(tokens) if tokens is not None else 0))
    mtp = int(g("nextn_predict_layers", 0) or 0)
    interval = g("full_attention_interval")
    n_trunk = n_layer - mtp
    n_attn = sum(1 for i in range(n_trunk) if (i + 1) % int(interval) == 0) if interval else n_trunk
    n_gdn = n_trunk - n_attn
    arch = Arch(name=path.name, vocab=vocab, hidden=hidden,
                intermediate=int(g("feed_forward_length", 0) or 0), n_layers=n_trunk, n_heads=n_head,
                n_kv_heads=n_kv, head_dim=head_dim, n_attn=n_attn,
                n_gdn=n_gdn, gated_attn=bool(n_gdn), mtp_layers=mtp,
                max_pos=int(g("context_length", 32768)), tied=False)
    if a == "phi3" and g("attention.sliding_window"):  # (as `ModelConfig.exact_limit` for the loaded file)
        arch.exact_ctx = int(g("attention.sliding_window"))
    elif g("attention.temperature_scale"):
        arch.exact_ctx = int(g("rope.scaling.original_context_length") or arch.max_pos)
    if n_gdn:
        # llama.cpp ssm keys: d_inner = V heads x V dim, state_size = K dim, group_count = K heads,
        # time_step_rank = V heads
        arch.gdn_k_heads = int(g("ssm.group_count", 16))
        arch.gdn_k_dim = int(g("ssm.state_size", 128))
        arch.gdn_v_heads = int(g("ssm.time_step_rank", 32))
        arch.gdn_v_dim = int(g("ssm.inner_size", arch.gdn_v_heads * 128)) // max(arch.gdn_v_heads, 1)
        arch.conv_kernel = int(g("ssm.conv_kernel", 4))
    arch.n_experts = int(g("expert_count", 0) or 0)
    if arch.n_experts:
        arch.experts_per_tok = int(g("expert_used_count", 1))
        arch.expert_inter = int(g("expert_feed_forward_length", 0))
        arch.shared_inter = int(g("expert_shared_feed_forward_length", 0) or 0)
    trunk = mtp_b = 0
    packed, floats, experts = [0, 0], [0, 0], [0, 0]
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        part = 1 if m and int(m.group(1)) >= n_trunk else 0
        if part:
            mtp_b += int(t.n_bytes)
        else:
            trunk += int(t.n_bytes)
        fmt = BY_GGUF_TYPE.get(t.tensor_type.name)
        if re.search(r"\.ffn_(gate|up|down|gate_up)_exps\.", t.name):  # routed experts: [E, out, in]
            experts[part] += int(t.n_bytes)
            if t.name.endswith(("ffn_gate_exps.weight", "ffn_gate_up_exps.weight")):  # one per MoE layer
                arch.moe_layers += 1 - part
                arch.mtp_moe |= bool(part)
        if len(t.shape) in (2, 3) and fmt is not None:  # stays packed on the CPU
            packed[part] += int(t.n_bytes)
        else:
            floats[part] += int(t.n_elements)
            arch.gguf_float_matrices |= len(t.shape) in (2, 3)
        arch.largest_tensor_params = max(arch.largest_tensor_params, int(t.n_elements))
    arch.trunk_bytes, arch.mtp_bytes = trunk, (mtp_b if mtp else 0)
    arch.gguf_packed_bytes = (packed[0], packed[1] if mtp else 0)
    arch.gguf_float_params = (floats[0], floats[1] if mtp else 0)
    arch.gguf_expert_bytes = (experts[0], experts[1] if mtp else 0) if arch.n_experts else None
    arch.file_bytes = path.stat().st_size
    return arch


def load_arch(model: str | None = None, config: str | None = None, preset: str | None = None) -> Arch:
    """The Arch of a preset name, a config.json, or a model (checkpoint directory, .gguf file or
    config.json)."""
    if preset:
        key = preset.lower()
        if key not in PRESETS:
            raise TurboSpecError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        d = dict(PRESETS[key])
        bpw, note = d.pop("_bpw", None), d.pop("_unverified", None)
        arch = arch_from_config(d, key)
        if bpw:
            arch.preset_bpw = bpw
        if note:
            arch.notes.append(note)
        return arch
    if config:
        p = Path(config)
        try:
            return arch_from_config(json.loads(p.read_text()), p.parent.name or p.name)
        except (OSError, json.JSONDecodeError) as e:
            raise TurboSpecError(f"cannot read config {p}: {e}") from None
    if model:
        p = Path(model)
        if p.is_dir():
            return arch_from_dir(p)
        if p.suffix.lower() == ".gguf" and p.exists():
            return arch_from_gguf(p)
        if p.name == "config.json" and p.exists():
            return load_arch(config=str(p))
        raise TurboSpecError(f"{p}: not a model directory, .gguf file or config.json")
    raise TurboSpecError("give a model (-m DIR|FILE.gguf), --config FILE or --preset NAME")

