"""TurboQuant: turbo2/3/4 (MSE: norm + Hadamard rotation + Lloyd-Max codebook) and turbo2p/3p/4p (prod:
an MSE code plus a 1-bit QJL sketch of the residual)."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from turbospec.kv.bitpack import pack_bits, unpack_bits
from turbospec.kv.formats.base import KVFormat, StorageSpec, _per_device
from turbospec.kv.hadamard import ROT_BLOCK, rot_block_for, rotation_matrix, unrotate
from turbospec.kv.lloyd_max import lloyd_max_codebook

QJL_SEED = 1042
NORM_MODES = ("plain", "corrected", "lsq")


_CODEBOOKS: dict = {}
_QJL: dict = {}


# Index bits whose codebooks lie on an int8 grid: 3- and 4-bit turbo keys are scored with int8 products (_codebook).
INT8_GRID_BITS = (3, 4)


def int8_grid(c: np.ndarray) -> np.ndarray:
    """Centroids moved to the nearest multiple of unit = max|c| / 127 (float32 arithmetic): c = code * unit with
    integer codes in [-127, 127]."""
    c32 = np.asarray(c, dtype=np.float32)
    unit = np.float32(np.abs(c32).max()) / np.float32(127)
    return (np.rint(c32 / unit) * unit).astype(np.float32)


def _codebook(bits: int, device: torch.device, d: int = ROT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, boundaries) float32 on ``device`` for the rotated-coordinate law of a d-value block.

    The 3- and 4-bit codebooks' centroids sit on an int8 grid (`int8_grid`; each moves by at most 1/254 of the
    largest, the boundaries are the new midpoints; the expected distortion grows by 0.10% / 0.20% for 4 bits at
    d = 128 / 64, by less for 3), so that the attention kernels score those keys with int8 dot products
    (turbospec/kernels/attention.cpp `score_turbo_vnni`) and every path decodes the same values."""

    def make():
        c, b = lloyd_max_codebook(bits, d)
        if bits in INT8_GRID_BITS:
            c = int8_grid(c)
            b = (c[1:] + c[:-1]) * np.float32(0.5)
        return (torch.tensor(c, dtype=torch.float32, device=device),
                torch.tensor(b, dtype=torch.float32, device=device))

    return _per_device(_CODEBOOKS, (bits, device, d), make)


QJL_KINDS = ("orthogonal", "gaussian")


def qjl_matrix(device: torch.device | str | None = None, kind: str = "orthogonal",
               n: int = ROT_BLOCK) -> torch.Tensor:
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
        gauss = torch.randn(n, n, generator=g, dtype=torch.float64, device="cpu")
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
