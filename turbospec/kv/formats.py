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
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from .bitpack import pack_bits, unpack_bits
from .hadamard import ROT_BLOCK, padded_dim, rot_block_for, rotate, rotation_matrix, unrotate
from .lloyd_max import lloyd_max_codebook

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

StorageSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

QJL_SEED = 1042
DITHER_SEED = 0x5EED
NORM_MODES = ("plain", "corrected", "lsq")
_M32 = 0xFFFFFFFF


class Packed(dict):
    """Encoded KV vectors: ``dict[str, Tensor]``; ``dim`` is the original last-dim size (or None)."""

    def __init__(self, *args, dim: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.dim = dim

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.items())
        return f"Packed(dim={self.dim}, {fields})"


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero, exactly like ggml's roundf (no x + 0.5 rounding error)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1/d in float32, with 0 where that is not finite (d == 0, like ggml's ``d ? 1/d : 0``, and also for
    float32-subnormal d < 2^-128, where ggml's 1/d overflows to inf and its codes are undefined)."""
    inv = torch.reciprocal(d)
    return inv.masked_fill_(torch.isinf(inv), 0.0)


def _per_device(cache: dict, key, make):
    t = cache.get(key)
    if t is None:
        t = make()
        cache[key] = t
    return t


# ----------------------------------------------------------------------------------------------------------
# base class


class KVFormat(ABC):
    """A KV-cache storage format (see the module docstring)."""

    name: str
    block_size: int
    rotated: bool = False

    def __init__(self, name: str, block_size: int, *, check_finite: bool = True):
        self.name = name
        self.block_size = block_size
        self.check_finite = check_finite

    # -- sizes ------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Storage bytes for one block of ``block_size`` values."""

    @property
    def bits_per_value(self) -> float:
        return self.bytes_per_block * 8 / self.block_size

    def for_dim(self, dim: int) -> KVFormat:
        """The instance that stores vectors of length ``dim`` (itself, except turbo* at head sizes that take
        64-value rotation blocks). Every method taking a head size goes through it."""
        return self

    def padded_dim(self, dim: int) -> int:
        return padded_dim(dim, self.for_dim(dim).block_size)

    def num_blocks(self, dim: int) -> int:
        self._check_dim(dim)
        return self.padded_dim(dim) // self.for_dim(dim).block_size

    def storage_spec(self, dim: int) -> StorageSpec:
        """Per-vector field shapes and dtypes of ``encode``'s output for head size ``dim``."""
        return self.for_dim(dim)._spec(self.num_blocks(dim))

    def bytes_per_vector(self, dim: int) -> int:
        return sum(math.prod(shape) * dt.itemsize for shape, dt in self.storage_spec(dim).values())

    def allocate(self, dim: int, leading: tuple[int, ...] | list[int], device=None) -> Packed:
        """Zero-filled buffers ``[*leading, *shape]`` for every field (zeros decode to zeros)."""
        from turbospec.kv.cache import zeros

        def buf(shape, dt):
            full = (*leading, *shape)
            if device is None or torch.device(device).type == "cpu":
                return zeros(full, dt)
            return torch.zeros(*full, dtype=dt, device=device)

        return Packed({k: buf(shape, dt) for k, (shape, dt) in self.storage_spec(dim).items()}, dim=dim)

    # -- coding -----------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Packed:
        """x: [..., D] (any float dtype) -> Packed fields with leading dims ``x.shape[:-1]``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        dim = x.shape[-1] if x.dim() else 0
        self._check_dim(dim)
        if self.for_dim(dim) is not self:
            return self.for_dim(dim).encode(x)
        xf = x.to(torch.float32)
        dp = self.padded_dim(dim)
        if dp != dim:
            xf = torch.nn.functional.pad(xf, (0, dp - dim))
        fields = self._encode(xf.reshape(*x.shape[:-1], dp // self.block_size, self.block_size), x)
        return Packed(fields, dim=dim)

    def decode(self, p: dict[str, torch.Tensor], dim: int | None = None) -> torch.Tensor:
        """Packed -> float32 [..., D] (D from ``dim``, ``p.dim``, else the padded length)."""
        y = self._decode_padded(p)
        return self._cut(y, dim if dim is not None else getattr(p, "dim", None))

    def decode_rotated(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        raise TypeError(f"format {self.name!r} is not rotated; use decode()")

    # -- helpers for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _spec(self, nb: int) -> StorageSpec: ...

    @abstractmethod
    def _encode(self, xb: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """xb: float32 [..., nb, block_size] (zero-padded); x: the original input (for error messages)."""

    @abstractmethod
    def _decode_padded(self, p: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def _check_dim(self, dim: int) -> None:
        if not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"{self.name}: head size must be a positive int, got {dim!r}")

    def _cut(self, y: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is None or dim == y.shape[-1]:
            return y
        if not 0 < dim <= y.shape[-1]:
            raise ValueError(f"{self.name}: dim {dim} does not fit the packed length {y.shape[-1]}")
        return y[..., :dim]

    def _raise_bad_input(self, x: torch.Tensor) -> None:
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"non-finite values in KV (format {self.name})")
        raise ValueError(f"KV values too large for the fp16 storage of format {self.name}")

    def _to_half(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 -> float16 with the finiteness check (NaN/Inf in x propagate into scales and norms)."""
        h = t.to(torch.float16)
        if self.check_finite and not bool(torch.isfinite(h).all()):
            self._raise_bad_input(x)
        return h

    def __repr__(self) -> str:
        return f"<KVFormat {self.name}: block {self.block_size}, {self.bits_per_value:g} bpv>"


# ----------------------------------------------------------------------------------------------------------
# f32 / f16 / bf16


class PlainFormat(KVFormat):
    """Unquantized storage in ``dtype`` (field ``data: [D]``)."""

    def __init__(self, name: str, dtype: torch.dtype, *, check_finite: bool = True):
        super().__init__(name, 1, check_finite=check_finite)
        self.dtype = dtype

    @property
    def bytes_per_block(self) -> int:
        return self.dtype.itemsize

    def _spec(self, nb: int) -> StorageSpec:
        return {"data": ((nb,), self.dtype)}

    def _encode(self, xb, x):
        data = xb.squeeze(-1).to(self.dtype) if x.dtype != self.dtype else x
        if self.check_finite and not bool(torch.isfinite(data).all()):
            self._raise_bad_input(x)
        return {"data": data}

    def _decode_padded(self, p):
        return p["data"].to(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# ggml q8_0 / q4_0


class _GGMLBlockFormat(KVFormat):
    """Formats laid out like a ggml block: fp16 ``d`` then ``qs`` bytes; see ``to_ggml_bytes``."""

    def to_ggml_bytes(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """Packed -> uint8 [..., nb * bytes_per_block], byte-identical to ggml / gguf.quants rows."""
        d, qs = p["d"], p["qs"]
        d_bytes = d.contiguous().unsqueeze(-1).view(torch.uint8)  # [..., nb, 2], little-endian fp16
        q_bytes = qs.contiguous().view(torch.uint8)
        raw = torch.cat([d_bytes, q_bytes], dim=-1)
        return raw.reshape(*raw.shape[:-2], raw.shape[-2] * raw.shape[-1])

    def from_ggml_bytes(self, raw: torch.Tensor, dim: int | None = None) -> Packed:
        """Inverse of ``to_ggml_bytes`` (raw: uint8 [..., nb * bytes_per_block])."""
        if raw.dtype != torch.uint8 or raw.shape[-1] % self.bytes_per_block:
            raise ValueError(f"{self.name}: expected uint8 rows of whole {self.bytes_per_block}-byte blocks")
        nb = raw.shape[-1] // self.bytes_per_block
        blocks = raw.reshape(*raw.shape[:-1], nb, self.bytes_per_block)
        d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
        qs = blocks[..., 2:].contiguous().view(self._spec(1)["qs"][1])
        return Packed({"d": d, "qs": qs}, dim=dim)


class Q8_0Format(_GGMLBlockFormat):
    """ggml q8_0: 32 values, fp16 d = absmax/127, int8 q = roundf(x/d); 34 B, 8.5 bpv."""

    def __init__(self, name: str = "q8_0", *, check_finite: bool = True):
        super().__init__(name, 32, check_finite=check_finite)

    @property
    def bytes_per_block(self) -> int:
        return 34

    def _spec(self, nb):
        return {"d": ((nb,), torch.float16), "qs": ((nb, 32), torch.int8)}

    def _encode(self, xb, x):
        a = xb.abs()
        d = a.amax(dim=-1) / 127.0
        # Same float32 operations as ggml: quantize with 1/d of the float32 d, store d as fp16.
        inv = _safe_reciprocal(d)
        d16 = self._to_half(d, x)
        # roundf(x * inv) = sign(x) * round_half_away(|x| * inv)  (inv >= 0), computed in place
        a.mul_(inv.unsqueeze(-1))
        fl = torch.floor(a)
        a.sub_(fl).mul_(2).floor_().add_(fl).copysign_(xb)
        return {"d": d16, "qs": a.to(torch.int8)}

    def _decode_padded(self, p):
        d, qs = p["d"], p["qs"]
        y = qs.to(torch.float32) * d.to(torch.float32).unsqueeze(-1)
        return y.reshape(*y.shape[:-2], y.shape[-2] * 32)


class Q4_0Format(_GGMLBlockFormat):
    """ggml q4_0: 32 values, fp16 d = (value of largest magnitude)/-8, nibbles q = min(15, trunc(x/d + 8.5));
    low nibbles hold values 0..15, high nibbles 16..31; 18 B, 4.5 bpv."""

    def __init__(self, name: str = "q4_0", *, check_finite: bool = True):
        super().__init__(name, 32, check_finite=check_finite)

    @property
    def bytes_per_block(self) -> int:
        return 18

    def _spec(self, nb):
        return {"d": ((nb,), torch.float16), "qs": ((nb, 16), torch.uint8)}

    def _encode(self, xb, x):
        a = xb.abs()
        imax = a.argmax(dim=-1, keepdim=True)  # first index on ties, like numpy / ggml
        m = xb.gather(-1, imax).squeeze(-1)
        d = m / -8.0
        d16 = self._to_half(d, x)
        inv = _safe_reciprocal(d)
        v = torch.mul(xb, inv.unsqueeze(-1), out=a)
        v.add_(8.5)  # separate op: no fused multiply-add, like the reference
        q = v.trunc_().clamp_(0, 15).to(torch.uint8)
        return {"d": d16, "qs": pack_bits(q, 4)}

    def _decode_padded(self, p):
        d, qs = p["d"], p["qs"]
        q = unpack_bits(qs, 4).to(torch.float32) - 8.0
        y = d.to(torch.float32).unsqueeze(-1) * q
        return y.reshape(*y.shape[:-2], y.shape[-2] * 32)


# ----------------------------------------------------------------------------------------------------------
# tbq4_0: int4 + fp16 absmax scale per 64 values, optional dither


def _hash_uniform(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random U[-0.5, 0.5) per element of float32 ``x`` [..., nb, B], a hash of
    (value bits, position along the vector, seed).  Pure function of the input: re-encoding a vector
    gives the same codes, and different tokens get independent-looking dither."""
    h = x.contiguous().view(torch.int32).to(torch.int64)
    nb, bs = x.shape[-2], x.shape[-1]
    pos = torch.arange(nb * bs, device=x.device, dtype=torch.int64).view(nb, bs)
    h.bitwise_and_(_M32).bitwise_xor_(((pos * 0x9E3779B1) & _M32) ^ (seed & _M32))
    # lowbias32-style integer mixer; every product stays below 2^59, so no int64 overflow.
    for _ in range(2):
        h.bitwise_xor_(h >> 16).mul_(0x45D9F3B).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 16).bitwise_right_shift_(8)
    return h.to(torch.float32).mul_(1.0 / (1 << 24)).sub_(0.5)


class TBQ4Format(KVFormat):
    """int4 q in [-8, 7] (stored as nibble q + 8, q4_0 nibble order), one fp16 scale S = absmax/7 per 64
    values; q = clamp(round(x/S [+ dither]), -8, 7); 34 B per 64 values, 4.25 bpv.  The optional dither is
    a seeded hash-based U(-0.5, 0.5) (stochastic rounding: unbiased, ~2x the MSE)."""

    def __init__(self, name: str | None = None, *, dither: bool = False, seed: int = DITHER_SEED,
                 check_finite: bool = True):
        super().__init__(name or ("tbq4_0d" if dither else "tbq4_0"), 64, check_finite=check_finite)
        self.dither = dither
        self.seed = seed

    @property
    def bytes_per_block(self) -> int:
        return 34

    def _spec(self, nb):
        return {"d": ((nb,), torch.float16), "qs": ((nb, 32), torch.uint8)}

    def _encode(self, xb, x):
        a = xb.abs()
        s16 = self._to_half(a.amax(dim=-1) / 7.0, x)
        s = s16.to(torch.float32)  # quantize against the stored scale
        inv = _safe_reciprocal(s)
        v = torch.mul(xb, inv.unsqueeze(-1), out=a)
        if self.dither:
            v.add_(_hash_uniform(xb, self.seed))
        q = v.round_().clamp_(-8, 7).add_(8).to(torch.uint8)
        return {"d": s16, "qs": pack_bits(q, 4)}

    def _decode_padded(self, p):
        d, qs = p["d"], p["qs"]
        q = unpack_bits(qs, 4).to(torch.float32) - 8.0
        y = d.to(torch.float32).unsqueeze(-1) * q
        return y.reshape(*y.shape[:-2], y.shape[-2] * 64)


# ----------------------------------------------------------------------------------------------------------
# TurboQuant


_CODEBOOKS: dict = {}
_QJL: dict = {}


def _codebook(bits: int, device: torch.device, d: int = ROT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, boundaries) float32 on ``device`` for the rotated-coordinate law of a d-value block."""

    def make():
        c, b = lloyd_max_codebook(bits, d)
        return (torch.tensor(c, dtype=torch.float32, device=device),
                torch.tensor(b, dtype=torch.float32, device=device))

    return _per_device(_CODEBOOKS, (bits, device, d), make)


QJL_KINDS = ("orthogonal", "gaussian")


def qjl_matrix(device: torch.device | str | None = None, kind: str = "orthogonal", n: int = ROT_BLOCK) -> torch.Tensor:
    """The fixed n x n (default 128 x 128) QJL matrix S (float32), drawn from ``QJL_SEED``.

    ``"gaussian"``: i.i.d. N(0, 1) entries (the paper).  ``"orthogonal"`` (default): sqrt(128) * Q with Q
    the Haar-random orthogonal factor of the same Gaussian draw (QR with the sign fix), i.e. rows that are
    uniformly random directions, like a Gaussian's, but with norm exactly sqrt(128) and mutually orthogonal.
    Both are unbiased in expectation over S (with ``qjl_scale(kind)``); for one fixed matrix the Gaussian
    rows' random norms leave a measurable inner-product bias and ~3x the variance (docs/kv-formats.md).
    """
    if kind not in QJL_KINDS:
        raise ValueError(f"QJL kind must be one of {QJL_KINDS}, got {kind!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def make():
        g = torch.Generator().manual_seed(QJL_SEED)
        gauss = torch.randn(n, n, generator=g, dtype=torch.float64)
        if kind == "gaussian":
            return gauss.to(device=dev, dtype=torch.float32)
        q, r = torch.linalg.qr(gauss)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        return (q.T * math.sqrt(n)).to(device=dev, dtype=torch.float32).contiguous()

    return _per_device(_QJL, (kind, dev, n), make)


def qjl_scale(kind: str = "orthogonal", d: int = ROT_BLOCK) -> float:
    """Dequant constant c with E_S[c * S^T sign(S r)] = r / ||r||.

    Gaussian rows: E[s sign(s.r)] = sqrt(2/pi) r^ so c = sqrt(pi/2) / d (the paper).  Rows of norm sqrt(d)
    in a uniformly random direction: E = sqrt(d) E|v_1| r^ with E|v_1| = Gamma(d/2) / (sqrt(pi)
    Gamma((d+1)/2)), so c = 1 / (d^1.5 E|v_1|)  (= sqrt(pi/2)/d * 0.99805 for d = 128).
    """
    if kind == "gaussian":
        return math.sqrt(math.pi / 2) / d
    if kind == "orthogonal":
        m = math.exp(math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d + 1) / 2))
        return 1.0 / (d ** 1.5 * m)
    raise ValueError(f"QJL kind must be one of {QJL_KINDS}, got {kind!r}")


def _planes(bits: int) -> list[tuple[str, int]]:
    """Bit planes storing a ``bits``-bit index: (field name, plane width)."""
    return {1: [("qs", 1)], 2: [("qs", 2)], 3: [("qs", 2), ("qh", 1)], 4: [("qs", 4)]}[bits]


class TurboFormat(KVFormat):
    """TurboQuant-MSE over 128-value blocks: fp16 norm + ``bits``-bit Lloyd-Max indices of the rotated,
    normalized block.  ``bits`` in 1..4; 3-bit indices are two planes (low 2 bits ``qs``, high bit ``qh``).
    Head sizes that are a multiple of 64 but not of 128 use 64-value blocks (``for_dim``; codebook for the
    d = 64 coordinate law), as the llama.cpp ports fall back to: no padding to 128.

    ``norm_mode`` chooses the stored fp16 scale s (decode = s * centroid[idx], rotated domain):
    ``"plain"`` s = ||x|| (the paper), ``"corrected"`` s = ||x|| / ||c[idx]|| (the llama.cpp ports: the
    decoded block keeps the norm of x), ``"lsq"`` s = <y, c[idx]> / ||c[idx]||^2 (least-squares optimal
    for the chosen indices, the lowest MSE; the default).
    """

    rotated = True

    def __init__(self, bits: int, *, name: str | None = None, norm_mode: str = "lsq",
                 check_finite: bool = True):
        if bits not in (1, 2, 3, 4):
            raise ValueError(f"turbo bits must be 1..4, got {bits}")
        if norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode must be one of {NORM_MODES}, got {norm_mode!r}")
        super().__init__(name or f"turbo{bits}", ROT_BLOCK, check_finite=check_finite)
        self.bits = bits  # total index bits per value
        self.mse_bits = bits  # bits of the Lloyd-Max index
        self.norm_mode = norm_mode
        self._variants: dict[int, TurboFormat] = {ROT_BLOCK: self}

    def for_dim(self, dim: int) -> TurboFormat:
        return self.with_block(rot_block_for(dim))

    def with_block(self, block: int) -> TurboFormat:
        """This format over ``block``-value rotation blocks (128 or 64); shares the variant table."""
        v = self._variants.get(block)
        if v is None:
            v = copy.copy(self)
            v.block_size = block
            self._variants[block] = v
        return v

    def _block_of(self, p: dict[str, torch.Tensor]) -> int:
        field, w = _planes(self.mse_bits)[0]
        return p[field].shape[-1] * 8 // w

    @property
    def bytes_per_block(self) -> int:
        return 2 + self.block_size * self.mse_bits // 8

    def _spec(self, nb):
        spec: StorageSpec = {"norm": ((nb,), torch.float16)}
        for field, w in _planes(self.mse_bits):
            spec[field] = ((nb, self.block_size * w // 8), torch.uint8)
        return spec

    # rotated-domain MSE code; returns (fields, u, norm, s16, c): the unit rotated block u, its norm,
    # the stored scale and the chosen centroids (u and c are scratch buffers the caller may overwrite)
    def _encode_mse(self, xb, x):
        u = torch.matmul(xb, rotation_matrix(xb.device, n=self.block_size).T)  # rotate each block
        norm = torch.linalg.vector_norm(u, dim=-1)
        u.div_(torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1))
        cent, bounds = _codebook(self.mse_bits, xb.device, self.block_size)
        idx = torch.bucketize(u, bounds)
        c = torch.nn.functional.embedding(idx, cent.unsqueeze(-1)).view(u.shape)
        if self.norm_mode == "plain":
            scale = norm
        elif self.norm_mode == "corrected":
            scale = norm / torch.linalg.vector_norm(c, dim=-1)
        else:
            scale = norm * torch.linalg.vecdot(u, c) / torch.linalg.vecdot(c, c)
        s16 = self._to_half(scale, x)
        fields = {"norm": s16}
        codes = idx.to(torch.uint8)
        planes = _planes(self.mse_bits)
        if len(planes) == 1:
            fields[planes[0][0]] = pack_bits(codes, planes[0][1])
        else:
            shift = 0
            for field, w in planes:
                fields[field] = pack_bits((codes >> shift) & ((1 << w) - 1), w)
                shift += w
        return fields, u, norm, s16, c

    def _encode(self, xb, x):
        return self._encode_mse(xb, x)[0]

    def _mse_rotated(self, p) -> torch.Tensor:
        """[..., nb, block] rotated-domain reconstruction s * c[idx]."""
        idx = None
        shift = 0
        for field, w in _planes(self.mse_bits):
            part = unpack_bits(p[field], w)
            idx = part if idx is None else idx.bitwise_or_(part << shift)
            shift += w
        norm = p["norm"]
        cent, _ = _codebook(self.mse_bits, norm.device, self._block_of(p))
        y = torch.nn.functional.embedding(idx.to(torch.int32), cent.unsqueeze(-1)).view(idx.shape)
        return y.mul_(norm.to(torch.float32).unsqueeze(-1))

    def _rotated_blocks(self, p) -> torch.Tensor:
        return self._mse_rotated(p)

    def decode_rotated(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rotated-domain values, float32 [..., padded D] (no inverse transform)."""
        y = self._rotated_blocks(p)
        return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])

    def _decode_padded(self, p):
        return unrotate(self.decode_rotated(p), block=self._block_of(p))


class TurboProdFormat(TurboFormat):
    """TurboQuant-prod: (bits-1)-bit TurboQuant-MSE code + 1-bit QJL sketch of the rotated residual r:
    ``qjl`` = sign bits of S r (S = ``qjl_matrix(kind=qjl)``), ``gamma`` = fp16 ||r||.  Decode adds
    c * gamma * S^T sign(S r) with c = ``qjl_scale(qjl)``, which makes E_S <y, x~> = <y, x>.
    Layout per 128 values: fp16 norm, fp16 gamma, (bits-1)-bit index planes, 16 B of signs (per 64 values
    with 64-value blocks: 8 B of signs, a 64 x 64 S)."""

    def __init__(self, bits: int, *, name: str | None = None, norm_mode: str = "lsq",
                 qjl: str = "orthogonal", check_finite: bool = True):
        if bits not in (2, 3, 4, 5):
            raise ValueError(f"turbo-prod bits must be 2..5, got {bits}")
        if qjl not in QJL_KINDS:
            raise ValueError(f"qjl must be one of {QJL_KINDS}, got {qjl!r}")
        super().__init__(bits - 1, name=name or f"turbo{bits}p", norm_mode=norm_mode,
                         check_finite=check_finite)
        self.bits = bits
        self.qjl = qjl

    @property
    def bytes_per_block(self) -> int:
        return 4 + self.block_size * self.bits // 8

    def _spec(self, nb):
        spec = super()._spec(nb)
        spec["gamma"] = ((nb,), torch.float16)
        spec["qjl"] = ((nb, self.block_size // 8), torch.uint8)
        return spec

    def _encode(self, xb, x):
        fields, u, norm, s16, c = self._encode_mse(xb, x)
        r = u.mul_(norm.unsqueeze(-1)).sub_(c.mul_(s16.to(torch.float32).unsqueeze(-1)))  # rotated residual
        fields["gamma"] = self._to_half(torch.linalg.vector_norm(r, dim=-1), x)
        z = torch.matmul(r, qjl_matrix(xb.device, self.qjl, self.block_size).T)  # S r per block
        fields["qjl"] = pack_bits(z >= 0, 1)
        return fields

    def _rotated_blocks(self, p):
        base = self._mse_rotated(p)
        signs = unpack_bits(p["qjl"], 1).to(torch.float32).mul_(2).sub_(1)
        n = signs.shape[-1]
        gamma = p["gamma"].to(torch.float32) * qjl_scale(self.qjl, n)
        sketch = torch.matmul(signs, qjl_matrix(signs.device, self.qjl, n))  # (S^T sign) per block
        return base.add_(sketch.mul_(gamma.unsqueeze(-1)))


# ----------------------------------------------------------------------------------------------------------
# registry


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
