"""Encode a step's K/V vectors straight into a packed KV cache (turbospec/kernels/encode.cpp).

`spec_of(fmt, dim)` says whether (and how) the kernel encodes a format; `encode_into(x, spec, fields, start)`
writes rows x [KVH, N, D] into positions [start, start + N) of the layer's buffers and returns False, having
written nothing, when a value or scale is not finite (the caller then runs the reference encoder, which
raises the proper error). Bit-identical to the reference for f32/f16/bf16, q8_0, q4_0 and tbq4_0; turbo* codes
can differ from the reference's for coordinates within an ulp of a codebook boundary (see encode.cpp).
"""

from __future__ import annotations

import os
from functools import cache
from typing import NamedTuple

import torch

from turbospec.kernels import attention
from turbospec.kernels.gemv import load_extension
from turbospec.kv.formats import NORM_MODES, KVFormat, TBQ4Format, _codebook
from turbospec.kv.hadamard import padded_dim, rot_block_for, rotate, rotation_signs, unrotate

MAX_ROWS = 256  # above this many vectors per call (prefill), the vectorized torch encoders win
_EMPTY = torch.empty(0)


class EncodeSpec(NamedTuple):
    kind: int
    bits: int
    width: int
    fields: tuple[str, ...]
    cent: torch.Tensor
    bounds: torch.Tensor
    s1: torch.Tensor
    s2: torch.Tensor
    norm_mode: int


def load():
    if os.environ.get("TURBOSPEC_NO_ENCODE_KERNEL"):
        return None
    return load_extension("turbospec_encode", "encode.cpp", "KV-encode", ("-ffp-contract=off",))


def spec_of(fmt: KVFormat, dim: int) -> EncodeSpec | None:
    """How the kernel encodes `fmt` at head size `dim`, or None: the formats the attention kernel reads (same kind
    numbers and field order), except dithered tbq4_0d and formats built with check_finite=False."""
    if not fmt.check_finite or (isinstance(fmt, TBQ4Format) and fmt.dither):
        return None
    read = attention.spec_of(fmt, dim)
    if read is None:
        return None
    kind, bits, fields, cent = read
    width = fmt.padded_dim(dim)
    if kind in (attention.TURBO, attention.TURBO64):
        block = fmt.for_dim(dim).block_size
        s1, s2 = _signs(block)
        bounds = _codebook(bits, torch.device("cpu"), block)[1]
        return EncodeSpec(kind, bits, width, fields, cent, bounds, s1, s2, NORM_MODES.index(fmt.norm_mode))
    return EncodeSpec(kind, 0, width, fields, _EMPTY, _EMPTY, _EMPTY, _EMPTY, 0)


def encode_into(x: torch.Tensor, spec: EncodeSpec, fields: list[torch.Tensor], start: int, mod=None) -> bool:
    """x [KVH, N, D] (any float dtype) into positions [start, start + N) of `fields` (the layer's buffers
    [KVH, T, ...] in `spec.fields` order). False (nothing written) for non-finite input."""
    mod = mod or load()
    return mod.encode_into(x.to(torch.float32).contiguous(), spec.kind, spec.bits, spec.width, fields, start,
                           spec.cent, spec.bounds, spec.s1, spec.s2, spec.norm_mode)


def rotate_fast(x: torch.Tensor, inverse: bool = False, dim: int | None = None, mod=None) -> torch.Tensor:
    """`rotate(x)` / `unrotate(x, dim)` of turbospec.kv.hadamard for float32 x, as one C++ call (a fast
    Walsh-Hadamard transform: the same map, rounded differently) when the kernel is here."""
    mod = mod or load()
    if mod is None or x.dtype != torch.float32:
        return unrotate(x, dim) if inverse else rotate(x)
    w = x.shape[-1]
    block = rot_block_for(w)
    if not inverse and padded_dim(w, block) != w:
        x = torch.nn.functional.pad(x, (0, padded_dim(w, block) - w))
    s1, s2 = _signs(block)
    y = mod.hadamard_rows(x, s1, s2, inverse)
    return y[..., :dim] if inverse and dim is not None and dim != w else y


@cache
def _signs(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's sign vectors (s1, s2) for `block`, float32."""
    s1, s2 = rotation_signs(block)
    return s1.to(torch.float32).contiguous(), s2.to(torch.float32).contiguous()
