"""Unquantized storage: f32, f16, bf16."""

from __future__ import annotations

import torch

from turbospec.kv.formats.base import KVFormat, StorageSpec


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
