"""Draft trees: candidate tokens with parent links; a chain is a tree whose parents are i - 1."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Nodes in topological order. parents[i] = index of the parent node, or -1 when the parent is the root
    (the last emitted token, which is not part of the tree). q[i] = the drafter's distribution at node i's
    parent position (the row node i was drawn from), or None for deterministic drafts (treated as one-hot)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], q: list[torch.Tensor | None] | None = None, source: str = "") -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(q) if q else [None] * len(tokens), source)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depth(self, node: int) -> int:
        d = 0
        while node >= 0:
            node = self.parents[node]
            d += 1
        return d

    def truncate(self, n: int) -> DraftTree:
        """The first n nodes (still a valid tree: parents precede children)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.q[:n], self.source)

    def limit(self, max_depth: int, max_nodes: int) -> DraftTree:
        """Nodes at depth <= max_depth, then the first max_nodes of them (parents re-indexed)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        if max(depths, default=0) <= max_depth:
            return self.truncate(max_nodes) if len(self) > max_nodes else self
        keep = [i for i, d in enumerate(depths) if d <= max_depth][:max(max_nodes, 0)]
        new = {old: j for j, old in enumerate(keep)}
        return DraftTree([self.tokens[i] for i in keep], [new.get(self.parents[i], -1) for i in keep],
                         [self.q[i] for i in keep], self.source)


def merge(trees: list[DraftTree]) -> DraftTree:
    """One tree holding every path of `trees` (a prefix they share once), shallower nodes first so that `limit`
    keeps the first levels of each. Nodes are deterministic (q None) when more than one tree contributes."""
    trees = [t for t in trees if len(t)]
    if len(trees) <= 1:
        return trees[0] if trees else DraftTree()
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    node: dict[tuple[int, int], int] = {}  # (parent, token) -> merged node
    for t in trees:
        mapped: list[int] = []
        for tok, p in zip(t.tokens, t.parents):
            key = (mapped[p] if p >= 0 else -1, tok)
            if key not in node:
                node[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
                depth.append(0 if key[0] < 0 else depth[key[0]] + 1)
            mapped.append(node[key])
    order = sorted(range(len(tokens)), key=lambda i: depth[i])  # stable: parents stay before children
    new = {old: j for j, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order], [new[parents[i]] if parents[i] >= 0 else -1 for i in order],
                     [None] * len(order), "+".join(t.source for t in trees))


def topk_tree(first: list[int], rest: list[list[int]]) -> DraftTree:
    """A small 'top-k at depth 1' tree: k alternatives for the first token, the best of them continued by `rest`.

    first: candidate tokens for depth 1, best first; rest: continuation chain after first[0].
    """
    tokens = [first[0]]
    parents = [-1]
    for j, t in enumerate(rest):
        tokens.append(t[0] if isinstance(t, list) else t)
        parents.append(j)
    for alt in first[1:]:
        tokens.append(alt)
        parents.append(-1)
    return DraftTree(tokens, parents, [None] * len(tokens))
