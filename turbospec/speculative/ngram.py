"""N-gram drafters: prompt lookup over the context, and an ngram-mod style rolling-hash pool."""

from __future__ import annotations

import torch

from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree


class PromptLookup(Drafter):
    """Find the most recent earlier occurrence of the last n tokens (n from n_max down to n_min) and propose
    the tokens that followed it (transformers' prompt lookup / llama.cpp ngram-simple)."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            pat = tokens[L - n:]
            for s in range(L - n - 1, -1, -1):  # most recent match first
                if tokens[s:s + n] == pat:
                    follow = tokens[s + n:s + n + n_max]
                    if follow:
                        return DraftTree.chain(follow, source=self.name)
        return DraftTree()


class NgramMod(Drafter):
    """Rolling hash of the last n_match tokens -> the token that followed, in a fixed-size pool (llama.cpp
    ngram-mod). Drafts chain lookups up to n_max tokens; proposes nothing when fewer than n_min would come.

    The pool starts empty for each request, so one client's text never drafts (or times) another's; `shared`
    keeps it across requests as llama.cpp does (repeated or similar requests then draft from earlier ones)."""

    name = "ngram-mod"
    needs_hidden = False

    def __init__(self, n_match: int = 8, n_min: int = 1, n_max: int = 16, pool_bits: int = 20,
                 shared: bool = False):
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.shared = shared
        self.mask = (1 << pool_bits) - 1
        self.pool = torch.full((1 << pool_bits,), -1, dtype=torch.int32, device="cpu")  # host-side: read per token
        self.seen = 0

    def _hash(self, toks: list[int]) -> int:
        h = 1469598103934665603
        for t in toks:
            h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
        return h & self.mask

    def _add(self, tokens: list[int]) -> None:
        for end in range(max(self.seen, self.n), len(tokens)):
            self.pool[self._hash(tokens[end - self.n:end])] = tokens[end]
        self.seen = max(self.seen, len(tokens))

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self.seen = 0
        if not self.shared:
            self.pool.fill_(-1)
        self._add(tokens)

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        self._add(tokens)
        ctx = list(tokens[-self.n:])
        if len(ctx) < self.n:
            return DraftTree()
        out: list[int] = []
        for _ in range(min(n_max, self.n_max)):
            t = int(self.pool[self._hash(ctx[-self.n:])])
            if t < 0:
                break
            out.append(t)
            ctx.append(t)
        if len(out) < self.n_min:
            return DraftTree()
        return DraftTree.chain(out, source=self.name)
