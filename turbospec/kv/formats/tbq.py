"""tbq4_0 / tbq4_0d: int4 codes + an fp16 absmax scale per 64 values, optionally with a seeded dither."""

from __future__ import annotations

import torch

from turbospec.kv.bitpack import pack_bits, unpack_bits
from turbospec.kv.formats.base import KVFormat, _safe_reciprocal

DITHER_SEED = 0x5EED
_M32 = 0xFFFFFFFF


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
