"""Linear layers: torch's GEMM for prefill, an AVX2 skinny-GEMM kernel for decode and verification steps.

On CPUs, torch's batch-1 matrix-vector products stream weights far below memory bandwidth (see docs/speed.md);
the kernel in turbospec/kernels/gemv.cpp reads each weight once per step for up to `SKINNY_MAX_ROWS` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F

from turbospec import env
from turbospec.errors import TurboSpecError
from turbospec.kernels import packed
from turbospec.kernels.gemv import load_kernel
from turbospec.weights import (
    format_of,
    ggml_blocks,
    in_features,
    interleave,
    is_packed,
    out_features,
    release,
)

# env.HUGEPAGES: decode streams every matrix once per step; from 2 MB pages the products ran up to 1.2-1.4x faster
# than from 4 KB pages (TLB misses; docs/speed.md). TURBOSPEC_NO_HUGEPAGES=1 keeps weights where the loader put
# them (e.g. the mmapped checkpoint).
# env.PREFILL_MODE: prefill GEMMs. "auto": bf16 weights in torch's bf16 GEMM (oneDNN) where the CPU has AVX-512
# BF16 or AMX, everything else in float32 (16-bit weights converted per call); "upcast": always float32; "native":
# always the weight dtype. float32 GEMMs go through oneDNN where torch has it (on AMD CPUs MKL's sgemm keeps to
# AVX2: 2.3x slower at the benchmark shape); docs/speed.md.


# Packed matrices multiply up to this many rows with the int8 kernel, whose per-row results do not depend on the
# batch: verification steps (trees of up to 64 nodes) then give each node exactly the logits a single-token step
# would, so greedy speculation over packed weights stays token-for-token plain decoding. More rows (prefill
# chunks) take dequantized tiles, but for the formats of `weights.INT8_ANY_ROWS` with 16-bit activations, whose
# int8 kernel is the faster one at any row count.
PACKED_ROW_LIMIT = 64
# bf16 rows over bf16 weights, on CPUs with AVX-512 BF16 dot products (kernels/bf16dot.cpp), stay memory-bound to
# dozens of rows: the skinny kernel and the fused layers take up to this many (continuous batching's decode rows).
BF16_DOT_ROWS = 64


def skinny_rows(dtype: torch.dtype) -> int:
    """Most rows of activations in `dtype` that the skinny kernel (and the fused decoder layers) take per call."""
    if dtype == torch.bfloat16 and _bf16_dot():
        return max(env.SKINNY_MAX_ROWS, BF16_DOT_ROWS)
    return env.SKINNY_MAX_ROWS


@cache
def _prefill_mode() -> str:
    if env.PREFILL_MODE not in ("auto", "native", "upcast"):
        raise TurboSpecError(f"TURBOSPEC_PREFILL must be auto, upcast or native, not {env.PREFILL_MODE!r}")
    return env.PREFILL_MODE


@cache
def bf16_prefill_gemm() -> bool:
    """Whether bf16 prefill GEMMs run in bf16 (TURBOSPEC_PREFILL, and for "auto" the CPU)."""
    if _prefill_mode() in ("native", "upcast"):
        return _prefill_mode() == "native"
    return _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported")


def _cpu_has(check: str) -> bool:
    """torch.cpu's (private) feature check `check`, False where this torch lacks it."""
    f = getattr(torch.cpu, check, None)
    return bool(f()) if f is not None else False


@cache
def _onednn_f32() -> bool:
    """Whether float32 prefill GEMMs go through oneDNN (`torch.ops.mkldnn._linear_pointwise`): torch has it and
    a first product through it equals F.linear's within float rounding."""
    if not torch.backends.mkldnn.is_available() or _prefill_mode() == "native":
        return False
    try:
        x, w = torch.ones(2, 8), torch.ones(3, 8)
        return bool(torch.allclose(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (RuntimeError, AttributeError):
        return False


def prefill_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for many rows (prefill) of float weights, in x's dtype: bf16 weights in bf16 where
    `bf16_prefill_gemm`, else in float32 (oneDNN's GEMM where torch has it)."""
    if x.is_cuda or (w.dtype == torch.bfloat16 and bf16_prefill_gemm() and x.dtype == torch.bfloat16):
        return F.linear(x, w, b)  # a GPU's GEMMs run in the weights' own dtype
    if _prefill_mode() == "native" and w.dtype == x.dtype:
        return F.linear(x, w, b)
    xf, wf, bf = x.float(), w.float(), b.float() if b is not None else None
    if _onednn_f32() and w.device.type == "cpu":
        y = torch.ops.mkldnn._linear_pointwise(xf, wf, bf, "none", [], "")
    else:
        y = F.linear(xf, wf, bf)
    return y.to(x.dtype)


@cache
def _bf16_dot() -> bool:
    k = load_kernel()
    return k is not None and k.bf16_dot()


@contextmanager
def batch_products():
    """Within: bf16 products of 2 or more rows use AVX-512 BF16 dot products (about twice the AVX2 path's speed
    from 2 rows on). For forwards over rows of many sequences (continuous batching), where only the rows of one call
    must agree; one sequence's decode and verification keep the default (dot products from 17 rows), so that
    its 1 and k+1 rows share their arithmetic."""
    k = load_kernel() if _bf16_dot() else None
    old = k.set_bf16_dot_rows(2) if k is not None else None
    try:
        yield
    finally:
        if k is not None:
            k.set_bf16_dot_rows(old)


class Linear:
    """y = x W^T + b. Several HF projections can be fused into one (rows concatenated). W is a float matrix or
    packed blocks (`turbospec.weights`: Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K; rearranged at load into 8-row
    interleaved blocks, which the kernels multiply faster), multiplied by the kernel without unpacking the matrix for
    decode and verification rows, and for prefill by dequantized tiles or, for `weights.INT8_ANY_ROWS` in 16-bit
    models, the same kernel (on a GPU: turbospec.kernels.packed)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, hugepages: bool = True):
        """`hugepages=False` for short-lived matrices: huge-page copies come from a bump allocator whose mappings
        live as long as any tensor in them (the model's weights)."""
        self.kernel = load_kernel()
        self.weight = weight.contiguous()
        copied = False
        if (hugepages and self.kernel is not None and env.HUGEPAGES and self.weight.device.type == "cpu"
                and not self.weight.requires_grad and not self.kernel.in_arena(self.weight)):
            self.weight, copied = self.kernel.hugepage_copy(self.weight), True
        if hugepages:  # the model's packed weights: rows interleaved (weights.interleave)
            self.weight = interleave(self.weight, owned=copied)
        self.bias = bias
        self.out_features, self.in_features = out_features(self.weight), in_features(self.weight)
        self.packed = is_packed(self.weight)

    @property
    def takes_in_place(self) -> bool:
        """Whether `take` reads the rows where they lie (float weights on the CPU, with the C++ kernel): any subset of
        rows then costs what its rows cost, no copy."""
        return self.kernel is not None and not self.packed and self.weight.device.type == "cpu"

    def take(self, rows: torch.Tensor) -> Linear | LinearRows:
        """The layer over output rows `rows` (int64) alone: float weights with the C++ kernel read in place (no copy:
        `LinearRows`, see `takes_in_place`), else a copy of the rows (in ordinary memory: it may be rebuilt often)."""
        if self.takes_in_place:
            return LinearRows(self, rows.cpu())
        w = ggml_blocks(self.weight, rows) if self.packed else self.weight[rows]
        return Linear(w, None if self.bias is None else self.bias[rows], hugepages=False)

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
              dtype: torch.dtype | None = None) -> Linear | SplitLinear:
        """One Linear for several projections' rows. Parts in different packed formats (a Q4_K_M GGUF file's
        Q6_K `attn_v` beside Q4_K `attn_q`), or packed beside float, stay as they are in a `SplitLinear`; float
        parts of different dtypes are widened to `dtype`."""
        if len({format_of(w) for w in weights}) > 1:
            return SplitLinear([cls(w, b) for w, b in zip(weights, biases)])
        if len({w.dtype for w in weights}) > 1:
            to = dtype or weights[0].dtype
            weights = [w.to(to) for w in weights]
        w = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        if len(weights) > 1:
            for part in weights:
                release(part)  # a memory-mapped part: its pages are in the concatenation now
        if all(b is None for b in biases):
            return cls(w, None)
        bt = next(b.dtype for b in biases if b is not None)
        bs = [b if b is not None else torch.zeros(wi.shape[0], dtype=bt) for b, wi in zip(biases, weights)]
        return cls(w, torch.cat(bs, 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if self.kernel is None:  # a GPU (Triton) or no C++ kernel here (torch)
                return packed.linear(x, self.weight, self.bias)
            return self.kernel.packed_linear(x, self.weight, self.bias, max(env.SKINNY_MAX_ROWS, PACKED_ROW_LIMIT))
        if self._skinny(x):
            return self.kernel.skinny_linear(x, self.weight, self.bias)
        return prefill_product(x, self.weight, self.bias)

    def _skinny(self, x: torch.Tensor) -> bool:
        """Whether x's rows go through the C++ skinny product (a float weight, the kernel here, few enough rows)."""
        return not self.packed and self.kernel is not None and x.numel() // self.in_features <= skinny_rows(x.dtype)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).float()` (the products rounded to x's dtype, as float32), on the kernel's path in one pass
        without the copy in x's dtype: an LM head's logits."""
        if self._skinny(x):
            return self.kernel.skinny_linear_float(x, self.weight, self.bias)
        return self(x).float()

    @property
    def matrices(self) -> list[torch.Tensor]:
        """The matrices whose outputs make this layer's, for the one-call kernels: the weight."""
        return [self.weight]

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


def float_logits(head, x: torch.Tensor) -> torch.Tensor:
    """float32 logits of an LM head (`Linear.float_out` for a plain one; any other head: its output as float32)."""
    return head.float_out(x) if isinstance(head, Linear) else head(x).float()


class LinearRows:
    """Output rows `rows` of a float `Linear`, as a layer. A few input rows (a drafter's draft step, the drafters of a
    batch together) are multiplied by the C++ kernel over the rows where they lie, each row with the arithmetic of a
    one-row skinny product of a copy; more rows gather the rows per call. A holder keeps only the row ids: a draft
    head over a reduced vocabulary is one matrix however many sequences draft from it (their vocabularies differ by
    their contexts' tokens)."""

    packed = False

    def __init__(self, layer: Linear, rows: torch.Tensor):
        self.layer, self.rows = layer, rows
        self.in_features, self.out_features = layer.in_features, rows.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if x.numel() <= env.SKINNY_MAX_ROWS * self.in_features:
            return layer.kernel.rows_linear(x, layer.weight, self.rows, layer.bias)
        bias = None if layer.bias is None else layer.bias[self.rows]
        return Linear(layer.weight[self.rows], bias, hugepages=False)(x)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class SplitLinear:
    """Projections that could not be fused into one matrix (parts in different weight formats): each part is
    multiplied on its own and the outputs concatenated. The decoder layers' one-call kernels take a mixer's input
    projection as its list of parts (`matrices`, `bias`) and write each part's product into its columns."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.packed = any(p.packed for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def matrices(self) -> list[torch.Tensor]:
        return [p.weight for p in self.parts]

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases end to end (zeros for a part without one); None when no part has one."""
        if all(p.bias is None for p in self.parts):
            return None
        like = next(p.bias for p in self.parts if p.bias is not None)
        return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=like.dtype,
                                                                        device=like.device) for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class RowParallelLinear:
    """A linear layer holding one part of its input columns (tensor parallelism: this process's part): its product
    is a partial sum, which `reduce` sums over the parts; the bias, if any, is added once after. The fused decoder
    layers (turbospec.layers.block) run up to each sum in their kernels and call `reduce` between them."""

    def __init__(self, inner: Linear, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.inner, self.reduce = inner, reduce
        self.bias, inner.bias = inner.bias, None
        self.out_features, self.in_features = inner.out_features, inner.in_features

    @property
    def weight(self) -> torch.Tensor:  # this part's columns
        return self.inner.weight

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


def exact_bf16(lin: Linear | SplitLinear) -> Linear | SplitLinear:
    """`lin` with its weights stored in bfloat16 when that loses nothing (float32 weights that are all bf16
    values, as when a bf16 checkpoint is loaded in float32): the skinny kernel widens bf16 to float32 exactly and
    accumulates in the same order, so the outputs are bit-identical while half the bytes are read. Otherwise
    `lin` itself."""
    if not isinstance(lin, Linear) or lin.kernel is None:  # (torch's products take one dtype: no gain there)
        return lin
    w = lin.weight
    if w.dtype != torch.float32:
        return lin
    wb = torch.empty(w.shape, dtype=torch.bfloat16)
    rows = max(1, (1 << 20) // max(1, 4 * w[0].numel()))  # converted and checked ~1 MB at a time: a float32 round
    for i in range(0, w.shape[0], rows):  # trip of the whole matrix (an LM head: V x H x 4 bytes) would be a copy
        wb[i:i + rows] = w[i:i + rows]
        if not torch.equal(wb[i:i + rows].to(torch.float32), w[i:i + rows]):
            return lin
    b = lin.bias
    if b is not None and not torch.equal(b.to(torch.bfloat16).to(torch.float32), b):
        return lin
    return Linear(wb, b)
