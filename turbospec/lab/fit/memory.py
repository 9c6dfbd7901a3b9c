"""Memory accounting: the bytes one sequence of a given context holds, component by component (`estimate`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.lab.fit.arch import Arch
from turbospec.layers.linear import bf16_prefill_gemm
from turbospec.weights import CHUNK_BYTES, PACKED, WeightFormat

# CPU baselines measured on the development box (Python 3.11, torch 2.13, Linux x86-64, 2 cores) with
# `measure_runtime_overhead()`: the resident size after importing turbospec + torch and loading the gemv
# kernel, before a model is loaded (224.6 MiB; the base of the load phase), and the peak RSS of
# `turbospec run` on a minimal model (1 layer, hidden 64, vocab 320: weights + KV + activations < 1 MiB), i.e.
# the runtime once the code paths of a forward have been paged in and torch's thread pools and allocator
# arenas exist (250.2 MiB). Other machines differ: pass --runtime-overhead measure (or a size).
CPU_IMPORT_OVERHEAD = 225 * 2**20
CPU_RUNTIME_OVERHEAD = 250 * 2**20
# `turbospec serve` (the plan for -np > 1) imports the HTTP stack too: the peak RSS of a server of that minimal model
# after a request in each of 2 slots (283.2 MiB; `python benchmarks/fit_serve.py` prints it).
CPU_SERVE_OVERHEAD = 283 * 2**20
# CUDA context + cuBLAS workspace of a llama.cpp-style process: an estimate (unverified; typically
# 0.3-0.6 GiB).
CUDA_RUNTIME_OVERHEAD = 512 * 2**20
QUANT_BLOCK = 1024  # turbospec.kv.quant_cache.DEFAULT_BLOCK: positions decoded per attention block
PAGE = 256  # turbospec.kv.paged.BLOCK: positions per block of the paged pool (serve -np > 1)
ROLLBACK_LIMIT = 16  # HybridCache.rollback_limit: steps up to this many tokens keep every recurrent state
# The model-free drafters' tables, bytes per context token they index (Python dicts of n-gram tuples and their start /
# end positions): the most held after begin() over contexts of 8K-420K tokens that never repeat an n-gram (the worst
# case: a repeated n-gram adds a position to one entry; 230-360 bytes on prose), measured with tracemalloc over sizes
# 1.12x apart (`benchmarks/drafter_costs.py` prints held_mib at given sizes: 438 / 451 bytes at 64K, 442 / 455 at
# 262K). ngram-mod keeps its window's tokens and a fixed pool per sequence.
TABLE_BYTES_PER_TOKEN = {"ngram": 460, "ngram-simple": 460, "suffix": 500, "ngram-mod": 10}
NGRAM_MOD_POOL = 4 << 20  # NgramMod: 2^20 int32 slots
MODEL_FREE = tuple(TABLE_BYTES_PER_TOKEN)  # --spec-type names of the drafters without weights


@dataclass
class Setup:
    """How the model is run: backend, weight dtype / bits per weight, ubatch, speculation depth, baselines."""

    backend: str = "cpu"  # cpu (turbospec engine) | cuda (llama.cpp-style GPU run)
    dtype: str = "float32"  # CPU compute/weight dtype (turbospec run --dtype)
    weights_bpw: float | None = None
    weights: str = "auto"  # cpu: matrices packed at load (turbospec run --weights q8_0 | q4_0 | q4_k)
    ubatch: int = 512
    n_max: int = 3
    runtime_overhead: int | None = None
    import_overhead: int | None = None  # cpu: base of the load phase
    spec_state: str = "per-position"  # GDN rollback: per-position state copies | checkpoint (one copy)
    logits_rows: int | None = None  # None: 1 + n_max on cpu, ubatch on cuda
    parallel: int = 1  # cpu: sequences batched together (serve -np): ctx is the shared KV pool's positions
    ctx_checkpoints: int = 3  # cpu, hybrids: recurrent states kept for prefix reuse (per sequence when parallel)
    moe_cache_mem: int | None = None  # MoE: bytes of routed experts kept in memory (None: all of them)
    drafters: tuple[str, ...] = ()  # model-free drafters of the speculation (--spec-type ngram, ngram-mod, suffix)
    suffix_store: int = 0  # tokens of earlier requests the suffix drafters share (--spec-suffix-shared), 0: none


def cpu_mmap_weights(arch: Arch, setup: Setup) -> bool:
    """True when turbospec's CPU loader keeps the checkpoint mmapped: every tensor is already in --dtype, so
    safetensors hands out tensors backed by the file (no conversion copy); only fused projections are
    copied."""
    return (setup.backend == "cpu" and setup.weights_bpw is None and setup.weights == "auto" and bool(arch.src_dtypes)
            and dtypes.is_dtype_name(setup.dtype)
            and arch.src_dtypes == [dtypes.short_name(setup.dtype).upper()])  # safetensors: F32, F16, BF16


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, k_type: str, v_type: str) -> int:
    """Exact packed bytes per context position (all layers, K + V) for turbospec's KV formats."""
    from turbospec.kv.formats import get_format

    try:
        kb = get_format(k_type).bytes_per_vector(head_dim)
        vb = get_format(v_type).bytes_per_vector(head_dim)
    except ValueError as e:
        raise TurboSpecError(str(e)) from None
    return n_layers * n_kv_heads * (kb + vb)


def packed_bytes(arch: Arch, fmt: WeightFormat, dtype_bytes: int, mtp: bool) -> int:
    """Bytes of the trunk (or MTP block) with its matrices packed in `fmt` where their rows are whole blocks (the
    rest, and every vector, in the model dtype), as `--weights` loads it."""
    mats = arch.matrices(mtp)
    total = arch.mtp_params() if mtp else arch.trunk_params()
    n = (total - sum(r * c * k for r, c, k in mats)) * dtype_bytes
    for r, c, k in mats:
        n += k * (r * (c // fmt.block_values) * fmt.block_bytes if c % fmt.block_values == 0 else r * c * dtype_bytes)
    return n


def weight_bytes(arch: Arch, setup: Setup, mtp: bool) -> tuple[int, int]:
    """(trunk bytes, MTP bytes) as held in memory."""
    if setup.backend == "cpu" and setup.weights_bpw is None:
        db = dtypes.nbytes(setup.dtype)
        if arch.gguf_packed_bytes is not None:
            # a GGUF file: Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K matrices stay packed at their file bytes; the other tensors
            # go to the dtype, or to --weights' format (float matrices only; counted as if all were packable)
            (pt, pm), (ft, fm) = arch.gguf_packed_bytes, arch.gguf_float_params
            per = PACKED[setup.weights].bits_per_value / 8 if setup.weights in PACKED else db
            return int(pt + ft * per), (int(pm + fm * per) if mtp else 0)
        if setup.weights in PACKED:
            fmt = PACKED[setup.weights]
            return packed_bytes(arch, fmt, db, False), (packed_bytes(arch, fmt, db, True) if mtp else 0)
    bpw = setup.weights_bpw
    if bpw is None and setup.backend == "cpu":
        bpw = 8.0 * dtypes.nbytes(setup.dtype)
    if bpw is None:
        bpw = arch.preset_bpw
    counted_trunk, counted_mtp = arch.trunk_params_counted, arch.mtp_params_counted
    trunk_p = counted_trunk if counted_trunk is not None else arch.trunk_params()
    mtp_p = counted_mtp if counted_mtp is not None else arch.mtp_params()
    if bpw is not None and cpu_mmap_weights(arch, setup):
        # the layers' matrices are copied out of the mapped file (whose pages are then dropped); an untied
        # embedding table stays mapped (resident for the rows seen: counted in full, an upper bound)
        trunk = int(trunk_p * bpw / 8)
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


def expert_bytes(arch: Arch, setup: Setup, mtp: bool) -> tuple[int, int]:
    """(trunk, MTP) bytes of the routed experts (all of them), as `weight_bytes` counts them: a GGUF file's as
    stored, packed per `--weights` or in the dtype on the CPU, else by bits per weight."""
    if not arch.n_experts:
        return 0, 0
    n_trunk = arch.moe_layers * arch.n_experts * arch.expert_params()
    n_mtp = arch.mtp_layers * arch.n_experts * arch.expert_params() if mtp and arch.mtp_moe else 0
    if setup.backend == "cpu" and setup.weights_bpw is None:
        if arch.gguf_expert_bytes is not None:
            return arch.gguf_expert_bytes[0], arch.gguf_expert_bytes[1] if n_mtp else 0
        if setup.weights in PACKED:
            fmt = PACKED[setup.weights]
            if arch.hidden % fmt.block_values == 0 and arch.expert_inter % fmt.block_values == 0:
                return int(n_trunk * fmt.bits_per_value / 8), int(n_mtp * fmt.bits_per_value / 8)
        db = dtypes.nbytes(setup.dtype)
        return n_trunk * db, n_mtp * db
    bpw = setup.weights_bpw if setup.weights_bpw is not None else arch.preset_bpw
    if bpw is None:
        return int(n_trunk * arch.src_dtype_bytes), int(n_mtp * arch.src_dtype_bytes)
    return int(n_trunk * bpw / 8), int(n_mtp * bpw / 8)


def recurrent_bytes(arch: Arch, setup: Setup, chain: int) -> tuple[int, int]:
    """(committed conv + SSM state of all GDN layers, per-position rollback copies for a `chain`-token
    step)."""
    if not arch.n_gdn:
        return 0, 0
    conv_b = 4 if setup.backend == "cuda" else dtypes.nbytes(setup.dtype)
    conv = (arch.conv_kernel - 1) * arch.conv_dim * conv_b
    ssm = arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * 4
    state = arch.n_gdn * (conv + ssm)
    if chain <= 1:
        return state, 0
    kept = chain if chain <= ROLLBACK_LIMIT and setup.spec_state == "per-position" else 1
    scratch = arch.n_gdn * (ssm * kept + (arch.conv_kernel - 1 + chain) * arch.conv_dim * conv_b)
    return state, scratch


def activation_bytes(arch: Arch, setup: Setup, ctx: int, rows: int, spec: bool = False) -> int:
    """Live intermediates of one forward over `rows` tokens (the largest layer), plus logits (`spec`: drafts
    verified)."""
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
        setup.ubatch if setup.backend == "cuda" else max(1 + setup.n_max, setup.parallel))
    if setup.logits_rows is None and spec and setup.parallel > 1:  # every sequence's draft is verified each step
        n_logits = setup.parallel * (1 + setup.n_max)
    # logits + sampler probabilities
    logits = n_logits * arch.vocab * 4 * (2 if setup.backend == "cpu" else 1)
    return residual + max(attn, mlp, gdn) + logits


def drafter_table_bytes(setup: Setup, ctx: int) -> int:
    """The model-free drafters' tables for `ctx` context tokens (with several sequences: tokens of all of them, at
    most the pool's positions, and as many again in the drafters kept for a next turn), ngram-mod's pool per
    sequence (and per kept drafter), and the suffix drafters' shared store."""
    unknown = [d for d in setup.drafters if d not in TABLE_BYTES_PER_TOKEN]
    if unknown:
        raise TurboSpecError(f"unknown model-free drafter {unknown[0]!r} ({', '.join(MODEL_FREE)})")
    # with several sequences, finished requests' drafters are kept for their next turn: up to the pool's tokens more
    copies = 2 if setup.parallel > 1 else 1
    n = copies * sum(TABLE_BYTES_PER_TOKEN[d] * ctx for d in setup.drafters)
    n += copies * setup.parallel * NGRAM_MOD_POOL * ("ngram-mod" in setup.drafters)
    if "suffix" in setup.drafters and setup.suffix_store:  # its documents, and their index
        n += setup.suffix_store * (TABLE_BYTES_PER_TOKEN["suffix"] + 8)
    return n


MODES = ("base", "mtp", "draft", "ngram")


@dataclass
class Breakdown:
    """Bytes per component; `steady` is their sum, `total` the larger of it and the load peak."""

    kv_type: str
    mode: str  # "base", "mtp", "draft"
    ctx: int
    weights: int = 0  # (routed experts apart)
    mtp_weights: int = 0
    experts: int = 0  # routed experts held in memory (all, or the --moe-cache-mem budget)
    experts_on_disk: int = 0  # routed experts left in the file, read when routed to (not counted in memory)
    draft_weights: int = 0
    attention_kv: int = 0
    recurrent_state: int = 0
    spec_state_copies: int = 0
    mtp_kv: int = 0
    draft_kv: int = 0
    drafter_tables: int = 0  # the model-free drafters' n-gram tables (and a shared suffix store)
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
        return (self.weights + self.mtp_weights + self.experts + self.draft_weights + self.attention_kv
                + self.recurrent_state + self.spec_state_copies + self.mtp_kv + self.draft_kv + self.drafter_tables
                + self.activations + self.upcast_scratch + self.rope_tables + self.spec_hidden_rows
                + self.draft_head + self.mtp_compute + self.runtime)

    @property
    def total(self) -> int:
        return max(self.steady, self.load_peak)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(steady=self.steady, total=self.total)
        return d


def estimate(arch: Arch, setup: Setup, ctx: int, k_type: str, v_type: str, mode: str = "base",
             draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None) -> Breakdown:
    """Predicted peak bytes for one sequence of `ctx` tokens (with `setup.parallel` > 1: the server's sequences
    together, `ctx` the positions of their shared KV pool). Modes: base; mtp / draft (speculation with the MTP
    layer / a draft model); ngram (speculation by the model-free drafters of `setup.drafters` alone), whose tables
    every speculative mode counts."""
    if ctx < 1:
        raise TurboSpecError("context must be >= 1")
    if mode not in MODES:
        raise TurboSpecError(f"unknown mode {mode!r} ({', '.join(MODES)})")
    dk_type, dv_type = dk_type or k_type, dv_type or v_type
    spec = mode != "base"
    cpu_engine = setup.backend == "cpu"
    par = setup.parallel
    b = Breakdown(kv_type=k_type if k_type == v_type else f"{k_type}/{v_type}", mode=mode, ctx=ctx)
    b.weights, b.mtp_weights = weight_bytes(arch, setup, mode == "mtp")
    te, me = expert_bytes(arch, setup, mode == "mtp")
    b.weights, b.mtp_weights = b.weights - te, b.mtp_weights - me
    b.experts = te + me if setup.moe_cache_mem is None else min(te + me, setup.moe_cache_mem)
    b.experts_on_disk = te + me - b.experts
    cache_len = ctx + (setup.n_max + 1 if spec else 0)  # drafters' caches hold the chain too
    b.attention_kv = ctx * kv_bytes_per_token(arch.n_attn, arch.n_kv_heads, arch.head_dim, k_type, v_type)
    chain = setup.n_max + 1 if spec else 1
    b.recurrent_state, b.spec_state_copies = recurrent_bytes(arch, setup, chain)
    if par == 1 and cpu_engine:
        b.recurrent_state *= 1 + setup.ctx_checkpoints  # states kept before the last prompts' last tokens
    if par > 1:
        if mode == "draft":
            raise TurboSpecError("fit does not plan a draft model with --parallel > 1: serve does not batch "
                                 "draft-model (one copy of its weights per sequence)")
        # one pool of whole blocks shared by every sequence; a state slot per sequence, its snapshots, and while
        # a step runs each sequence's new states next to its committed ones (with drafts: the state after every
        # row of its chain)
        b.attention_kv = -(-ctx // PAGE) * PAGE * kv_bytes_per_token(arch.n_attn, arch.n_kv_heads, arch.head_dim,
                                                                      k_type, v_type)
        b.recurrent_state *= par * (2 + setup.ctx_checkpoints)
        b.spec_state_copies *= par
    if mode == "mtp":
        if not arch.mtp_layers:
            raise TurboSpecError(f"{arch.name} has no MTP module")
        # each sequence's MTP cache holds its own positions (together at most the pool's) and its chain
        b.mtp_kv = (cache_len + (par - 1) * chain) * kv_bytes_per_token(arch.mtp_layers, arch.n_kv_heads,
                                                                        arch.head_dim, dk_type, dv_type)
    if spec:
        b.drafter_tables = drafter_table_bytes(setup, ctx)
    rows = setup.ubatch
    b.activations = activation_bytes(arch, setup, ctx, rows, spec)
    if mode == "draft" and draft is not None:
        b.draft_weights = weight_bytes(draft, setup, False)[0]
        b.draft_kv = cache_len * kv_bytes_per_token(draft.n_attn, draft.n_kv_heads, draft.head_dim, dk_type,
                                                    dv_type)
        b.draft_kv += recurrent_bytes(draft, setup, chain)[0]
    cpu = setup.backend == "cpu"
    gguf = arch.gguf_packed_bytes is not None
    packed_mats = setup.weights in PACKED or (gguf and sum(arch.gguf_packed_bytes or (0,)) > 0)
    float_mats = setup.weights not in PACKED and (not gguf or arch.gguf_float_matrices)
    if cpu and setup.weights_bpw is None and packed_mats:
        # prefill of packed matrices: a ~4 MB float32 tile of weight rows and its bfloat16 copy
        b.upcast_scratch = 6 * 2**20 if rows > 16 else 0
    if cpu and setup.weights_bpw is None and float_mats and dtypes.nbytes(setup.dtype) == 2:
        # Linear's prefill path converts the weight of a layer projection to float32 per call, or where bf16
        # GEMMs run in bf16 (linear.bf16_prefill_gemm) oneDNN reorders a bf16 copy of it (the lm_head only ever
        # sees <= 1 + n_max rows, which take the skinny kernel instead)
        per_value = 2 if dtypes.short_name(setup.dtype) == "bf16" and bf16_prefill_gemm() else 4
        q = arch.n_heads * arch.head_dim * (2 if arch.gated_attn else 1)
        biggest = max(arch.hidden * 2 * arch.intermediate,
                      arch.hidden * (q + 2 * arch.n_kv_heads * arch.head_dim),
                      arch.hidden * (arch.conv_dim + arch.gdn_v_heads * arch.gdn_v_dim))
        b.upcast_scratch = max(b.upcast_scratch, biggest * per_value if rows > 16 else 0)
    if mode == "mtp":
        if cpu:
            # turbospec's MTP drafter reads the trunk's hidden rows of its prompt window (auto: a quarter of
            # the prompt, 64..256 positions; prompt <= ctx) plus the last one; every sequence its own
            window = min(256, max(64, ctx // 4))
            b.spec_hidden_rows = par * min(ctx, window + 1) * arch.hidden * dtypes.nbytes(setup.dtype)
            if dtypes.nbytes(setup.dtype) == 4 and arch.src_dtype_bytes <= 2 and setup.weights_bpw is None:
                # float32 run of a 16-bit checkpoint: the draft head is a bf16 copy of the lm_head (exact),
                # whose reduced vocabulary's rows every sequence reads in place (LinearRows: no copy)
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
        b.rope_tables = 2 * n * rot * dtypes.nbytes(setup.dtype)
        if mode == "draft" and draft is not None:  # the draft model builds its own tables
            b.rope_tables += 2 * n * (int(draft.head_dim * (0.25 if draft.n_gdn else 1.0)) // 2 * 2) * \
                dtypes.nbytes(setup.dtype)
    b.runtime = setup.runtime_overhead if setup.runtime_overhead is not None else (
        CUDA_RUNTIME_OVERHEAD if not cpu else CPU_SERVE_OVERHEAD if par > 1 else CPU_RUNTIME_OVERHEAD)
    if cpu and arch.file_bytes and not cpu_mmap_weights(arch, setup):
        # loading with conversion (or packing): safetensors hands out tensors backed by the mmapped file; the
        # converted (quantized) copy is made in chunks and the file's pages are dropped chunk by chunk
        # (turbospec.weights.consume), so the weights are held once. Transient on top: one layer's converted
        # q/k/v (gate/up) pieces next to their concatenation, and one chunk.
        transient = 2 * arch.fused_layer_max * dtypes.nbytes(setup.dtype) + CHUNK_BYTES
        base = setup.import_overhead if setup.import_overhead is not None else CPU_IMPORT_OVERHEAD
        # (with a --moe-cache-mem budget experts load as they are routed to, not at load time)
        b.load_peak = base + b.weights + b.mtp_weights + (b.experts if setup.moe_cache_mem is None else 0) + transient
        if draft is not None and mode == "draft":
            b.load_peak += b.draft_weights
    return b

