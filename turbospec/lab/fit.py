"""`turbospec fit`: how much context fits a memory budget, per KV type, with and without MTP / a draft model.

The estimate adds up, for one sequence:

* weights: trunk incl. embeddings and lm_head (tied embeddings counted once), the MTP module when it is on,
  a draft model when one is given; read from safetensors headers / GGUF tensor tables without loading data,
  or computed from the architecture numbers of a config.json or a preset;
* attention KV: layers x KV heads x ctx x (K bytes + V bytes per vector of the chosen formats, exact,
  from ``turbospec.kv.formats``); only full-attention layers have KV in hybrid (Gated DeltaNet) models;
* recurrent state of the Gated DeltaNet layers (conv window (kernel-1) x conv_dim + SSM HV x Dk x Dv f32),
  plus the per-position state copies a speculative chain of n_max drafts keeps for rollback;
* the MTP layer's own KV and the draft model's KV, in the draft KV types;
* activation / compute buffers for one ubatch (hidden, QKV, MLP intermediates, attention block scratch,
  logits rows x vocab x 4);
* a runtime baseline (CPU: the resident size of the Python + torch + turbospec process before a model is
  loaded; CUDA: a context estimate).

Backend ``cpu`` models turbospec's own CPU engine: weights held at ``--dtype`` (float32 by default, as
``turbospec run``) and a load phase that transiently holds the mapped checkpoint file next to the converted
weights; the peak is the larger of the load peak and the steady state at the given context. Backend ``cuda``
models a llama.cpp-style GPU run (weights at their file size, compute buffers reserved for a full ubatch of
logits, as llama.cpp reserves its worst-case graph).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from turbospec.errors import TurboSpecError

# CPU baselines measured on the development box (Python 3.11, torch 2.13, Linux x86-64, 2 cores) with
# `measure_runtime_overhead()`: the resident size after importing turbospec + torch and loading the gemv kernel,
# before a model is loaded (224.6 MiB; the base of the load phase), and the peak RSS of `turbospec run` on a
# minimal model (1 layer, hidden 64, vocab 320: weights + KV + activations < 1 MiB), i.e. the runtime once the
# code paths of a forward have been paged in and torch's thread pools and allocator arenas exist (250.2 MiB).
# Other machines differ: pass --runtime-overhead measure (or a size).
CPU_IMPORT_OVERHEAD = 225 * 2**20
CPU_RUNTIME_OVERHEAD = 250 * 2**20
# CUDA context + cuBLAS workspace of a llama.cpp-style process: an estimate (unverified; typically 0.3-0.6 GiB).
CUDA_RUNTIME_OVERHEAD = 512 * 2**20
DEFAULT_KV_TYPES = ("f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3", "turbo2")
# Bits per weight of common weight formats (GGUF averages over a whole file; Q4_K_M mixes Q4_K and Q6_K).
WEIGHT_BPW = {
    "f32": 32.0, "float32": 32.0, "f16": 16.0, "float16": 16.0, "bf16": 16.0, "bfloat16": 16.0,
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q4_k_m": 4.85, "q4_0": 4.5, "q3_k_m": 3.91, "q2_k": 3.35,
}
ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
QUANT_BLOCK = 1024  # turbospec.kv.quant_cache.DEFAULT_BLOCK: positions decoded per attention block
ROLLBACK_LIMIT = 16  # HybridCache.rollback_limit: steps up to this many tokens keep every recurrent state


# ---- model description ---------------------------------------------------------------------------------
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
    fused_params: int = 0  # projections turbospec concatenates (q/k/v, gate/up, GDN in_proj_*): copied on load
    fused_layer_max: int = 0  # the most fused-projection parameters of one layer
    trunk_params_counted: int | None = None  # from a tensor table (None: computed from the config)
    mtp_params_counted: int | None = None
    preset_bpw: float | None = None  # a preset's assumed bits per weight
    notes: list[str] = field(default_factory=list)

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    def attn_layer_params(self) -> int:
        h, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return h * q * (2 if self.gated_attn else 1) + 2 * h * kv + q * h + 2 * self.head_dim + 2 * h

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def gdn_layer_params(self) -> int:
        h, vd = self.hidden, self.gdn_v_heads * self.gdn_v_dim
        proj = h * self.conv_dim + h * vd + 2 * h * self.gdn_v_heads  # qkv, z, b, a
        return proj + self.conv_dim * self.conv_kernel + 2 * self.gdn_v_heads + self.gdn_v_dim + vd * h + 2 * h

    def trunk_params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return (emb + self.hidden + self.n_attn * self.attn_layer_params() + self.n_gdn * self.gdn_layer_params()
                + self.n_layers * self.mlp_params())

    def mtp_params(self) -> int:
        if not self.mtp_layers:
            return 0
        per = self.attn_layer_params() + self.mlp_params()
        return 2 * self.hidden * self.hidden + 3 * self.hidden + self.mtp_layers * per


def arch_from_config(d: dict, name: str = "config") -> Arch:
    """An Arch from a Hugging Face config.json dict (dense Qwen3/Qwen2/Llama or hybrid Qwen3.5/Qwen3-Next)."""
    from turbospec.config import ModelConfig

    cfg = ModelConfig.from_dict(d)
    types = cfg.layer_types()
    n_attn = sum(t == "full_attention" for t in types)
    hybrid = n_attn != len(types) or cfg.arch in ("qwen3_5_text", "qwen3_5", "qwen3_next")
    lin = cfg.linear_dims() if hybrid else {}
    raw = cfg.raw
    mtp = int(raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0)) or 0)
    return Arch(
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
        "_bpw": 4.85, "_unverified": "layer split, head counts, GDN dims, intermediate size and bpw are unverified",
    },
}


_FUSED = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_\w+)\.weight$")
_ST_NAMES = {"float32": "F32", "f32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16", "float16": "F16",
             "f16": "F16", "fp16": "F16"}


def cpu_mmap_weights(arch: Arch, setup: Setup) -> bool:
    """True when turbospec's CPU loader keeps the checkpoint mmapped: every tensor is already in --dtype, so
    safetensors hands out tensors backed by the file (no conversion copy); only fused projections are copied."""
    return (setup.backend == "cpu" and setup.weights_bpw is None and bool(arch.src_dtypes)
            and arch.src_dtypes == [_ST_NAMES.get(setup.dtype.lower(), "?")])


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
            nbytes = numel * ST_DTYPE_BYTES.get(t["dtype"], 2)
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
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        v = f.contents()
    except Exception:  # noqa: BLE001  older gguf packages: decode the last part
        v = f.parts[f.data[0]].tolist() if f.data else default
        v = v[0] if isinstance(v, list) and len(v) == 1 else v
    return v


def arch_from_gguf(path: Path) -> Arch:
    """Metadata + tensor sizes of a GGUF file (gguf.GGUFReader maps the file; no tensor is read)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise TurboSpecError("reading GGUF needs the `gguf` package (pip install gguf)") from None
    try:
        r = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, struct.error, OSError, ...)
        raise TurboSpecError(f"{path.name}: not a readable GGUF file ({' '.join(str(e).split())[:200]})") from None
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
    if interval:
        n_attn = sum(1 for i in range(n_trunk) if (i + 1) % int(interval) == 0)
    else:
        n_attn = n_trunk
    n_gdn = n_trunk - n_attn
    arch = Arch(name=path.name, vocab=vocab, hidden=hidden, intermediate=int(g("feed_forward_length", 0) or 0),
                n_layers=n_trunk, n_heads=n_head, n_kv_heads=n_kv, head_dim=head_dim, n_attn=n_attn,
                n_gdn=n_gdn, gated_attn=bool(n_gdn), mtp_layers=mtp,
                max_pos=int(g("context_length", 32768)), tied=False)
    if n_gdn:
        # llama.cpp ssm keys: d_inner = V heads x V dim, state_size = K dim, group_count = K heads,
        # time_step_rank = V heads
        arch.gdn_k_heads = int(g("ssm.group_count", 16))
        arch.gdn_k_dim = int(g("ssm.state_size", 128))
        arch.gdn_v_heads = int(g("ssm.time_step_rank", 32))
        arch.gdn_v_dim = int(g("ssm.inner_size", arch.gdn_v_heads * 128)) // max(arch.gdn_v_heads, 1)
        arch.conv_kernel = int(g("ssm.conv_kernel", 4))
    trunk = mtp_b = 0
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= n_trunk:
            mtp_b += int(t.n_bytes)
        else:
            trunk += int(t.n_bytes)
        arch.largest_tensor_params = max(arch.largest_tensor_params, int(t.n_elements))
    arch.trunk_bytes, arch.mtp_bytes = trunk, (mtp_b if mtp else 0)
    arch.file_bytes = path.stat().st_size
    return arch


def load_arch(model: str | None = None, config: str | None = None, preset: str | None = None) -> Arch:
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


# ---- the estimate ----------------------------------------------------------------------------------------
@dataclass
class Setup:
    backend: str = "cpu"  # cpu (turbospec engine) | cuda (llama.cpp-style GPU run)
    dtype: str = "float32"  # CPU compute/weight dtype (turbospec run --dtype)
    weights_bpw: float | None = None
    ubatch: int = 512
    n_max: int = 3
    runtime_overhead: int | None = None
    import_overhead: int | None = None  # cpu: base of the load phase
    spec_state: str = "per-position"  # GDN rollback: per-position state copies | checkpoint (one copy)
    logits_rows: int | None = None  # None: 1 + n_max on cpu, ubatch on cuda


def _dtype_bytes(name: str) -> int:
    return {"float32": 4, "f32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2, "fp16": 2}[
        name.lower()]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, k_type: str, v_type: str) -> int:
    """Exact packed bytes per context position (all layers, K + V) for turbospec's KV formats."""
    from turbospec.kv.formats import get_format

    try:
        kb = get_format(k_type).bytes_per_vector(head_dim)
        vb = get_format(v_type).bytes_per_vector(head_dim)
    except ValueError as e:
        raise TurboSpecError(str(e)) from None
    return n_layers * n_kv_heads * (kb + vb)


def weight_bytes(arch: Arch, setup: Setup, mtp: bool) -> tuple[int, int]:
    """(trunk bytes, MTP bytes) as held in memory."""
    bpw = setup.weights_bpw
    if bpw is None and setup.backend == "cpu":
        bpw = 8.0 * _dtype_bytes(setup.dtype)
    if bpw is None:
        bpw = arch.preset_bpw
    counted_trunk, counted_mtp = arch.trunk_params_counted, arch.mtp_params_counted
    trunk_p = counted_trunk if counted_trunk is not None else arch.trunk_params()
    mtp_p = counted_mtp if counted_mtp is not None else arch.mtp_params()
    if bpw is not None and cpu_mmap_weights(arch, setup):
        # the whole file becomes resident as the model runs (an untied embedding table only for the rows
        # seen: counted in full, an upper bound) + anonymous copies of the fused projections
        trunk = int((trunk_p + arch.fused_params) * bpw / 8)
        mtp_b = int(mtp_p * bpw / 8)
    elif bpw is not None:
        trunk = int(trunk_p * bpw / 8)
        mtp_b = int(mtp_p * bpw / 8)
    elif arch.trunk_bytes is not None:
        trunk, mtp_b = arch.trunk_bytes, arch.mtp_bytes or 0
    else:  # cuda, safetensors: the checkpoint's own dtype
        trunk = int(trunk_p * arch.src_dtype_bytes)
        mtp_b = int(mtp_p * arch.src_dtype_bytes)
    return trunk, (mtp_b if mtp else 0)


def recurrent_bytes(arch: Arch, setup: Setup, chain: int) -> tuple[int, int]:
    """(committed conv + SSM state of all GDN layers, per-position rollback copies for a `chain`-token step)."""
    if not arch.n_gdn:
        return 0, 0
    conv_b = 4 if setup.backend == "cuda" else _dtype_bytes(setup.dtype)
    conv = (arch.conv_kernel - 1) * arch.conv_dim * conv_b
    ssm = arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * 4
    state = arch.n_gdn * (conv + ssm)
    if chain <= 1:
        return state, 0
    kept = chain if chain <= ROLLBACK_LIMIT and setup.spec_state == "per-position" else 1
    scratch = arch.n_gdn * (ssm * kept + (arch.conv_kernel - 1 + chain) * arch.conv_dim * conv_b)
    return state, scratch


def activation_bytes(arch: Arch, setup: Setup, ctx: int, rows: int) -> int:
    """Live intermediates of one forward over `rows` tokens (the largest layer), plus logits."""
    f = 4  # turbospec computes attention/GDN math in float32 on CPU; llama.cpp's compute buffers are f32
    h, inter = arch.hidden, arch.intermediate
    q = arch.n_heads * arch.head_dim * (2 if arch.gated_attn else 1)
    kv = arch.n_kv_heads * arch.head_dim
    attn = rows * (q + 2 * kv + 2 * arch.n_heads * arch.head_dim) * f  # qkv out, rotated q/k, attention out
    # scores: one block per chunk (prefill / packed caches), or, for a dense-cache decode step, every cached
    # position at once (scores + probabilities)
    attn += max(arch.n_heads * rows * min(ctx, QUANT_BLOCK) * f, 2 * arch.n_heads * ctx * f)
    mlp = rows * 4 * inter * f  # gate_up output (2I), silu(g), silu(g) * u
    gdn = 0
    if arch.n_gdn:
        gdn = rows * (arch.conv_dim * 2 + 2 * arch.gdn_v_heads * arch.gdn_v_dim) * f
    residual = rows * 3 * h * f  # x, normed x, sublayer output
    n_logits = setup.logits_rows if setup.logits_rows is not None else (
        setup.ubatch if setup.backend == "cuda" else 1 + setup.n_max)
    logits = n_logits * arch.vocab * 4 * (2 if setup.backend == "cpu" else 1)  # logits + sampler probabilities
    return residual + max(attn, mlp, gdn) + logits


@dataclass
class Breakdown:
    kv_type: str
    mode: str  # "base", "mtp", "draft"
    ctx: int
    weights: int = 0
    mtp_weights: int = 0
    draft_weights: int = 0
    attention_kv: int = 0
    recurrent_state: int = 0
    spec_state_copies: int = 0
    mtp_kv: int = 0
    draft_kv: int = 0
    activations: int = 0
    upcast_scratch: int = 0
    rope_tables: int = 0
    spec_hidden_rows: int = 0
    draft_head: int = 0
    mtp_compute: int = 0
    runtime: int = 0
    load_peak: int = 0

    @property
    def steady(self) -> int:
        return (self.weights + self.mtp_weights + self.draft_weights + self.attention_kv + self.recurrent_state
                + self.spec_state_copies + self.mtp_kv + self.draft_kv + self.activations + self.upcast_scratch
                + self.rope_tables + self.spec_hidden_rows + self.draft_head + self.mtp_compute + self.runtime)

    @property
    def total(self) -> int:
        return max(self.steady, self.load_peak)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(steady=self.steady, total=self.total)
        return d


def estimate(arch: Arch, setup: Setup, ctx: int, k_type: str, v_type: str, mode: str = "base",
             draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None) -> Breakdown:
    """Predicted peak bytes for one sequence of `ctx` tokens."""
    if ctx < 1:
        raise TurboSpecError("context must be >= 1")
    dk_type, dv_type = dk_type or k_type, dv_type or v_type
    spec = mode in ("mtp", "draft")
    b = Breakdown(kv_type=k_type if k_type == v_type else f"{k_type}/{v_type}", mode=mode, ctx=ctx)
    b.weights, b.mtp_weights = weight_bytes(arch, setup, mode == "mtp")
    cache_len = ctx + (setup.n_max + 1 if spec else 0)  # drafters' caches hold the chain too
    b.attention_kv = ctx * kv_bytes_per_token(arch.n_attn, arch.n_kv_heads, arch.head_dim, k_type, v_type)
    chain = setup.n_max + 1 if spec else 1
    b.recurrent_state, b.spec_state_copies = recurrent_bytes(arch, setup, chain)
    if mode == "mtp":
        if not arch.mtp_layers:
            raise TurboSpecError(f"{arch.name} has no MTP module")
        b.mtp_kv = cache_len * kv_bytes_per_token(arch.mtp_layers, arch.n_kv_heads, arch.head_dim, dk_type,
                                                  dv_type)
    rows = setup.ubatch
    b.activations = activation_bytes(arch, setup, ctx, rows)
    if mode == "draft" and draft is not None:
        b.draft_weights = weight_bytes(draft, setup, False)[0]
        b.draft_kv = cache_len * kv_bytes_per_token(draft.n_attn, draft.n_kv_heads, draft.head_dim, dk_type,
                                                    dv_type)
        b.draft_kv += recurrent_bytes(draft, setup, chain)[0]
    cpu = setup.backend == "cpu"
    if cpu and setup.weights_bpw is None and _dtype_bytes(setup.dtype) == 2:
        # Linear's prefill path ("upcast") converts the weight of a layer projection to float32 per call (the
        # lm_head only ever sees <= 1 + n_max rows, which take the skinny kernel instead)
        q = arch.n_heads * arch.head_dim * (2 if arch.gated_attn else 1)
        biggest = max(arch.hidden * 2 * arch.intermediate, arch.hidden * (q + 2 * arch.n_kv_heads * arch.head_dim),
                      arch.hidden * (arch.conv_dim + arch.gdn_v_heads * arch.gdn_v_dim))
        b.upcast_scratch = biggest * 4 if rows > 16 else 0
    if mode == "mtp":
        if cpu:
            # turbospec's MTP drafter reads the trunk's hidden rows of its prompt window (auto: a quarter of the
            # prompt, 64..256 positions; prompt <= ctx) plus the last one
            window = min(256, max(64, ctx // 4))
            b.spec_hidden_rows = min(ctx, window + 1) * arch.hidden * _dtype_bytes(setup.dtype)
            if _dtype_bytes(setup.dtype) == 4 and arch.src_dtype_bytes <= 2 and setup.weights_bpw is None:
                # float32 run of a 16-bit checkpoint: the draft head is a bf16 copy of the lm_head (exact), from
                # which the reduced vocabulary's rows are gathered (those ~1-2K rows are not counted)
                b.draft_head = arch.vocab * arch.hidden * 2
        else:
            # llama.cpp: the MTP context inherits n_ubatch and reserves its own graph (one layer + logits)
            one = Setup(backend="cuda", ubatch=setup.ubatch, logits_rows=setup.ubatch)
            b.mtp_compute = activation_bytes(arch, one, ctx, setup.ubatch)
    if cpu:
        # cos/sin tables: built for 8192 positions, doubled when a position beyond them is reached
        rot = int(arch.head_dim * (0.25 if arch.n_gdn else 1.0)) // 2 * 2
        n = 8192
        while n < cache_len:
            n *= 2
        b.rope_tables = 2 * n * rot * _dtype_bytes(setup.dtype)
        if mode == "draft" and draft is not None:  # the draft model builds its own tables
            b.rope_tables += 2 * n * (int(draft.head_dim * (0.25 if draft.n_gdn else 1.0)) // 2 * 2) * \
                _dtype_bytes(setup.dtype)
    b.runtime = setup.runtime_overhead if setup.runtime_overhead is not None else (
        CPU_RUNTIME_OVERHEAD if cpu else CUDA_RUNTIME_OVERHEAD)
    if cpu and arch.file_bytes and not cpu_mmap_weights(arch, setup):
        # loading with conversion: safetensors hands out tensors backed by the mmapped file, `.to(dtype)` makes
        # the converted copy; every page read stays resident until the file is closed after loading, so the
        # peak holds the whole file next to all converted weights. Transient on top: one layer's converted
        # q/k/v (gate/up) pieces while they are concatenated into the fused matrix.
        transient = arch.fused_layer_max * _dtype_bytes(setup.dtype)
        base = setup.import_overhead if setup.import_overhead is not None else CPU_IMPORT_OVERHEAD
        b.load_peak = base + b.weights + b.mtp_weights + arch.file_bytes + transient
        if draft is not None and mode == "draft":
            b.load_peak += b.draft_weights
    return b


def max_context(arch: Arch, setup: Setup, mem: int, k_type: str, v_type: str, mode: str = "base",
                draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None,
                cap: int = 1 << 22, step: int = 256) -> tuple[int, Breakdown | None]:
    """Largest context (a multiple of `step`, <= cap) whose estimate fits `mem`; (0, None) if none does."""
    def fits(c: int) -> Breakdown | None:
        b = estimate(arch, setup, c, k_type, v_type, mode, draft, dk_type, dv_type)
        return b if b.total <= mem else None

    if fits(step) is None:
        return 0, None
    lo, hi = 1, cap // step
    if fits(hi * step) is not None:
        return hi * step, fits(hi * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, fits(lo * step)


# ---- units and formatting -----------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_mem(s: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1.5g', '1000000' -> bytes (K/M/G/T alone are decimal, as GB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise TurboSpecError(f"cannot parse memory size {s!r} (e.g. 24GiB, 24GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def fmt_ctx(n: int) -> str:
    return str(n)


COLUMNS = [("weights", "weights"), ("mtp_weights", "MTP w"), ("draft_weights", "draft w"),
           ("attention_kv", "attn KV"), ("recurrent_state", "GDN state"), ("spec_state_copies", "spec copies"),
           ("mtp_kv", "MTP KV"), ("draft_kv", "draft KV"), ("activations", "activ."),
           ("upcast_scratch", "upcast"), ("rope_tables", "rope"), ("spec_hidden_rows", "MTP rows"), ("draft_head", "draft head"),
           ("mtp_compute", "MTP compute"), ("runtime", "runtime"), ("load_peak", "load peak")]


def render_table(rows: list[dict]) -> str:
    used = [(k, t) for k, t in COLUMNS if any(r["breakdown"] and r["breakdown"][k] for r in rows)]
    head = ["KV", "mode", "max ctx", "total"] + [t for _, t in used]
    if any(r.get("at_ctx") for r in rows):
        head.insert(3, "at -c")
    body = []
    for r in rows:
        b = r["breakdown"]
        line = [r["kv_type"], r["mode"], fmt_ctx(r["max_ctx"]) if r["max_ctx"] else "none"]
        if "at -c" in head:
            a = r.get("at_ctx")
            line.append(f"{'fits' if a['fits'] else 'NO'} ({fmt_bytes(a['total'])})" if a else "")
        line.append(fmt_bytes(b["total"]) if b else "-")
        line += [fmt_bytes(b[k]) if b else "-" for k, _ in used]
        body.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    out = ["  ".join(str(x).rjust(w) for x, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in body]
    return "\n".join(out)


def _types(s: str | None) -> list[str]:
    if not s:
        return []
    return [t.strip() for t in s.split(",") if t.strip()]


def fit_table(arch: Arch, setup: Setup, mem: int, k_types: list[str], v_types: list[str], modes: list[str],
              draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None,
              at_ctx: int | None = None, cap: int = 1 << 22) -> list[dict]:
    if v_types and len(v_types) not in (1, len(k_types)):
        raise TurboSpecError("-ctv must list one type or as many as -ctk")
    rows = []
    for i, kt in enumerate(k_types):
        vt = v_types[i] if len(v_types) > 1 else (v_types[0] if v_types else kt)
        for mode in modes:
            n, b = max_context(arch, setup, mem, kt, vt, mode, draft, dk_type, dv_type, cap=cap)
            row = {"kv_type": kt if kt == vt else f"{kt}/{vt}", "k_type": kt, "v_type": vt, "mode": mode,
                   "max_ctx": n, "breakdown": b.to_dict() if b else None}
            if at_ctx:
                a = estimate(arch, setup, at_ctx, kt, vt, mode, draft, dk_type, dv_type)
                row["at_ctx"] = {"ctx": at_ctx, "fits": a.total <= mem, **a.to_dict()}
            rows.append(row)
    return rows


# ---- measuring the CPU baseline ------------------------------------------------------------------------------
_IMPORT_PROBE = """
import turbospec.cli, turbospec.engine, turbospec.models, turbospec.tokenizer
from turbospec.kernels.gemv import load_kernel
load_kernel()
for line in open('/proc/self/status'):
    if line.startswith('VmRSS:'):
        print(int(line.split()[1]) * 1024)
"""


def measure_peak_rss(model: str | Path, ctx: int, ubatch: int = 512, prompt_file: str | Path | None = None,
                     extra: list[str] | None = None, n_predict: int = 8) -> int:
    """Peak RSS (bytes) of a `turbospec run` subprocess, from its --json-stats peak_rss_bytes."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "stats.json"
        cmd = [sys.executable, "-m", "turbospec.cli", "run", "-m", str(model), "-c", str(ctx), "-ub", str(ubatch),
               "-n", str(n_predict), "--temp", "0", "--no-echo", "--json-stats", str(out)]
        if prompt_file:
            cmd += ["-f", str(prompt_file)]
        # Through a shell that forks (no exec of the last command): a child exec'd straight from this process
        # inherits this process's RSS high-water mark in ru_maxrss (Linux keeps the pre-exec mm's peak in the
        # signal struct), so `turbospec run` spawned from a process holding 400 MiB would report >= 400 MiB.
        r = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh"] + cmd + list(extra or []), check=False,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise TurboSpecError(f"turbospec run failed: {r.stderr.strip()[-500:]}")
        return int(json.loads(out.read_text())["peak_rss_bytes"])


def measure_runtime_overhead() -> tuple[int, int]:
    """(RSS after imports, peak RSS of `turbospec run` on a minimal model) of this machine, in bytes."""
    import subprocess
    import tempfile

    from turbospec.demo import make_demo_model

    r = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], check=False, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise TurboSpecError(f"cannot measure the import baseline: {r.stderr.strip()[-300:]}")
    imported = int(r.stdout.split()[-1])
    with tempfile.TemporaryDirectory() as td:
        m = make_demo_model(Path(td) / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320)
        prompt = Path(td) / "prompt.txt"
        prompt.write_text(("The quick brown fox jumps over the lazy dog. " * 14)[:600])
        peak = measure_peak_rss(m, 1024, prompt_file=prompt)
    return imported, peak


# ---- command line ------------------------------------------------------------------------------------------
def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fit", help="maximum context per KV type for a memory budget (weights, KV, "
                                          "recurrent state, MTP/draft, activations)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help="checkpoint directory (config.json + safetensors) or .gguf file")
    src.add_argument("--config", help="a config.json")
    src.add_argument("--preset", help=f"named architecture: {', '.join(PRESETS)}")
    p.add_argument("--mem", required=True, help="memory budget, e.g. 24GiB, 24GB, 512MiB")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: turbospec's CPU engine (default); cuda: a llama.cpp-style GPU run")
    p.add_argument("--dtype", default="float32", help="CPU weight/compute dtype as `turbospec run` (float32)")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help=f"K cache type(s), comma list (default: {','.join(DEFAULT_KV_TYPES)})")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="V cache type(s) (default: as -ctk)")
    p.add_argument("-ctkd", "--cache-type-k-draft", default=None, help="MTP/draft K cache type (default: as K)")
    p.add_argument("-ctvd", "--cache-type-v-draft", default=None, help="MTP/draft V cache type (default: as V)")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--weights-bpw", type=float, default=None, help="bits per weight, e.g. 4.85 for Q4_K_M")
    w.add_argument("--weight-dtype", default=None, help=f"weight format: {', '.join(WEIGHT_BPW)}")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="ubatch (default 512)")
    p.add_argument("--mtp", dest="mtp", action="store_true", default=None, help="include MTP rows")
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="no MTP rows")
    p.add_argument("-md", "--draft-model", default=None, help="draft model (directory, .gguf or config.json)")
    p.add_argument("--n-max", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="also report whether this context fits")
    p.add_argument("--ctx-max", type=int, default=None, help="search cap (default: 4M tokens)")
    p.add_argument("--logits-rows", type=int, default=None,
                   help="rows of logits held at once (default: 1+n_max on cpu, ubatch on cuda)")
    p.add_argument("--runtime-overhead", default=None,
                   help=f"process baseline: a size, or 'measure' (cpu: runs a minimal model in a subprocess); "
                        f"default cpu {CPU_RUNTIME_OVERHEAD // 2**20} MiB (+ {CPU_IMPORT_OVERHEAD // 2**20} MiB "
                        f"before loading) measured, cuda {CUDA_RUNTIME_OVERHEAD // 2**20} MiB estimate")
    p.add_argument("--spec-state", choices=("per-position", "checkpoint"), default="per-position",
                   help="GDN rollback for speculation: a state copy per chain position (turbospec, default) or "
                        "one checkpoint copy (llama.cpp speculative checkpointing)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def run_cli(args: argparse.Namespace) -> int:
    arch = load_arch(args.model, args.config, args.preset)
    bpw = args.weights_bpw
    if args.weight_dtype:
        key = args.weight_dtype.lower()
        if key not in WEIGHT_BPW:
            raise TurboSpecError(f"unknown --weight-dtype {args.weight_dtype!r} ({', '.join(WEIGHT_BPW)})")
        bpw = WEIGHT_BPW[key]
    if args.ubatch_size < 1 or args.n_max < 0:
        raise TurboSpecError("-ub must be >= 1 and --n-max >= 0")
    try:
        _dtype_bytes(args.dtype)
    except KeyError:
        raise TurboSpecError(f"unknown --dtype {args.dtype!r} (float32, bfloat16, float16)") from None
    runtime = imp = None
    if args.runtime_overhead == "measure":
        if args.backend != "cpu":
            raise TurboSpecError("--runtime-overhead measure works for the cpu backend only")
        imp, runtime = measure_runtime_overhead()
    elif args.runtime_overhead:
        runtime = parse_mem(args.runtime_overhead)
        imp = max(0, runtime - (CPU_RUNTIME_OVERHEAD - CPU_IMPORT_OVERHEAD))
    setup = Setup(backend=args.backend, dtype=args.dtype, weights_bpw=bpw, ubatch=args.ubatch_size,
                  n_max=args.n_max, logits_rows=args.logits_rows, runtime_overhead=runtime,
                  import_overhead=imp, spec_state=args.spec_state)
    mem = parse_mem(args.mem)
    draft = load_arch(args.draft_model) if args.draft_model else None
    modes = ["base"]
    want_mtp = args.mtp if args.mtp is not None else bool(arch.mtp_layers)
    if want_mtp:
        if not arch.mtp_layers:
            raise TurboSpecError(f"{arch.name} has no MTP module (no mtp.* tensors / mtp layers in the config)")
        modes.append("mtp")
    if draft is not None:
        modes.append("draft")
    k_types = _types(args.cache_type_k) or list(DEFAULT_KV_TYPES)
    v_types = _types(args.cache_type_v)
    rows = fit_table(arch, setup, mem, k_types, v_types, modes, draft, args.cache_type_k_draft,
                     args.cache_type_v_draft, args.ctx_size, cap=args.ctx_max or (1 << 22))
    info = {"model": arch.name, "mem_bytes": mem, "backend": setup.backend, "setup": asdict(setup),
            "weights_bpw": bpw if bpw is not None else arch.preset_bpw, "notes": arch.notes,
            "rows": rows}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{arch.name}: budget {fmt_bytes(mem)}, backend {setup.backend}, ubatch {setup.ubatch}, "
          f"n_max {setup.n_max}" + (f", {info['weights_bpw']} bpw weights" if info["weights_bpw"] else ""))
    for n in arch.notes:
        print(f"note: {n}")
    print(render_table(rows))
    sys.stdout.flush()
    return 0
