"""ggml's q8_0 and q4_0 blocks, bit-exact with ggml / the ``gguf`` package (see ``to_ggml_bytes``)."""

from __future__ import annotations

import torch

from turbospec.kv.bitpack import pack_bits, unpack_bits
from turbospec.kv.formats.base import KVFormat, Packed, _safe_reciprocal


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
