"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): a softmax router picks the top-k of E
SwiGLU experts per token (weights renormalised when the model says so), plus an optional sigmoid-gated shared
expert.

Experts are fetched through an `ExpertCache`: without a budget every expert is loaded once and stays; with one
(`--moe-cache-mem`), an expert is loaded the first time a token routes to it and the least recently used experts
are dropped when the budget is full. Loading a packed expert from a GGUF file is a view of the file's memory map
(no copy: its pages are mapped in at once). A fault on a file mapping maps the whole page-cache folio (up to
2 MiB), neighbouring experts' bytes included, so such an expert is counted by the folios it lies in, each counted
once however many cached experts share it, and a folio leaves this process when no cached expert uses it: the
budget bounds the memory the experts occupy here. Experts that need converting (float checkpoints, `--weights`)
are converted on load and counted by their bytes.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turbospec.kernels import gpu, triton_moe
from turbospec.kernels.gemv import load_kernel
from turbospec.layers.attention import MLP
from turbospec.layers.linear import Linear, SplitLinear, skinny_rows
from turbospec.weights import file_mapping, format_of, is_packed, release

log = logging.getLogger("turbospec")

# expert index -> (gate [I, H], up [I, H], down [H, I]) as stored: float matrices or packed blocks
ExpertLoader = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def expert_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> MLP:
    """An expert as a SwiGLU `MLP` over its matrices as they are (no concatenation, no huge-page copy: a mapped
    expert stays a view of its file)."""
    return MLP(SplitLinear([Linear(gate, hugepages=False), Linear(up, hugepages=False)]),
               Linear(down, hugepages=False))


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    loaded_bytes: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0


class ExpertCache:
    """The routed experts of every MoE layer of a model under one budget in bytes (None: no budget, every expert
    stays once loaded). Least recently used experts are dropped first; `stats` counts lookups. `used`: the bytes
    the cached experts occupy in this process: their own bytes, or for views of a file mapping the page-cache
    folios they lie in (`FOLIO` bytes each, counted once)."""

    def __init__(self, budget: int | None = None):
        if budget is not None and budget < 0:
            raise ValueError("expert cache budget must be >= 0")
        self.budget = budget
        self.used = 0
        # key -> (expert, bounds of the file mapping it is a view of or None, its folios there, its other bytes)
        self.entries: OrderedDict[tuple[int, int], tuple[MLP, tuple[int, int] | None, tuple[int, ...], int]] = \
            OrderedDict()
        self.folios: Counter[int] = Counter()  # folio start address -> cached experts lying in it
        self.stats = ExpertStats()
        self._checks = 0
        self.grouped: set[int] = set()  # MoE layers (keys) without stacked experts: their path reads the router's
        # choice on the host and makes tensors on the default device

    def low_memory(self) -> bool:
        """While every expert is being loaded (no budget): whether the machine is running out of memory (less than
        max(2 GiB, 10% of RAM) available, checked every 16 experts). If so, the cache keeps what it holds as its
        budget from now on — later experts load when routed to — says so once, and answers True."""
        self._checks += 1
        if self.budget is not None or self._checks % 16:
            return self.budget is not None
        avail, total = _meminfo()
        if avail is None or avail >= max(2 << 30, total // 10):
            return False
        self.budget = self.used
        log.warning("memory is running out while loading the experts: %d MiB of them stay in memory and the rest "
                    "load when tokens route to them (set --moe-cache-mem to choose)", self.used >> 20)
        return True

    def get(self, key: tuple[int, int], load: Callable[[], MLP], mapped: tuple[int, int] | None = None) -> MLP:
        """The expert `key`, loaded by `load` on a miss; `mapped`: the bounds of the file mapping its weights are
        views of (their pages are mapped in at once, and leave this process with the last expert of their folios)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.stats.hits += 1
            self.entries.move_to_end(key)
            return entry[0]
        self.stats.misses += 1
        mlp = load()
        self.stats.loaded_bytes += mlp.nbytes
        folios, own = _footprint(mlp, mapped)
        if self.budget is not None:
            while self.entries and self.used + self._cost(folios, own) > self.budget:
                self._evict()
        self.used += self._cost(folios, own)
        self.folios.update(folios)
        if mapped is not None:  # (every expert at load without a budget, as llama.cpp maps the whole file in)
            _populate(mlp, mapped)
        self.entries[key] = (mlp, mapped, folios, own)
        return mlp

    def _cost(self, folios: tuple[int, ...], own: int) -> int:
        """The bytes an expert adds: its folios no cached expert lies in yet, and its bytes outside the mapping."""
        return own + FOLIO * sum(1 for f in folios if f not in self.folios)

    def _evict(self) -> None:
        _, (_, mapped, folios, own) = self.entries.popitem(last=False)
        self.used -= own
        self.stats.evictions += 1
        k = load_kernel()
        for f in folios:
            self.folios[f] -= 1
            if self.folios[f] == 0:  # no cached expert lies in it: its pages leave this process
                del self.folios[f]
                self.used -= FOLIO
                if k is not None and mapped is not None:
                    k.drop_range(max(f, mapped[0]), min(f + FOLIO, mapped[1]))

    def clear(self) -> None:
        while self.entries:
            self._evict()


class MoE:
    """Router [E, H] + E routed experts (through `cache`, keyed by `layer`) + optional shared expert with its
    sigmoid gate [1, H]. Rows are grouped by expert: each expert used by the step multiplies all its rows at once
    (decode, verification and prefill rows alike)."""

    def __init__(self, router: torch.Tensor, num_experts: int, load: ExpertLoader, top_k: int, norm_topk: bool,
                 shared: MLP | None, shared_gate: torch.Tensor | None, cache: ExpertCache, layer: int):
        self.num_experts, self.load = num_experts, load
        self.router = Linear(router, hugepages=False)  # few rows: the kernel, each row on its own
        self.top_k, self.norm_topk = top_k, norm_topk
        self.shared = shared
        self.shared_gate = Linear(shared_gate, hugepages=False) if shared_gate is not None else None
        self.cache, self.layer = cache, layer
        # expert 0 tells what every expert of the layer is: its bytes, whether its matrices are views of a file
        # mapping (a GGUF file's packed experts: the mapping's bounds), whether the kernel takes them (packed, gate
        # and up in one format: decode / verification rows in one `moe_experts` call)
        one = load(0)
        self.expert_bytes = sum(t.numel() * t.element_size() for t in one)
        self.mapped = file_mapping(one[0])
        self._fused = (load_kernel() is not None and all(is_packed(t) for t in one)
                       and format_of(one[0]) == format_of(one[1]))
        # on a GPU: every expert in two stacked tensors (gate+up rows [E, 2I, ...], down [E, H, ...]) that the Triton
        # kernel reads by the router's choice; `expert(e)` answers views of them
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: list[MLP] = []
        if (gpu.wanted(self.router.weight) and cache.budget is None and format_of(one[0]) == format_of(one[1])
                and one[0].shape == one[1].shape):
            self._stack(one)
            return
        cache.grouped.add(layer)
        for t in one:
            release(t)
        if cache.budget is None:  # no budget: every expert now, as the other weights (while memory lasts)
            for e in range(num_experts):
                if cache.low_memory():
                    break
                self.expert(e)

    def _stack(self, one: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        g, _, d = one
        inter = g.shape[0]
        gu = torch.empty((self.num_experts, 2 * inter, *g.shape[1:]), dtype=g.dtype, device=g.device)
        dn = torch.empty((self.num_experts, *d.shape), dtype=d.dtype, device=d.device)
        for e in range(self.num_experts):
            g, u, d = one if e == 0 else self.load(e)
            gu[e, :inter], gu[e, inter:], dn[e] = g, u, d
        self.stacked = (gu, dn)
        self._views = [expert_mlp(gu[e, :inter], gu[e, inter:], dn[e]) for e in range(self.num_experts)]

    def expert(self, e: int) -> MLP:
        if self.stacked is not None:
            return self._views[e]
        return self.cache.get((self.layer, e), lambda: expert_mlp(*self.load(e)), self.mapped)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, expert indices [N, k]) as transformers' top-k router."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return top.to(x.dtype), idx

    def fused(self) -> bool:
        """Whether this layer's experts go through `moe_experts` (the kernel built, the experts packed with gate
        and up in one format)."""
        return self._fused

    def _fused_call(self, k, x: torch.Tensor, top: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The routed experts (and the shared one, when it has their shapes and formats) in one kernel call: the
        gate and up rows of every expert the step routes to in one parallel pass, then their down rows."""
        mlps = {e: self.expert(e) for e in sorted(set(idx.flatten().tolist()))}  # (looked up once each)
        weights = top.float().tolist()
        gates, ups, downs, rows, ws = [], [], [], [], []
        for r, experts in enumerate(idx.tolist()):
            for e, s in sorted((e, s) for s, e in enumerate(experts)):  # the batched path's order
                g, u = (p.weight for p in mlps[e].gate_up.parts)
                gates.append(g), ups.append(u), downs.append(mlps[e].down.weight)
                rows.append(r), ws.append(weights[r][s])
        shared = self._shared_as_expert(gates[0], downs[0])
        if shared is not None:  # weight sigmoid(shared_gate . x), in x's dtype as the op-by-op path
            sg = torch.sigmoid(self.shared_gate(x)).float()[:, 0].tolist()
            for r in range(x.shape[0]):
                gates.append(shared[0]), ups.append(shared[1]), downs.append(shared[2])
                rows.append(r), ws.append(sg[r])
        out = k.moe_experts(x, gates, ups, downs, rows, ws).to(x.dtype)
        return out if shared is not None else self._add_shared(out, x)

    def _add_shared(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + sigmoid(shared_gate . x) * shared(x) (out itself without a shared expert)."""
        if self.shared is None:
            return out
        return out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)

    def _shared_as_expert(self, gate: torch.Tensor, down: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The shared expert's (gate, up, down) when they have the routed experts' shapes and formats (one more
        pair for the kernel), else None."""
        s = self.shared
        if s is None or not isinstance(s.gate_up, Linear):
            return None
        gu, dn = s.gate_up.weight, s.down.weight
        half = gu.shape[0] // 2
        if gu.shape[1:] != gate.shape[1:] or half != gate.shape[0] or dn.shape != down.shape or \
                format_of(gu) != format_of(gate) or format_of(dn) != format_of(down):
            return None
        return gu[:half], gu[half:], dn

    def _device_call(self, x: torch.Tensor, top: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decode and verification rows on a GPU: every (row, chosen expert) pair in one kernel launch per matrix,
        the experts read by the router's choice on the device; the pairs' outputs weighted and summed per row."""
        n, k = idx.shape
        gu, dn = self.stacked  # (set when this path is taken)
        experts = idx.reshape(-1)
        pairs = torch.arange(n * k, device=x.device)
        h = triton_moe.expert_rows(x, pairs // k, gu, experts)
        g, u = h.split([h.shape[1] // 2] * 2, dim=-1)
        y = triton_moe.expert_rows(F.silu(g) * u, pairs, dn, experts)
        return self._add_shared((y.view(n, k, -1) * top.unsqueeze(-1)).sum(1), x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = self.route(x)
        if x.dim() == 2 and x.shape[0] <= skinny_rows(x.dtype) and self.fused():
            return self._fused_call(load_kernel(), x, top, idx)
        if self.stacked is not None and x.dim() == 2 and x.shape[0] <= DEVICE_ROWS and gpu.enabled("moe"):
            try:
                return self._device_call(x, top, idx)
            except Exception as e:  # noqa: BLE001 -- a Triton that cannot build it: the grouped path below
                gpu.failed("moe", e)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode: no grouping to do
            for e, slot in sorted((e, s) for s, e in enumerate(idx[0].tolist())):  # the batched path's order
                out += self.expert(e)(x) * top[:, slot, None]
        else:
            for e in idx.unique().tolist():
                rows, slot = torch.where(idx == e)
                out.index_add_(0, rows, self.expert(e)(x[rows]) * top[rows, slot, None])
        return self._add_shared(out, x)

    @property
    def nbytes(self) -> int:
        """Bytes of all this layer's weights (every expert, resident or not)."""
        n = self.router.nbytes + self.num_experts * self.expert_bytes
        if self.shared is not None and self.shared_gate is not None:
            n += self.shared.nbytes + self.shared_gate.nbytes
        return n


class RowParallelMoE:
    """A mixture of experts whose experts (and shared expert) hold one part of their intermediate columns (tensor
    parallelism: this process's part): routing is the same on every part, each expert's product is a partial sum,
    and `reduce` sums the layer's output over the parts once (as `RowParallelLinear` does for one matrix)."""

    def __init__(self, inner: MoE, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.inner, self.reduce = inner, reduce

    def __getattr__(self, name: str):  # nbytes, experts, ...
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.inner(x))


DEVICE_ROWS = 64  # rows (tokens) the GPU's pair kernel takes; more (prefill) are grouped by expert
FOLIO = 2 << 20  # the largest page-cache folio a file's pages come in: a fault maps it whole


def _footprint(mlp: MLP, mapped: tuple[int, int] | None) -> tuple[tuple[int, ...], int]:
    """(the start addresses of the `FOLIO`-sized units of the file mapping `mapped` that the expert's matrices lie
    in, counted from the mapping's start; the bytes of its matrices outside the mapping: all of them without one,
    the copied columns of a tensor-parallel rank)."""
    inside = _in_mapping(mlp, mapped)
    folios: set[int] = set()
    for w in inside:
        a, lo = w.data_ptr(), mapped[0]  # (mapped is not None when anything is inside)
        folios.update(lo + i * FOLIO for i in range((a - lo) // FOLIO, (a + _nbytes(w) - 1 - lo) // FOLIO + 1))
    return tuple(sorted(folios)), mlp.nbytes - sum(_nbytes(w) for w in inside)


def _populate(mlp: MLP, mapped: tuple[int, int]) -> None:
    """Map the expert's matrices that lie in the file mapping into this process now (one call each)."""
    k = load_kernel()
    if k is not None:
        for w in _in_mapping(mlp, mapped):
            k.populate_pages(w)


def _in_mapping(mlp: MLP, mapped: tuple[int, int] | None) -> list[torch.Tensor]:
    """The expert's matrices that lie in the file mapping `mapped` (none without one)."""
    ws = [lin.weight for lin in (*mlp.gate_up.parts, mlp.down)]
    return [] if mapped is None else [w for w in ws if mapped[0] <= w.data_ptr() <= mapped[1] - _nbytes(w)]


def _nbytes(w: torch.Tensor) -> int:
    return w.numel() * w.element_size()


def _meminfo() -> tuple[int | None, int]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo; (None, 0) where it cannot be read."""
    vals: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    vals[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, 0
    return vals.get("MemAvailable"), vals.get("MemTotal", 0)
