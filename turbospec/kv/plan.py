"""Attention plans: which cached and new positions each new token may attend to."""

from __future__ import annotations

import torch


class AttentionPlan:
    """For N new tokens appended after `start` committed positions.

    mask is None for a plain causal step (prefill chunk, decode, chain verification); otherwise a bool
    [N, start + N] matrix, True where attention is allowed (tree verification). `positions` (int64 [N], the
    tokens' RoPE positions) is built on first use for consecutive positions (`first`, first + 1, ...): a decode
    step's fused path only needs `first` (RoPE tables are then slices), and creating tensors costs ~5-10 us each.
    """

    __slots__ = ("_positions", "first", "mask", "n", "parents", "start")

    def __init__(self, positions: torch.Tensor | None, start: int, mask: torch.Tensor | None = None,
                 parents: list[int] | None = None, first: int | None = None, n: int | None = None):
        if positions is None and (first is None or n is None):
            raise ValueError("an AttentionPlan needs positions, or first and n")
        self._positions = positions
        self.start = start
        self.mask = mask
        self.parents = parents  # tree steps: parent index of each node (-1: the committed context)
        self.first = first  # positions are first, first + 1, ... when set
        self.n = int(positions.numel()) if positions is not None else int(n)

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = torch.arange(self.first, self.first + self.n, dtype=torch.int64)
        return self._positions

    @classmethod
    def causal(cls, start: int, n: int, first: int | None = None) -> AttentionPlan:
        """N tokens after `start` cached ones, each seeing the cache and the tokens before it; RoPE positions
        first .. first + N - 1 (default: start .., i.e. the cache index is the position)."""
        return cls(None, start, first=start if first is None else first, n=n)

    @classmethod
    def tree(cls, start: int, parents: list[int], device: torch.device | None = None) -> AttentionPlan:
        """Tree nodes in topological order; parents[i] is the index of node i's parent or -1 for a root. `device`:
        where the mask and positions live (None: torch's default device)."""
        n = len(parents)
        rows: list[list[bool]] = []
        for i, p in enumerate(parents):
            if p >= i:
                raise ValueError("tree nodes must be in topological order (parent before child)")
            row = list(rows[p]) if p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=device)
        mask[:, start:] = torch.tensor(rows, dtype=torch.bool, device=device)
        pos = torch.tensor(tree_positions(start, parents), dtype=torch.int64, device=device)
        return cls(pos, start, mask, list(parents))

    def sdpa_mask(self, device: torch.device | None = None) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for F.scaled_dot_product_attention over start + N keys (a mask built on
        `device`)."""
        if self.mask is not None:
            return self.mask, False
        n = self.n
        if n == 1:
            return None, False
        if self.start == 0:
            return None, True
        keys = torch.arange(self.start + n, device=device)
        rows = torch.arange(self.start, self.start + n, device=device)
        return keys[None, :] <= rows[:, None], False


def tree_positions(start: int, parents: list[int]) -> list[int]:
    """RoPE positions of a token tree's nodes after `start` cached ones (topological order, parents[i] < i, -1: a
    root): each node at start + its depth."""
    depth: list[int] = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 0)
    return [start + d for d in depth]
