"""Chains of drafters: the first one with a non-empty draft wins (or, merged, every draft verified as one tree); all
of them see every accept()."""

from __future__ import annotations

import torch

from turbospec.sampling import SamplingParams
from turbospec.speculative.drafter import Drafter, propose_all
from turbospec.speculative.tree import DraftTree, merge


class ChainDrafter(Drafter):
    """caps[i]: the deepest draft member i may propose (the engine asks for up to the largest). merge: every member
    drafts each step and their drafts are verified together as one tree (`tree.merge`)."""

    name = "chain"

    def __init__(self, drafters: list[Drafter], caps: list[int] | None = None, merge: bool = False):
        self.drafters = drafters
        self.caps = caps or [1 << 30] * len(drafters)
        self.merge = merge
        self.needs_hidden = any(d.needs_hidden for d in drafters)
        self._last: Drafter | None = None  # the member whose draft the last step took

    def prompt_rows(self, n: int) -> int | None:
        """The most trailing prompt rows any member reads (None: all)."""
        rows = [d.prompt_rows(n) for d in self.drafters if d.needs_hidden]
        return None if any(r is None for r in rows) else max((r for r in rows if r is not None), default=1)

    def sampling(self, params: SamplingParams) -> None:
        for d in self.drafters:
            d.sampling(params)

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        for d in self.drafters:
            d.begin(tokens, hidden)

    def widths(self) -> int:
        return max(d.widths() for d in self.drafters)

    def set_width(self, width: int) -> None:
        for d in self.drafters:
            d.set_width(width)

    def ranked(self) -> list[list[int]]:
        """The ranked candidates of the member whose draft the last step took (none for merged drafts)."""
        return self._last.ranked() if self._last is not None else []

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        return self.propose_many([self], [tokens], [n_max])[0]

    def batch_key(self) -> object:
        return ("chain", self.merge, len(self.drafters))  # chains of a batch: their members draft together

    def propose_many(self, drafters: list, tokens: list[list[int]], n_max: list[int]) -> list[DraftTree]:
        """Each chain's draft, member by member for all the chains at once (`propose_all`: the MTP members of a
        batch together); each chain's members are asked (or synced) in the order they are alone."""
        chains: list[ChainDrafter] = drafters
        for c in chains:
            c._last = None
        every = range(len(chains))
        if self.merge:
            drafts = [propose_all([c.drafters[m] for c in chains], tokens,
                                  [min(n, c.caps[m]) for c, n in zip(chains, n_max)]) for m in range(len(self.drafters))]
            return [merge([d[i] for d in drafts]) for i in every]
        best = [DraftTree() for _ in chains]
        for m in range(len(self.drafters)):
            todo = [i for i in every if not len(best[i])]
            for i in every:
                if len(best[i]):
                    chains[i].drafters[m].sync(tokens[i])  # keep its state current without drafting
            made = propose_all([chains[i].drafters[m] for i in todo], [tokens[i] for i in todo],
                               [min(n_max[i], chains[i].caps[m]) for i in todo])
            for i, tree in zip(todo, made):
                if len(tree):
                    best[i], chains[i]._last = tree, chains[i].drafters[m]
        return best

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        for d in self.drafters:
            d.accept(committed, hidden, next_token)

    def finish(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.finish(tokens)
