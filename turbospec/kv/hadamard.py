"""Randomized Walsh-Hadamard rotation used by the turbo* KV formats.

Per block of n values:  y = D2 . (H / sqrt(n)) . D1 . x  with H the Sylvester Hadamard matrix and D1, D2
fixed diagonal +-1 sign matrices drawn from ``torch.Generator`` seeded with ``ROT_SEED``.  The map is
orthonormal, so  <rotate(q), rotate(k)> == <q, k>.

The block is ``ROT_BLOCK`` = 128 values, or 64 for head sizes that are a multiple of 64 but not of 128
(head_dim 64, 192: the TurboQuant ports' fallback, which avoids padding a 64-value head to 128 and doubling
its storage and work); see ``rot_block_for``.  Other lengths are zero-padded to a multiple of 128
(``rotate`` returns the padded length, ``unrotate(y, dim)`` cuts back).

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
    "rot_block_for",
    "rotate",
    "rotation_matrix",
    "rotation_signs",
    "unrotate",
]

ROT_BLOCK = 128
SMALL_ROT_BLOCK = 64
ROT_SEED = 42


def rot_block_for(dim: int) -> int:
    """Rotation block for vectors of length ``dim``: 128, or 64 when 64 divides dim and 128 does not.
    (rot_block_for(padded_dim(dim, rot_block_for(dim))) == rot_block_for(dim), so a padded length names its
    block too.)"""
    return SMALL_ROT_BLOCK if dim % ROT_BLOCK and dim % SMALL_ROT_BLOCK == 0 else ROT_BLOCK


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
    s = torch.randint(0, 2, (2, n), generator=g, device="cpu").to(torch.float64) * 2 - 1
    return s[0], s[1]


@cache
def _rotation_matrix_f64(n: int, seed: int) -> torch.Tensor:
    s1, s2 = rotation_signs(n, seed)
    with torch.device("cpu"):  # a constant: the same bits on every device
        return s2[:, None] * hadamard_matrix(n) * s1[None, :] / math.sqrt(n)


_MATS: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def rotation_matrix(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                    n: int = ROT_BLOCK) -> torch.Tensor:
    """R (n x n) with rotate(x) = x @ R.T per block of n values; R is orthogonal."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (dev, dtype, n)
    m = _MATS.get(key)
    if m is None:
        m = _rotation_matrix_f64(n, ROT_SEED).to(device=dev, dtype=dtype).contiguous()
        _MATS[key] = m
    return m


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _apply(x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    n = mat.shape[0]
    xb = x.reshape(*lead, x.shape[-1] // n, n)
    return torch.matmul(xb, mat).reshape(*lead, x.shape[-1])


def rotate(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Rotate the last dim of x blockwise (block ``rot_block_for(D)``).  x: [..., D] -> [..., padded length].

    Floating inputs keep their dtype (computed in float32, float64 stays float64); integer inputs
    give float32.
    """
    if x.shape[-1] == 0:
        raise ValueError("rotate: last dim must be non-empty")
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    cd = _compute_dtype(x)
    xf = x.to(cd)
    n = block or rot_block_for(x.shape[-1])
    dp = padded_dim(x.shape[-1], n)
    if dp != x.shape[-1]:
        xf = torch.nn.functional.pad(xf, (0, dp - x.shape[-1]))
    # rotate(x) = x @ R^T
    y = _apply(xf, rotation_matrix(x.device, cd, n).T)
    return y.to(out_dtype)


def unrotate(y: torch.Tensor, dim: int | None = None, block: int | None = None) -> torch.Tensor:
    """Inverse of ``rotate``.  y: [..., Dp] (a padded length: a multiple of 128, or of 64) -> [..., dim or Dp]."""
    dp = y.shape[-1]
    if dp == 0 or dp % (block or SMALL_ROT_BLOCK):
        raise ValueError(f"unrotate: last dim must be a positive multiple of {block or SMALL_ROT_BLOCK}, got {dp}")
    if dim is not None and not 0 < dim <= dp:
        raise ValueError(f"unrotate: dim must be in 1..{dp}, got {dim}")
    out_dtype = y.dtype if y.is_floating_point() else torch.float32
    cd = _compute_dtype(y)
    x = _apply(y.to(cd), rotation_matrix(y.device, cd, block or rot_block_for(dp)))
    if dim is not None and dim != dp:
        x = x[..., :dim]
    return x.to(out_dtype)
