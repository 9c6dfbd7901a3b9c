"""The cache interface: the per-sequence state a model reads and writes in a forward pass.

Every cache holds `length` committed positions and, during a step, `pending` scratch positions after them.
A step calls `begin(n)`, the model writes its n new positions to scratch, and the engine calls `commit()` (keep
all) or `commit(keep)` (keep the listed scratch indices, in order: the accepted path of a draft tree). Nothing
else rewrites committed positions, except `truncate` where `prefix_reusable` says it is possible.
"""

from __future__ import annotations

from typing import Protocol


class Cache(Protocol):
    max_len: int
    # committed positions can be cut back to a prefix (attention KV can; recurrent states cannot)
    prefix_reusable: bool
    # most positions one step may add and still keep any subset of them (`commit(keep)`): a verification step's limit
    # (attention KV: max_len; recurrent states: the rows whose states a step keeps)
    step_rows: int

    @property
    def length(self) -> int:
        """Committed positions."""
        ...

    def begin(self, n: int) -> None:
        """Open n scratch positions after the committed ones (a one-line error when the context is full)."""
        ...

    def commit(self, keep: list[int] | None = None) -> None:
        """Keep every scratch position (None) or only the listed scratch indices, compacted in order."""
        ...

    def reset(self) -> None:
        """Forget every position."""
        ...

    def truncate(self, n: int) -> None:
        """Keep only the first n committed positions (n >= length, or n a `resume_point`)."""
        ...

    def resume_point(self, n: int) -> int:
        """The longest prefix of at most n committed positions that `truncate` keeps exactly (every n for attention
        KV; for recurrent states, the committed length or a checkpoint's, else 0)."""
        ...

    def checkpoint(self) -> None:
        """Remember the committed positions as a point to resume from later (a no-op where every prefix is one)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held, as allocated (what `fit` and `bench` report)."""
        ...

    def bytes_per_token(self) -> int:
        """Bytes per context position of the part that grows with context."""
        ...
