"""Chains of drafters: the first one with a non-empty draft wins (or, merged, every draft verified as one tree); all
of them see every accept()."""

from __future__ import annotations

import torch

from turbospec.sampling import SamplingParams
from turbospec.speculative.drafter import Drafter
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
        self._last = None
        if self.merge:
            return merge([d.propose(tokens, min(n_max, cap)) for d, cap in zip(self.drafters, self.caps)])
        best = DraftTree()
        for d, cap in zip(self.drafters, self.caps):
            if len(best):
                d.sync(tokens)  # keep its state current without drafting
                continue
            best = d.propose(tokens, min(n_max, cap))
            if len(best):
                self._last = d
        return best

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        for d in self.drafters:
            d.accept(committed, hidden, next_token)

    def finish(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.finish(tokens)
