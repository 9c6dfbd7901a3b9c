"""KV-cache storage formats: encode float vectors into packed per-vector fields and decode them back.

Every format works on the last dim of a tensor ``x: [..., D]`` (one K or V head vector per row):

* ``encode(x) -> Packed``: a ``dict[str, Tensor]`` whose fields all have ``x``'s leading dims followed
  by the per-vector shape from ``storage_spec(D)``; a cache preallocates ``[..., max_tokens, *shape]``
  buffers per field and copies encoded tokens in.
* ``decode(p, dim=None) -> float32 [..., D]``.  ``D`` is taken from ``dim``, else from ``p.dim`` (set by
  ``encode``), else it is the padded length ``num_blocks * block_size``.
* ``bytes_per_vector(D)`` = exact storage incl. the zero padding up to a block multiple;
  ``bits_per_value`` = bytes per block * 8 / block_size.

Formats (see docs/kv-formats.md): f32, f16, bf16; q8_0 and q4_0 (bit-exact with ggml / the ``gguf``
package, see ``to_ggml_bytes``); tbq4_0 / tbq4_0d (int4 + fp16 absmax scale per 64 values, optional
dither); turbo4 / turbo3 / turbo2 (TurboQuant-MSE: fp16 norm + randomized-Hadamard rotation + Lloyd-Max
codebook, 128-value blocks); turbo4p / turbo3p / turbo2p (TurboQuant-prod: (b-1)-bit MSE code plus a
1-bit QJL sketch of the residual; unbiased inner products; S has orthogonal rows by default).

Rotated formats (``rotated = True``) also offer ``decode_rotated(p)``: the values in the rotated domain
(padded length), so that attention can use  <rotate(q), decode_rotated(k)> == <q, decode(k)>.

Non-finite input raises ``ValueError("non-finite values in KV ...")`` (checked cheaply on the per-block
scales/norms, which NaN/Inf propagate into; pass ``check_finite=False`` to a constructor to skip).
Values so large that an fp16 scale overflows raise ``ValueError`` as well.  All-zero blocks decode to
exact zeros.

One module per codec family: ``base`` (``KVFormat``, ``Packed``, shared helpers), ``plain``, ``ggml``,
``tbq``, ``turbo``; this package holds the registry (``FORMATS``, ``get_format``) and re-exports every
public name.
"""

from __future__ import annotations

import torch

from turbospec.kv.formats.base import KVFormat, Packed, StorageSpec, round_half_away
from turbospec.kv.formats.ggml import Q4_0Format, Q8_0Format
from turbospec.kv.formats.plain import PlainFormat
from turbospec.kv.formats.tbq import DITHER_SEED, TBQ4Format
from turbospec.kv.formats.turbo import (
    NORM_MODES,
    QJL_KINDS,
    QJL_SEED,
    TurboFormat,
    TurboProdFormat,
    qjl_matrix,
    qjl_scale,
)
from turbospec.kv.hadamard import rotate, unrotate

__all__ = [
    "DITHER_SEED",
    "FORMATS",
    "NORM_MODES",
    "QJL_KINDS",
    "QJL_SEED",
    "KVFormat",
    "Packed",
    "PlainFormat",
    "Q4_0Format",
    "Q8_0Format",
    "StorageSpec",
    "TBQ4Format",
    "TurboFormat",
    "TurboProdFormat",
    "get_format",
    "qjl_matrix",
    "qjl_scale",
    "rotate",
    "round_half_away",
    "unrotate",
]


def _build_registry() -> dict[str, KVFormat]:
    fmts: list[KVFormat] = [
        PlainFormat("f32", torch.float32),
        PlainFormat("f16", torch.float16),
        PlainFormat("bf16", torch.bfloat16),
        Q8_0Format(),
        Q4_0Format(),
        TBQ4Format(),
        TBQ4Format(dither=True),
        TurboFormat(4),
        TurboFormat(3),
        TurboFormat(2),
        TurboProdFormat(4),
        TurboProdFormat(3),
        TurboProdFormat(2),
    ]
    return {f.name: f for f in fmts}


FORMATS: dict[str, KVFormat] = _build_registry()


def get_format(name: str) -> KVFormat:
    """The registered format called ``name``; ValueError listing the valid names otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV format {name!r}; valid formats: {', '.join(FORMATS)}") from None
