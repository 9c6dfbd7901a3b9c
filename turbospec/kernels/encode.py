"""Encode a step's K/V vectors straight into a packed KV cache (turbospec/kernels/encode.cpp).

`encode_into(x, spec, fields, start)` writes rows x [KVH, N, D] into positions [start, start + N) of the
layer's buffers and returns False, having written nothing, when a value or scale is not finite (the caller
then runs the reference encoder, which raises the proper error). An `EncodeSpec` is plain data;
the KV layer (kv/kernel_args.py, `encode_spec`) derives it from a format (None for formats the kernel does not
encode). Bit-identical to the reference for f32/f16/bf16, q8_0, q4_0 and tbq4_0; turbo* codes can differ
from the reference's for coordinates within an ulp of a codebook boundary (see encode.cpp).
`hadamard_rows` is the turbo* rotation as one call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from turbospec import env
from turbospec.kernels.gemv import load_extension

MAX_ROWS = 256  # above this many vectors per call (prefill), the vectorized torch encoders win
EMPTY = torch.empty(0)


class EncodeSpec(NamedTuple):
    """How the kernel encodes one format: kind (attention.py's numbers), index bits, padded width, field
    names in buffer order, codebook centroids and boundaries, rotation sign vectors, norm mode index."""

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
    if env.on("TURBOSPEC_NO_ENCODE_KERNEL"):
        return None
    return load_extension("turbospec_encode", "encode.cpp", "KV-encode", ("-ffp-contract=off",))


def encode_into(x: torch.Tensor, spec: EncodeSpec, fields: list[torch.Tensor], start: int,
                mod=None) -> bool:
    """x [KVH, N, D] (any float dtype) into positions [start, start + N) of `fields` (the layer's buffers
    [KVH, T, ...] in `spec.fields` order). False (nothing written) for non-finite input."""
    mod = mod or load()
    return mod.encode_into(x.to(torch.float32).contiguous(), spec.kind, spec.bits, spec.width, fields, start,
                           spec.cent, spec.bounds, spec.s1, spec.s2, spec.norm_mode)


def encode_slots(x: torch.Tensor, spec: EncodeSpec, fields: list[torch.Tensor], slots: torch.Tensor,
                 mod=None) -> bool:
    """x [KVH, N, D] (any float dtype), row i into position slots[i] (int64 [N]) of `fields` (a paged pool's layer
    buffers [KVH, T, ...] in `spec.fields` order). False (nothing written) for non-finite input."""
    mod = mod or load()
    return mod.encode_slots(x.to(torch.float32).contiguous(), spec.kind, spec.bits, spec.width, fields, slots,
                            spec.cent, spec.bounds, spec.s1, spec.s2, spec.norm_mode)


def hadamard_rows(x: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, inverse: bool,
                  mod=None) -> torch.Tensor:
    """The randomized Walsh-Hadamard rotation (signs s1, s2 float32 [block]) of float32 rows x [..., W], W a
    multiple of the block, or its inverse, as one C++ call (a fast transform). Needs the loaded kernel."""
    mod = mod or load()
    return mod.hadamard_rows(x, s1, s2, inverse)
