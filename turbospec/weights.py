"""Weight formats: a matrix stays float (the model dtype) or is packed in ggml's blocks (Q8_0, Q4_0, Q4_K, and
Q5_K / Q6_K as GGUF files hold them).

A packed matrix is a uint8 tensor [out, blocks per row, block bytes], each row the ggml blocks of one output row
(the bytes a GGUF file holds for it, so GGUF tensors map without conversion). The block size names the format.
`Linear` rearranges a packed matrix's bytes at load into 8-row interleaved blocks (`Q8_0_X8` / `Q4_0_X8` [out / 8,
blocks / 4, 1088 / 576], `Q4_K_X8` / `Q5_K_X8` / `Q6_K_X8` [out / 8, blocks, 1152 / 1408 / 1680]: the same bytes
in another order, Q8_0's values + 128, `interleave`), which its kernels multiply faster; `ggml_blocks` gives the
rows back as ggml blocks.
`Linear` multiplies packed matrices with the fused kernels in turbospec/kernels/quant.cpp; `quantize` writes
llama.cpp's reference blocks (the same weights give the same bytes as `llama-quantize`); `dequantize` equals the
gguf package's dequantization bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from turbospec import device, env
from turbospec.errors import TurboSpecError
from turbospec.kernels import gpu, packed
from turbospec.kernels.gemv import host_kernel, load_kernel


@dataclass(frozen=True)
class WeightFormat:
    name: str
    block_values: int  # values per block
    block_bytes: int
    gguf_type: str  # gguf.GGMLQuantizationType member
    rows: int = 1  # weight rows per row of the tensor (8: interleaved)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / (self.block_values * self.rows)


PACKED = {f.name: f for f in (WeightFormat("q8_0", 32, 34, "Q8_0"), WeightFormat("q4_0", 32, 18, "Q4_0"),
                              WeightFormat("q4_k", 256, 144, "Q4_K"))}  # what `quantize` writes (--weights)
# multiplied packed as GGUF files hold them; no quantizer here
Q5_K = WeightFormat("q5_k", 256, 176, "Q5_K")
Q6_K = WeightFormat("q6_k", 256, 210, "Q6_K")
# the blocks of 8 rows interleaved (`interleave`): only made at load, never written
Q8_0_X8 = WeightFormat("q8_0_x8", 128, 1088, "Q8_0", rows=8)  # (its values stored + 128: unsigned for vpdpbusd)
Q4_0_X8 = WeightFormat("q4_0_x8", 128, 576, "Q4_0", rows=8)
Q4_K_X8 = WeightFormat("q4_k_x8", 256, 1152, "Q4_K", rows=8)
Q5_K_X8 = WeightFormat("q5_k_x8", 256, 1408, "Q5_K", rows=8)
Q6_K_X8 = WeightFormat("q6_k_x8", 256, 1680, "Q6_K", rows=8)
INTERLEAVED = {PACKED["q8_0"]: Q8_0_X8, PACKED["q4_0"]: Q4_0_X8, PACKED["q4_k"]: Q4_K_X8, Q5_K: Q5_K_X8,
               Q6_K: Q6_K_X8}
# formats whose 16-bit activation rows take the int8 kernel at any row count, prefill too (quant.cpp's
# int8_rows_any: faster than bf16 tiles there); the others take tiles beyond the skinny limit
INT8_ANY_ROWS = frozenset({Q8_0_X8, Q4_0_X8, Q4_K_X8, Q5_K_X8})
BY_BLOCK_BYTES = {f.block_bytes: f for f in (*PACKED.values(), Q5_K, Q6_K, *INTERLEAVED.values())}
BY_GGUF_TYPE = {f.gguf_type: f for f in (*PACKED.values(), Q5_K, Q6_K)}
WEIGHT_CHOICES = ("auto", *PACKED)  # --weights: auto = as stored (float: the model dtype)


def is_packed(w: torch.Tensor) -> bool:
    return w.dtype == torch.uint8 and w.dim() == 3


def format_of(w: torch.Tensor) -> WeightFormat | None:
    """The packed format of `w`, None for a float matrix."""
    return BY_BLOCK_BYTES[w.shape[2]] if is_packed(w) else None


def in_features(w: torch.Tensor) -> int:
    f = format_of(w)
    return w.shape[1] * f.block_values if f else w.shape[1]


def out_features(w: torch.Tensor) -> int:
    f = format_of(w)
    return w.shape[0] * f.rows if f else w.shape[0]


def interleave(w: torch.Tensor, owned: bool = False) -> torch.Tensor:
    """A packed matrix as its `*_X8` format (kernels for AVX-512 VNNI + VBMI + GFNI and for AVX2) when its rows
    come in whole groups of 8 (Q8_0 / Q4_0: and its columns in 128s) and TURBOSPEC_NO_INTERLEAVE is unset; any
    other matrix as it is. The bytes are rearranged in place when the caller `owned` them (its own copy)
    or `w` is the whole of a huge-page mapping of its own (`consume`'s large results), else in a copy (a file
    mapping's pages dropped after it)."""
    k, f = load_kernel(), format_of(w)
    if (k is None or w.device.type != "cpu" or f not in INTERLEAVED or w.shape[0] % 8
            or w.shape[1] * f.block_values % INTERLEAVED[f].block_values or not k.interleaved_here()):
        return w
    whole = w.is_contiguous() and w.storage_offset() == 0 and w.untyped_storage().nbytes() == w.nbytes
    if not (owned or (whole and k.in_arena(w))):
        src, w = w, w.contiguous().clone()
        release(src)
    return k.interleave_(w)


def ggml_blocks(w: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all when None) of a packed matrix in ggml's layout ([n, blocks, block bytes]: the rows of an
    interleaved matrix as its ggml blocks)."""
    if format_of(w) not in INTERLEAVED.values():
        return w if ids is None else w[ids]
    return _kernel().packed_blocks(w, torch.arange(out_features(w)) if ids is None else ids)


def packed_here() -> bool:
    """Whether packed blocks multiply where the engine runs: the C++ kernel on the CPU, Triton on a GPU (or in
    the tests' interpreter, `gpu.ON_CPU`). Elsewhere a GGUF file's blocks are dequantized as they load."""
    return load_kernel() is not None or ((device.on_gpu() or gpu.ON_CPU) and gpu.available())


# random_blocks: the byte offsets of each format's float16 scales, and the scale that gives values of std ~1
# (Q4_K: d, and dmin = 7.5 d, the nibbles' mean times d: values centred on average)
_SCALES = {"q8_0": ((0, 1 / 74),), "q4_0": ((0, 1 / 4.6),), "q4_k": ((0, 1 / 256), (2, 7.5 / 256)),
           "q5_k": ((0, 1 / 512), (2, 15.5 / 512)), "q6_k": ((208, 1 / 1350),)}


def random_blocks(fmt: WeightFormat, shape: tuple[int, int], std: float = 0.02,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Random packed blocks of a [out, in] matrix in `fmt` (values of about `std`; on the current default device):
    real-size packed models without a file or a quantizer (benchmarks/gpu_check.py)."""
    out = torch.randint(0, 256, (shape[0], shape[1] // fmt.block_values, fmt.block_bytes), dtype=torch.uint8,
                        generator=generator)
    for off, scale in _SCALES[fmt.name]:
        d = torch.full(out.shape[:2], std * scale, dtype=torch.float16, device=out.device)
        out[..., off:off + 2] = d.unsqueeze(-1).view(torch.uint8)
    return out


def packable(fmt: WeightFormat, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D matrix of `shape` can be packed in `fmt` (whole blocks per row)."""
    return len(shape) == 2 and shape[1] % fmt.block_values == 0


def _kernel():
    k = host_kernel()
    if k is None:
        raise TurboSpecError("packed weights need the AVX2 kernel, which is not available on this machine "
                             "(unset TURBOSPEC_NO_KERNEL, or install a C++ compiler)")
    return k


def quantize(w: torch.Tensor, fmt: WeightFormat | str) -> torch.Tensor:
    """Float matrix [out, in] -> packed blocks, as llama.cpp's reference quantizer (rows in parallel, one float32
    row at a time: no float32 copy of the matrix). Without the C++ kernel (a GPU machine that did not build it),
    Q8_0 and Q4_0 come from the gguf package's quantizer (the same bytes, slower); Q4_K needs the kernel."""
    f = PACKED[fmt] if isinstance(fmt, str) else fmt
    if not packable(f, tuple(w.shape)):
        raise TurboSpecError(f"cannot pack a {tuple(w.shape)} matrix as {f.name}: rows must be whole "
                             f"{f.block_values}-value blocks")
    if host_kernel() is None and f.name in ("q8_0", "q4_0"):
        from gguf import GGMLQuantizationType, quants

        data = quants.quantize(w.detach().cpu().float().numpy(), getattr(GGMLQuantizationType, f.gguf_type))
        return torch.from_numpy(data).reshape(w.shape[0], -1, f.block_bytes)
    return _kernel().quantize_packed(w, f.block_bytes)


def _host(w: torch.Tensor):
    """The C++ kernel for packed blocks `w` on the CPU where it is built, else None (turbospec.kernels.packed:
    Triton on a GPU, torch elsewhere)."""
    return host_kernel() if w.device.type == "cpu" else None


def dequantize(w: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Packed matrix (or a slice of its rows) -> float32 [rows, in]."""
    r = rows or slice(0, out_features(w))
    a, b = r.start or 0, out_features(w) if r.stop is None else r.stop
    k = _host(w)
    return packed.dequantize(w, torch.arange(a, b, device=w.device)) if k is None else k.dequantize_packed(w, a, b)


def rows_of(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table, float or packed, in `dtype` ([*ids.shape, in])."""
    if not is_packed(table):
        return torch.nn.functional.embedding(ids, table).to(dtype)
    k = _host(table)
    rows = packed.dequantize(table, ids, dtype) if k is None else k.packed_rows(table, ids).to(dtype)
    return rows.reshape(*ids.shape, in_features(table))


def embedding_rows(table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a token embedding: a table (`rows_of`), or a split one that looks them up itself
    (`rows(ids, dtype)`: tensor parallelism's `VocabEmbedding`)."""
    return rows_of(table, ids, dtype) if isinstance(table, torch.Tensor) else table.rows(ids, dtype)


def embedding_bytes(table, head) -> int:
    """Bytes of a token embedding (a table or a split one, whose `table` is the rows held here) plus those of the
    LM head `head` when it is not the same matrix (tied)."""
    t = table if isinstance(table, torch.Tensor) else table.table
    return t.numel() * t.element_size() + (0 if head.weight is t else head.nbytes)


CHUNK_BYTES = 8 << 20  # source bytes converted per step while loading (`consume`)
BIG_BYTES = 32 << 20  # results this large get their own huge-page mapping (the kernel's ARENA_MIN / 2)


def consume(stored: torch.Tensor, fmt: WeightFormat | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A memory-mapped checkpoint tensor quantized to `fmt` (or converted to `dtype`), in row chunks of about
    `CHUNK_BYTES`, each chunk's file pages dropped as soon as it is converted: loading holds the converted
    weights plus one chunk, never the whole stored tensor."""
    rows = stored.shape[0]
    step = max(1, CHUNK_BYTES // max(1, stored[0].numel() * stored.element_size())) if rows else 1
    shape = (rows, stored.shape[1] // fmt.block_values, fmt.block_bytes) if fmt is not None else tuple(stored.shape)
    out_dtype = torch.uint8 if fmt is not None else dtype
    # a large result goes straight into its own huge-page mapping (Linear keeps it there: no second copy; freed
    # with the tensor), a small one to the heap (Linear copies it into a shared huge-page arena)
    k = load_kernel()
    big = math.prod(shape) * torch.empty((), dtype=out_dtype).element_size() >= BIG_BYTES
    out = (k.hugepage_empty(list(shape), out_dtype) if big and k is not None and env.HUGEPAGES
           else torch.empty(shape, dtype=out_dtype))
    for a in range(0, rows, step):
        part = stored[a:a + step]
        out[a:a + step] = quantize(part, fmt) if fmt is not None else part
        release(part)
    return out


def release(t: torch.Tensor) -> None:
    """Drop the pages of a memory-mapped checkpoint tensor that has been copied, converted or quantized, so that
    loading holds one copy of the weights (no-op without the kernel or for tensors not in a file mapping)."""
    k = load_kernel()
    if k is not None:
        k.release_file_pages(t)


def file_mapping(t: torch.Tensor) -> tuple[int, int] | None:
    """The [start, end) addresses of the file mapping `t` is a view of (a GGUF file's packed matrix), None when it is
    not one or without the kernel."""
    k = load_kernel()
    lo, hi = k.file_mapping_bounds(t) if k is not None else (0, 0)
    return (lo, hi) if hi > lo else None


def trim_heap() -> None:
    """Return the heap's free memory (load-time conversion buffers) to the system."""
    k = load_kernel()
    if k is not None:
        k.trim_heap()
