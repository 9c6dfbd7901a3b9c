"""Encode a step's K/V vectors straight into a cache's buffers in Triton (the GPU's counterpart of encode.cpp):
plain f32/f16/bf16, q8_0, q4_0 and tbq4_0 bit-identical with the torch reference encoders (turbospec.kv.formats)
for finite input; turbo2/3/4 (rotation, Lloyd-Max indices, the norm modes) the same up to float rounding: an index
can differ from the reference's where a rotated coordinate lies within rounding of a codebook boundary, as with
the C++ encoder. Unlike the reference, nothing is checked on the host (a check would wait for the GPU twice per
layer and step): non-finite K/V give undefined codes, as llama.cpp's do.

`encode_into(x, kind, fields, start)`: x [KVH, N, D] (any float dtype) into positions [start, start + N) of one
layer's fields [KVH, T, ...] (attention.py's kind numbers; fields in the attention spec's order).
"""

from __future__ import annotations

from functools import cache

import torch

from turbospec.kernels.attention import BF16, F16, F32, Q4_0, Q8_0, TBQ4_0, TURBO, TURBO64

_BLOCK = {F32: 32, F16: 32, BF16: 32, Q8_0: 32, Q4_0: 32, TBQ4_0: 64, TURBO: 128, TURBO64: 64}
ROWS = 16  # vectors per program (turbo*: the rotation is one [16, B] x [B, B] product)


def supports(kind: int, width: int, dim: int) -> bool:
    """Whether the kernel writes this kind at head size `dim` (no padding: width == dim, whole blocks)."""
    return kind in _BLOCK and width == dim and dim % _BLOCK[kind] == 0


@cache
def _kernels():
    from turbospec.kernels import triton_encode_jit

    return triton_encode_jit.encode, triton_encode_jit.encode_turbo


def encode_into(x: torch.Tensor, kind: int, fields: list[torch.Tensor], start: int, turbo: tuple | None = None,
                slots: torch.Tensor | None = None) -> None:
    """`turbo` (turbo* kinds): (rotation matrix float32 [B, B] with rotate(x) = x R^T, codebook boundaries and
    centroids float32, index bits, norm mode index), all on x's device. `slots` (int64 [N], on x's device): token
    i goes to position slots[i] instead of start + i (a paged pool's blocks)."""
    kvh, n, d = x.shape
    bs = _BLOCK[kind]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if kind in (TURBO, TURBO64):
        rot, bounds, cent, bits, mode = turbo
        f = list(fields) + [fields[0]] * (3 - len(fields))
        strides = [s for t in f for s in (t.stride(0), t.stride(1))]
        _kernels()[1][(-(-kvh * n // ROWS), d // bs)](x, rot, bounds, cent, *f, x.stride(0), x.stride(1), *strides, n,
                                                      kvh * n, start, slots, B=bs, BITS=bits, MODE=mode, RP=ROWS,
                                                      SLOTS=slots is not None)
        return
    f0 = fields[0]
    f1 = fields[1] if len(fields) > 1 else f0
    _kernels()[0][(-(-kvh * n // ROWS), d // bs)](x, f0, f1, x.stride(0), x.stride(1), f0.stride(0), f0.stride(1),
                                               f1.stride(0), f1.stride(1), n, kvh * n, start, slots, KIND=kind, BS=bs,
                                               RP=ROWS, SLOTS=slots is not None, enable_fp_fusion=False)
