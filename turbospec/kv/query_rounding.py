"""Queries against integer keys are read at 8 bits.

Against q8_0, q4_0, tbq4_0, turbo4 and turbo3 keys (turbo's centroids lie on an int8 grid) the attention rounds each
query row to 8 bits per key block (a scale per block, as llama.cpp's CPU attention quantizes Q to q8_0 for quantized
K): the C++ kernels then multiply int8 queries with the stored integer keys (AVX-512 VNNI; turbospec/kernels/
attention.cpp `round_block`), and every other path -- the torch blocks of a step's own positions, the paths without
the kernel -- rounds q the same way here, so all of them compute the same attention. The query's grid (a step of
amax / 127 per block) is as fine as q8_0's own grid for K and ~18x finer than the 4-bit formats' (amax / 7).
"""

from __future__ import annotations

import torch

from turbospec.kv.formats import KVFormat, Q4_0Format, Q8_0Format, TBQ4Format, TurboFormat, TurboProdFormat
from turbospec.kv.formats.turbo import INT8_GRID_BITS


def key_block(fmt: KVFormat, dim: int) -> int | None:
    """The key block over which queries are rounded for keys in `fmt` at head size `dim` (None: they are not
    rounded): the integer formats' block, 3/4-bit turbo's rotation block (its centroids lie on an int8 grid)."""
    if isinstance(fmt, (Q8_0Format, Q4_0Format, TBQ4Format)):
        return fmt.block_size
    if isinstance(fmt, TurboFormat) and not isinstance(fmt, TurboProdFormat) and fmt.mse_bits in INT8_GRID_BITS:
        return fmt.for_dim(dim).block_size
    return None


def round_queries(q: torch.Tensor, block: int | None) -> torch.Tensor:
    """q (float32, [..., D], scaled and rotated as the keys are) with each block of
    `block` values rounded to 8 bits: scale = amax / 127, q -> round(q * (127 / amax)) * scale, the float32
    operations of the C++ kernels. Zero blocks stay zero. `block` None: q unchanged."""
    if block is None:
        return q
    d = q.shape[-1]
    if d % block:  # a partial last block: rounded as the kernels' zero-padded rows are
        return round_queries(torch.nn.functional.pad(q, (0, block - d % block)), block)[..., :d]
    x = q.unflatten(-1, (-1, block))
    amax = x.abs().amax(-1, keepdim=True)
    top = torch.full_like(amax, 127.0)
    rounded = torch.round(x * (top / amax)) * (amax / top)  # tensor / tensor: IEEE division (127.0 / t is not)
    return torch.where(amax > 0, rounded, x).flatten(-2)
