"""The engine's configuration: one frozen object, validated in one place.

`EngineConfig` says which checkpoint to load and how to run it (dtype, threads, context, batch sizes, KV
formats); its nested `SpecConfig` says how to speculate. The command line and the server build these and hand
them to `turbospec.build_engine`; the lab and the benchmarks take them too (with an already loaded model where
they compare several engines on one); none of them re-derives a setting.
Names of KV formats and dtypes are normalised here (float16 -> f16), so every later reader sees one spelling.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.kv.formats import get_format
from turbospec.weights import WEIGHT_CHOICES

SPEC_TYPES = ("draft-mtp", "medusa", "ngram", "ngram-simple", "ngram-mod", "suffix", "draft-model")


def kv_type(name: str | None) -> str | None:
    """A KV format name in its canonical spelling (dtype spellings float16/bfloat16/float32 accepted);
    None stays None (the model's own float type); a one-line error for an unknown format."""
    if not name:
        return None
    if dtypes.is_dtype_name(name):
        return dtypes.short_name(name)
    try:
        return get_format(name).name
    except ValueError as e:
        raise TurboSpecError(str(e)) from None


# Medusa trees (--spec-tree): rank paths, one per node; [0, 1] = the best token of head 1, then head 2's second
DEFAULT_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def parse_tree(spec: str | list | None) -> list[tuple[int, ...]]:
    """Paths from a JSON list of rank lists ('[[0],[1],[0,0]]'), 'topk:k1,k2,...' (the full product tree:
    k1 candidates at depth 1, each with k2 children, ...), a Python list, or None (the default tree)."""
    raw: list
    if spec is None or spec == "" or spec == "default":
        raw = DEFAULT_TREE
    elif isinstance(spec, str) and spec.strip().startswith("topk:"):
        try:
            ks = [int(k) for k in spec.strip()[5:].split(",") if k.strip()]
        except ValueError:
            raise TurboSpecError(f"--spec-tree {spec!r}: expected topk:k1,k2,... with integers") from None
        if not ks or any(k < 1 for k in ks):
            raise TurboSpecError(f"--spec-tree {spec!r}: every k must be >= 1")
        raw = []
        level: list[tuple[int, ...]] = [()]
        for k in ks:
            level = [p + (r,) for p in level for r in range(k)]
            raw += [list(p) for p in level]
    elif isinstance(spec, str):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise TurboSpecError(f"--spec-tree: not JSON and not topk:... ({e})") from None
    else:
        raw = spec
    if not isinstance(raw, list) or not raw:
        raise TurboSpecError("--spec-tree: expected a non-empty list of paths such as [[0],[1],[0,0]]")
    paths: set[tuple[int, ...]] = set()
    for p in raw:
        if not isinstance(p, list | tuple) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
            raise TurboSpecError(f"--spec-tree: bad path {p!r} (a non-empty list of ranks >= 0)")
        for n in range(1, len(p) + 1):  # prefix-closed
            paths.add(tuple(p[:n]))
    return sorted(paths, key=lambda p: (len(p), p))


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass field in __post_init__


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which drafters (in llama.cpp's `--spec-type` names) and how they draft."""

    types: tuple[str, ...] = ()
    n_max: int = 3  # most draft tokens one step verifies (tree depth)
    p_min: float = 0.0  # model drafters stop below this draft probability
    draft_model: str | None = None  # checkpoint of the draft-model drafter (-md)
    ngram_n_min: int = 2
    ngram_n_max: int = 4
    ngram_mod_n_match: int = 8
    ngram_mod_n_max: int = 16
    ngram_mod_shared: bool = False  # keep the ngram-mod pool across requests (llama.cpp does; leaks between clients)
    suffix_n_max: int = 24  # suffix drafter: most draft tokens (nodes) per step
    suffix_factor: float = 1.0  # suffix drafter: draft at most this many tokens per token of the match
    suffix_p_min: float = 0.1  # suffix drafter: a tree node needs this share of the matches' continuations
    suffix_shared: bool = False  # suffix drafter: also draft from earlier requests of the server (leaks between clients)
    suffix_store_tokens: int = 1 << 18  # suffix drafter: tokens of earlier requests kept when shared
    merge: bool = False  # a chain's drafters all draft each step, verified together as one tree (default: the first)
    # the MTP reads only the last N prompt positions, so prefill with MTP on stays close to MTP off
    # (benchmarks/spec_prefill.py); -1 auto (a quarter of the prompt, 64..256), 0 all
    mtp_prompt_window: int = -1
    # MTP drafts over the N most frequent tokens (draft_vocab.json) plus the request's own; 0 = full vocabulary,
    # -1 = auto (1024 when the model ships a ranking, else full)
    draft_vocab: int = -1
    mtp_topk: int = 1  # MTP tree: top-k candidates per depth, the best continued; 1 = a chain
    # at temperature > 0 the MTP draws its drafts from its own distribution (passed as q, accepted with min(1, p/q));
    # False: argmax drafts (top-k for trees), accepted when the target's draw matches
    draft_sample: bool = True
    draft_k_type: str | None = None  # KV formats of the draft/MTP caches (-ctkd / -ctvd); None: the model dtype
    draft_v_type: str | None = None
    medusa: str | None = None  # Medusa heads directory (or file); None: beside the model
    tree: str | None = None  # Medusa tree: JSON list of rank paths or "topk:k1,k2,..."; None: the default tree
    # each step drafts the length that maximises expected tokens per second (0: none), from a cost model measured at
    # start-up and the running acceptance (turbospec.speculative.adaptive); False (default): always up to n_max.
    # Off by default: on the bundled model it keeps 85-95% of always-n_max's speed-up (docs/speculative.md)
    adaptive: bool = False

    def __post_init__(self) -> None:
        types = self.types
        if isinstance(types, str):
            types = tuple(t.strip() for t in types.split(","))
        types = tuple(t for t in types if t and t != "none")
        for t in types:
            if t not in SPEC_TYPES:
                raise TurboSpecError(f"unknown --spec-type {t!r} (choose from {', '.join(SPEC_TYPES)})")
        _set(self, "types", types)
        if self.n_max < 1:
            raise TurboSpecError("--spec-draft-n-max must be >= 1")
        if self.mtp_topk < 1:
            raise TurboSpecError("--spec-mtp-topk must be >= 1")
        if self.suffix_n_max < 1 or self.suffix_factor <= 0 or self.suffix_store_tokens < 1:
            raise TurboSpecError("--spec-suffix-n-max, --spec-suffix-factor and --spec-suffix-store must be > 0")
        if not 0.0 <= self.suffix_p_min <= 1.0:
            raise TurboSpecError("--spec-suffix-p-min must be in [0, 1]")
        if not 0.0 <= self.p_min <= 1.0:
            raise TurboSpecError("--spec-draft-p-min must be in [0, 1]")
        if "draft-model" in types and not self.draft_model:
            raise TurboSpecError("--spec-type draft-model needs -md/--spec-draft-model PATH")
        _set(self, "draft_k_type", kv_type(self.draft_k_type))
        _set(self, "draft_v_type", kv_type(self.draft_v_type))
        if self.tree:
            parse_tree(self.tree)  # fail early on a malformed tree

    @classmethod
    def parse(cls, spec_type: str | None, **kw) -> SpecConfig:
        """From a comma list such as `ngram-mod,draft-mtp` (None or 'none': speculation off)."""
        return cls(types=tuple((spec_type or "").split(",")), **kw)

    @property
    def enabled(self) -> bool:
        return bool(self.types)

    def cap(self, spec_type: str) -> int:
        """The deepest draft one drafter proposes: --spec-draft-n-max, except the n-gram-pool drafters' own limits."""
        return {"ngram-mod": self.ngram_mod_n_max, "suffix": self.suffix_n_max}.get(spec_type, self.n_max)

    @property
    def depth(self) -> int:
        """The deepest draft of any configured drafter: the most draft rows one step verifies."""
        return max((self.cap(t) for t in self.types), default=self.n_max)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `build_engine` needs. `model` None means the bundled model (or TURBOSPEC_MODEL)."""

    model: str | None = None
    dtype: str = "float32"  # weights and compute: float32, bfloat16, float16
    weights: str = "auto"  # matrices: as stored (float ones in `dtype`), or packed at load: q8_0, q4_0, q4_k
    threads: int | None = None  # CPU threads; None: torch's default (all cores)
    device: str = "auto"  # cpu, cuda, cuda:N; auto: cuda when torch sees a GPU (turbospec.device)
    ctx: int = 4096  # context size in tokens (prompt + output)
    batch: int = 2048  # logical batch (-b)
    ubatch: int = 512  # prefill chunk (-ub), at most `batch`
    cache_type_k: str | None = None  # KV formats (-ctk/-ctv): f16, q8_0, tbq4_0, turbo3, ...; None: the dtype
    cache_type_v: str | None = None
    prefix_cache: bool = True  # reuse the KV of a prompt's common prefix with the previous request
    # continuous batching (serve -np N > 1): memory of the paged KV pool in MiB (None: room for `ctx` positions), and
    # hybrid models' recurrent-state snapshots kept for the prefix cache, per parallel sequence
    cache_mem: int | None = None
    ctx_checkpoints: int = 3
    # mixture-of-experts models: MiB of routed experts kept in memory, loaded when first routed to, least recently
    # used dropped first (None: every expert loaded at start)
    moe_cache_mem: int | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.ctx <= 0 or self.ubatch <= 0 or self.batch <= 0:
            raise TurboSpecError("context, batch and ubatch sizes must be positive")
        if self.cache_mem is not None and self.cache_mem <= 0:
            raise TurboSpecError("--cache-mem must be a positive number of MiB")
        if self.moe_cache_mem is not None and self.moe_cache_mem < 0:
            raise TurboSpecError("--moe-cache-mem must be >= 0 MiB")
        if self.ctx_checkpoints < 0:
            raise TurboSpecError("--ctx-checkpoints must be >= 0")
        if self.threads is not None and self.threads <= 0:
            raise TurboSpecError("--threads must be positive")
        _set(self, "dtype", dtypes.long_name(self.dtype))
        _set(self, "device", str(self.device).strip().lower())
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise TurboSpecError(f"--device {self.device!r}: expected cpu, cuda, cuda:N or auto")
        _set(self, "weights", str(self.weights).lower())
        if self.weights not in WEIGHT_CHOICES:
            raise TurboSpecError(f"--weights {self.weights!r}: expected one of {', '.join(WEIGHT_CHOICES)}")
        _set(self, "ubatch", min(self.ubatch, self.batch))
        _set(self, "cache_type_k", kv_type(self.cache_type_k))
        _set(self, "cache_type_v", kv_type(self.cache_type_v))
        if not isinstance(self.spec, SpecConfig):
            raise TurboSpecError("EngineConfig.spec must be a SpecConfig")

    def replace(self, **changes) -> EngineConfig:
        """A copy with some fields changed (validated again); `spec_*` keys change the nested SpecConfig."""
        spec = {k[5:]: changes.pop(k) for k in list(changes) if k.startswith("spec_")}
        if spec:
            changes["spec"] = replace(changes.get("spec", self.spec), **spec)
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain values, for reports."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec"}
        out["spec"] = {f.name: getattr(self.spec, f.name) for f in fields(self.spec)}
        out["spec"]["types"] = list(self.spec.types)
        return out
