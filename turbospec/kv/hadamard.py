"""Randomized Walsh-Hadamard rotation used by the turbo* KV formats.

Per block of ``ROT_BLOCK`` = 128 values:  y = D2 . (H / sqrt(128)) . D1 . x  with H the Sylvester
Hadamard matrix and D1, D2 fixed diagonal +-1 sign matrices drawn from ``torch.Generator`` seeded with
``ROT_SEED``.  The map is orthonormal, so  <rotate(q), rotate(k)> == <q, k>.  Vectors whose length is
not a multiple of 128 are zero-padded to the next multiple (``rotate`` returns the padded length,
``unrotate(y, dim)`` cuts back).

The 128x128 matrix is applied as one matmul: on CPU and GPU that is faster than a 7-stage butterfly
written in torch ops, and it is exactly the same linear map.
"""

from __future__ import annotations

import math
from functools import cache

import torch

__all__ = [
    "ROT_BLOCK",
    "ROT_SEED",
    "hadamard_matrix",
    "padded_dim",
    "rotate",
    "rotation_matrix",
    "rotation_signs",
    "unrotate",
]

ROT_BLOCK = 128
ROT_SEED = 42


def padded_dim(dim: int, block: int = ROT_BLOCK) -> int:
    """Smallest multiple of ``block`` that is >= dim."""
    return -(-dim // block) * block


def hadamard_matrix(n: int) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard matrix of order n (a power of two), float64 entries +-1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@cache
def rotation_signs(n: int = ROT_BLOCK, seed: int = ROT_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed sign vectors (s1, s2), float64 entries +-1, shape [n] each."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2, (2, n), generator=g).to(torch.float64) * 2 - 1
    return s[0], s[1]


@cache
def _rotation_matrix_f64(n: int, seed: int) -> torch.Tensor:
    s1, s2 = rotation_signs(n, seed)
    return s2[:, None] * hadamard_matrix(n) * s1[None, :] / math.sqrt(n)


_MATS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def rotation_matrix(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R (ROT_BLOCK x ROT_BLOCK) with rotate(x) = x @ R.T per block; R is orthogonal."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (dev, dtype)
    m = _MATS.get(key)
    if m is None:
        m = _rotation_matrix_f64(ROT_BLOCK, ROT_SEED).to(device=dev, dtype=dtype).contiguous()
        _MATS[key] = m
    return m


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _apply(x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    xb = x.reshape(*lead, x.shape[-1] // ROT_BLOCK, ROT_BLOCK)
    return torch.matmul(xb, mat).reshape(*lead, x.shape[-1])


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x blockwise.  x: [..., D] -> [..., padded_dim(D)].

    Floating inputs keep their dtype (computed in float32, float64 stays float64); integer inputs
    give float32.
    """
    if x.shape[-1] == 0:
        raise ValueError("rotate: last dim must be non-empty")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    cd = _compute_dtype(x)
    xf = x.to(cd)
    dp = padded_dim(x.shape[-1])
    if dp != x.shape[-1]:
        xf = torch.nn.functional.pad(xf, (0, dp - x.shape[-1]))
    # rotate(x) = x @ R^T
    y = _apply(xf, rotation_matrix(x.device, cd).T)
    return y.to(out_dtype)


def unrotate(y: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Inverse of ``rotate``.  y: [..., Dp] with Dp a multiple of 128 -> [..., dim or Dp]."""
    dp = y.shape[-1]
    if dp == 0 or dp % ROT_BLOCK:
        raise ValueError(f"unrotate: last dim must be a positive multiple of {ROT_BLOCK}, got {dp}")
    if dim is not None and not 0 < dim <= dp:
        raise ValueError(f"unrotate: dim must be in 1..{dp}, got {dim}")
    out_dtype = y.dtype if y.is_floating_point() else torch.float32
    cd = _compute_dtype(y)
    x = _apply(y.to(cd), rotation_matrix(y.device, cd))
    if dim is not None and dim != dp:
        x = x[..., :dim]
    return x.to(out_dtype)
