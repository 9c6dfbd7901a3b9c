"""Encode a step's K/V vectors straight into a cache's buffers in Triton (the GPU's counterpart of encode.cpp):
plain f32/f16/bf16, q8_0, q4_0 and tbq4_0, bit-identical with the torch reference encoders (turbospec.kv.formats)
for finite input. Unlike the reference, nothing is checked on the host (a check would wait for the GPU twice per
layer and step): non-finite K/V give undefined codes, as llama.cpp's do. turbo* formats keep the torch encoders.

`encode_into(x, kind, fields, start)`: x [KVH, N, D] (any float dtype) into positions [start, start + N) of one
layer's fields [KVH, T, ...] (attention.py's kind numbers; fields in the attention spec's order).
"""

from __future__ import annotations

from functools import cache

import torch

from turbospec.kernels.attention import BF16, F16, F32, Q4_0, Q8_0, TBQ4_0

_BLOCK = {F32: 32, F16: 32, BF16: 32, Q8_0: 32, Q4_0: 32, TBQ4_0: 64}


def supports(kind: int, width: int, dim: int) -> bool:
    """Whether the kernel writes this kind at head size `dim` (no padding: width == dim, whole blocks)."""
    return kind in _BLOCK and width == dim and dim % _BLOCK[kind] == 0


@cache
def _kernel():
    from turbospec.kernels import triton_encode_jit

    return triton_encode_jit.encode


def encode_into(x: torch.Tensor, kind: int, fields: list[torch.Tensor], start: int) -> None:
    kvh, n, d = x.shape
    bs = _BLOCK[kind]
    if x.stride(-1) != 1:
        x = x.contiguous()
    f0 = fields[0]
    f1 = fields[1] if len(fields) > 1 else f0
    _kernel()[(kvh * n, d // bs)](x, f0, f1, x.stride(0), x.stride(1), f0.stride(0), f0.stride(1), f1.stride(0),
                                   f1.stride(1), n, start, KIND=kind, BS=bs, enable_fp_fusion=False)
