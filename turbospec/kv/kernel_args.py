"""KV formats translated into the C++ kernels' plain arguments (kinds, bits, field names, tables, signs).

The kernels (turbospec/kernels/attention.py, encode.py) know nothing of `KVFormat`: this module, in the KV
layer, says whether and how they read or write a format. `attention_spec(fmt, dim)` -> the fused attention
kernel's spec or None; `encode_spec(fmt, dim)` -> the encoder's `EncodeSpec` or None (`encode_specs` for K and V); `step_sides(...)` -> a
cache's per-layer arguments of the one-call layer steps; `rotate_fast` is the turbo* rotation through the encode
kernel when it is here.
"""

from __future__ import annotations

from functools import cache

import torch

from turbospec.kernels import attention, encode, gpu, triton_attention, triton_encode
from turbospec.kernels.encode import EncodeSpec
from turbospec.kv.formats import (
    NORM_MODES,
    KVFormat,
    Packed,
    PlainFormat,
    Q4_0Format,
    Q8_0Format,
    TBQ4Format,
    TurboFormat,
    TurboProdFormat,
)
from turbospec.kv.formats.turbo import _codebook
from turbospec.kv.hadamard import padded_dim, rot_block_for, rotate, rotation_matrix, rotation_signs, unrotate

AttentionSpec = tuple[int, int, tuple[str, ...], torch.Tensor]


def attention_spec(fmt: KVFormat, dim: int) -> AttentionSpec | None:
    """(kind, index bits, field names, centroid table) of a format the attention kernel reads at head size
    `dim`, or None (TurboQuant-prod, or a padded width that is not a multiple of 8)."""
    if fmt.padded_dim(dim) % 8:
        return None
    if isinstance(fmt, PlainFormat):
        return attention.PLAIN_SPECS[fmt.dtype]
    if isinstance(fmt, Q8_0Format):
        return attention.Q8_0, 0, ("d", "qs"), attention.NO_TABLE
    if isinstance(fmt, Q4_0Format):
        return attention.Q4_0, 0, ("d", "qs"), attention.NO_TABLE
    if isinstance(fmt, TBQ4Format):
        return attention.TBQ4_0, 0, ("d", "qs"), attention.NO_TABLE
    if isinstance(fmt, TurboFormat) and not isinstance(fmt, TurboProdFormat):
        names = ("norm", "qs", "qh") if fmt.mse_bits == 3 else ("norm", "qs")
        block = fmt.for_dim(dim).block_size
        kind = attention.TURBO64 if block == 64 else attention.TURBO
        return kind, fmt.mse_bits, names, _codebook(fmt.mse_bits, torch.device("cpu"), block)[0]
    return None


def triton_specs(k_fmt: KVFormat, v_fmt: KVFormat, dim: int, like: torch.Tensor) -> tuple | None:
    """(K spec, V spec) for the Triton attention over cache buffers like `like` (centroid tables moved to its
    device), or None: not tensors the Triton kernels take (`kernels.gpu.wanted`), or a format or width they do not
    read."""
    if not gpu.wanted(like):
        return None
    ks, vs = attention_spec(k_fmt, dim), attention_spec(v_fmt, dim)
    if not (triton_attention.supports(ks, k_fmt.padded_dim(dim)) and triton_attention.supports(vs, v_fmt.padded_dim(dim))):
        return None
    return tuple((*spec[:3], spec[3].to(like.device)) for spec in (ks, vs))


def triton_encoders(k_fmt: KVFormat, v_fmt: KVFormat, dim: int, k: Packed, v: Packed, num_layers: int) -> tuple:
    """Per side (K, V), (kind, that side's buffers per layer in field order, turbo* arguments or None) for the
    Triton encoder (turbospec/kernels/triton_encode.py) over cache buffers [layers, KVH, positions, ...] on a GPU;
    None for a side it does not write (dithered tbq4_0d, unchecked formats) and for buffers not on a GPU."""
    like = next(iter(k.values()))
    if not gpu.wanted(like):
        return None, None
    out: list = []
    for fmt, buf in ((k_fmt, k), (v_fmt, v)):
        spec = encode_spec(fmt, dim)
        if spec is None or not triton_encode.supports(spec.kind, spec.width, dim):
            out.append(None)
            continue
        turbo = None
        if fmt.rotated:
            block = fmt.for_dim(dim).block_size
            turbo = (rotation_matrix(like.device, torch.float32, block), spec.bounds.to(like.device),
                     spec.cent.to(like.device), spec.bits, spec.norm_mode)
        out.append((spec.kind, [[buf[f][layer] for f in spec.fields] for layer in range(num_layers)], turbo))
    return tuple(out)


def encode_spec(fmt: KVFormat, dim: int) -> EncodeSpec | None:
    """How the encode kernel writes `fmt` at head size `dim`, or None: the formats the attention kernel reads
    (same kind numbers and field order), except dithered tbq4_0d and formats built with check_finite=False."""
    if not fmt.check_finite or (isinstance(fmt, TBQ4Format) and fmt.dither):
        return None
    read = attention_spec(fmt, dim)
    if read is None:
        return None
    kind, bits, fields, cent = read
    width = fmt.padded_dim(dim)
    if kind in (attention.TURBO, attention.TURBO64):
        block = fmt.for_dim(dim).block_size
        s1, s2 = _signs(block)
        bounds = _codebook(bits, torch.device("cpu"), block)[1]
        return EncodeSpec(kind, bits, width, fields, cent, bounds, s1, s2, NORM_MODES.index(fmt.norm_mode))
    e = encode.EMPTY
    return EncodeSpec(kind, 0, width, fields, e, e, e, e, 0)


def encode_specs(k_fmt: KVFormat, v_fmt: KVFormat, dim: int) -> tuple[EncodeSpec | None, EncodeSpec | None]:
    """(K spec, V spec) of the C++ encoder for a cache's formats; an entry None where that format uses its torch
    encoder (both when the encode kernel is not here)."""
    if encode.load() is None:
        return None, None
    return encode_spec(k_fmt, dim), encode_spec(v_fmt, dim)


def rotate_fast(x: torch.Tensor, inverse: bool = False, dim: int | None = None, mod=None) -> torch.Tensor:
    """`rotate(x)` / `unrotate(x, dim)` of turbospec.kv.hadamard for float32 x, as one C++ call (a fast
    Walsh-Hadamard transform: the same map, rounded differently) when the encode kernel is here."""
    mod = mod or encode.load()
    if mod is None or x.dtype != torch.float32:
        return unrotate(x, dim) if inverse else rotate(x)
    w = x.shape[-1]
    block = rot_block_for(w)
    if not inverse and padded_dim(w, block) != w:
        x = torch.nn.functional.pad(x, (0, padded_dim(w, block) - w))
    s1, s2 = _signs(block)
    y = encode.hadamard_rows(x, s1, s2, inverse, mod)
    return y[..., :dim] if inverse and dim is not None and dim != w else y


@cache
def _signs(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's sign vectors (s1, s2) for `block`, float32."""
    s1, s2 = rotation_signs(block)
    return s1.to(torch.float32).contiguous(), s2.to(torch.float32).contiguous()


def step_sides(k_fmt: KVFormat, v_fmt: KVFormat, dim: int, k: Packed, v: Packed, num_layers: int) -> list[tuple] | None:
    """Per layer, the K and V arguments of the kernels' one-call steps over a packed cache or pool
    (`layer_packed` / `attn_packed` / `attn_paged_rows` in kernels/gemv.cpp): per format its ints (kind, bits,
    padded width, norm mode), tables and that layer's buffers in the encoder's field order; None when a format has
    no C++ encoder or attention path here. `k` / `v`: the buffers, [layers, KVH, positions, ...] per field."""
    if attention_spec(k_fmt, dim) is None or attention_spec(v_fmt, dim) is None or attention.load() is None:
        return None
    specs = encode_specs(k_fmt, v_fmt, dim)
    if None in specs:
        return None
    out = []
    for layer in range(num_layers):
        args: tuple = ()
        for spec, buf in zip(specs, (k, v)):
            args += ([spec.kind, spec.bits, spec.width, spec.norm_mode], [spec.cent, spec.bounds, spec.s1, spec.s2],
                     [buf[f][layer] for f in spec.fields])
        out.append(args)
    return out
