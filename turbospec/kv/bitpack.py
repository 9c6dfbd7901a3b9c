"""Bit-plane packing of small unsigned codes into uint8 bytes (vectorized, no Python loops over data).

Layout (the ggml q4_0 convention, generalized): a row of ``n`` codes with ``bits`` bits each is packed
into ``n * bits / 8`` bytes; with ``k = 8 // bits`` codes per byte, byte ``j`` holds codes
``j, j + n/k, j + 2n/k, ...`` at bit offsets ``0, bits, 2*bits, ...``.  For 4 bits and n = 32 this is
exactly q4_0: low nibbles = first 16 values, high nibbles = last 16 values.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits"]


def _check(bits: int, n: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    k = 8 // bits
    if n % k:
        raise ValueError(f"row length {n} is not a multiple of {k} ({bits}-bit codes)")
    return k


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] integer tensor with values in [0, 2**bits) -> uint8 [..., n * bits // 8]."""
    n = codes.shape[-1]
    k = _check(bits, n)
    c = codes.to(torch.uint8)
    if k == 1:
        return c
    c = c.reshape(*codes.shape[:-1], k, n // k)
    shifts = (torch.arange(k, device=codes.device, dtype=torch.uint8) * bits).view(k, 1)
    # Bit fields do not overlap, so a sum is the same as an OR.
    return (c << shifts).sum(dim=-2, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint8 [..., m] -> uint8 codes [..., m * 8 // bits]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    k = _check(bits, 8)
    if k == 1:
        return packed
    shifts = (torch.arange(k, device=packed.device, dtype=torch.uint8) * bits).view(k, 1)
    mask = (1 << bits) - 1
    out = packed.unsqueeze(-2) >> shifts
    out.bitwise_and_(mask)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * k)
