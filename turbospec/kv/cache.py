"""Preallocated per-sequence KV cache with committed positions, a scratch area and commit/compaction."""

from __future__ import annotations

import torch

from turbospec import env
from turbospec.errors import TurboSpecError


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU cache buffer, in transparent huge pages when the kernels are here (attention at depth
    streams the cache every step; see docs/speed.md); `TURBOSPEC_NO_HUGEPAGES=1` gives plain torch.zeros."""
    from turbospec.kernels.gemv import load_kernel

    k = load_kernel() if env.HUGEPAGES else None
    return k.hugepage_zeros(list(shape), dtype) if k is not None else torch.zeros(shape, dtype=dtype)


class CachePositions:
    """Bookkeeping shared by every attention-KV store: `length` committed positions, then `pending` scratch
    positions. A step writes its N new tokens at [length, length + N) (scratch); `commit()` keeps all of them,
    `commit(keep)` keeps only the listed scratch indices (in order), compacting them to [length, length + j).

    Subclasses set `max_len` and implement `buffers()`: every storage tensor, positions on dim 2.
    """

    max_len: int
    length: int
    pending: int
    base: int  # first attended position (drafters may skip a prompt prefix)
    prefix_reusable = True

    @property
    def step_rows(self) -> int:
        return self.max_len

    def buffers(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def fields(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """K and V storage by field name, [layers, kv heads, max_len, ...] (slot files)."""
        raise NotImplementedError

    def load(self, k: dict[str, torch.Tensor], v: dict[str, torch.Tensor]) -> None:
        """Replace the context by n positions given as `fields()` slices [layers, kv heads, n, ...]."""
        n = next(iter(k.values())).shape[2]
        if n > self.max_len:
            raise TurboSpecError(f"{n} positions do not fit the context size {self.max_len} (raise -c)")
        self.reset()
        mine_k, mine_v = self.fields()
        for mine, got in ((mine_k, k), (mine_v, v)):
            for name, t in mine.items():
                t[:, :, :n].copy_(got[name])
        self.length = n

    def begin(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise TurboSpecError(
                f"context full: {self.length} cached + {n} new tokens > context size {self.max_len} (raise -c)"
            )
        self.pending = n

    def commit(self, keep: list[int] | None = None) -> None:
        if keep is None:
            self.length += self.pending
        else:
            if keep != list(range(len(keep))):
                src = torch.tensor(keep, dtype=torch.int64, device=self.buffers()[0].device) + self.length
                dst = slice(self.length, self.length + len(keep))
                for buf in self.buffers():
                    buf[:, :, dst] = buf[:, :, src]
            self.length += len(keep)
        self.pending = 0

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
        self.base = 0

    def resume_point(self, n: int) -> int:
        return max(0, min(n, self.length))

    def checkpoint(self) -> None:
        pass

    def truncate(self, n: int) -> None:
        """Drop committed positions >= n (prefix reuse between requests, drafters' own caches)."""
        self.length = min(self.length, n)
        self.pending = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def bytes_per_token(self) -> int:
        return self.nbytes // self.max_len


class KVCache(CachePositions):
    """Attention KV for one sequence in a plain float dtype (the fast default path)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype):
        self.max_len = max_len
        self.dtype = dtype
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = zeros(shape, dtype)
        self.v = zeros(shape, dtype)
        self.length = 0
        self.pending = 0
        self.base = 0  # first attended position (drafters may skip a prompt prefix)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.k, self.v)

    def fields(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {"data": self.k}, {"data": self.v}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, N, D] in scratch; return views over committed + scratch positions."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]
