"""The `KVFormat` base class, the `Packed` container and the helpers the codecs share."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from turbospec.kv.hadamard import padded_dim

StorageSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


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


class KVFormat(ABC):
    """A KV-cache storage format (see the `turbospec.kv.formats` docstring)."""

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
