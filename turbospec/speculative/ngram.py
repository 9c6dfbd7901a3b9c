"""N-gram drafters: prompt lookup over the context, and an ngram-mod style rolling-hash pool."""

from __future__ import annotations

import torch

from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree
from turbospec.tokens import common_prefix, kept


class PromptLookup(Drafter):
    """Find the most recent earlier occurrence of the last n tokens (n from n_max down to n_min) and propose
    the tokens that followed it (transformers' prompt lookup / llama.cpp ngram-simple).

    The starts of every n-gram's occurrences are kept in a table that follows the context (a scan back through it at
    every step took 20 ms at 64K tokens and 80 ms at 262K): a step indexes its new tokens, and a new request keeps
    what its tokens share with the last request's (a conversation's next turn, the same prompt again) and indexes
    the rest."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self._seen: list[int] = []  # the tokens indexed (a copy: the engine's context list grows in place)
        # n-gram -> the start of its one occurrence, or the starts of its occurrences, oldest first (most n-grams of
        # a long context occur once: an int each, not a list, keeps the table at 262K tokens ~60 MB smaller)
        self._starts: dict[tuple[int, ...], int | list[int]] = {}

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self._follow(tokens, len(tokens), check=True)  # (counted in prefill, not in the first step)

    def _grams(self, end: int) -> range:
        """The lengths of the indexed n-grams that end at `end`."""
        return range(self.n_min, min(self.n_max, end) + 1)

    def _follow(self, tokens: list[int], upto: int, check: bool = False) -> None:
        """Make the table that of tokens[:upto]. Within a request the tokens only grow (`check`: compare them all,
        else only the last token indexed)."""
        seen, starts = self._seen, self._starts
        keep = kept(seen, tokens, upto, check)
        for end in range(len(seen), keep, -1):  # what the tokens no longer share; each list's last start ends here
            for n in self._grams(end):
                key = tuple(seen[end - n:end])
                occ = starts[key]
                if isinstance(occ, int):
                    del starts[key]
                else:
                    occ.pop()
                    if len(occ) == 1:
                        starts[key] = occ[0]
        del seen[keep:]
        first = len(seen)
        seen.extend(tokens[first:upto])
        for n in range(self.n_min, self.n_max + 1):  # the n-grams ending after `first`, their tuples made by zip
            lo = max(first + 1, n) - n
            for s, key in enumerate(zip(*(seen[lo + j:] for j in range(n))), lo):
                occ = starts.get(key)
                if occ is None:
                    starts[key] = s
                elif isinstance(occ, int):
                    starts[key] = [occ, s]
                else:
                    occ.append(s)

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        self._follow(tokens, len(tokens) - 1)  # (an occurrence must be followed by a token: the last one is not)
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            occ = self._starts.get(tuple(tokens[L - n:]))
            if occ is not None:  # the most recent earlier occurrence
                s = occ if isinstance(occ, int) else occ[-1]
                return DraftTree.chain(tokens[s + n:s + n + n_max], source=self.name)
        return DraftTree()


VECTOR_MIN = 256  # NgramMod adds this many positions or more with tensor ops


class NgramMod(Drafter):
    """Rolling hash of the last n_match tokens -> the token that followed, in a fixed-size pool (llama.cpp
    ngram-mod). Drafts chain lookups up to n_max tokens; proposes nothing when fewer than n_min would come.

    The pool starts empty for each request, so one client's text never drafts (or times) another's -- unless the
    request continues the last one (a conversation's next turn: the pool holds only its own tokens then, and it adds
    just the new ones); `shared` keeps it across requests as llama.cpp does (repeated or similar requests then draft
    from earlier ones)."""

    name = "ngram-mod"
    needs_hidden = False

    def __init__(self, n_match: int = 8, n_min: int = 1, n_max: int = 16, pool_bits: int = 20,
                 shared: bool = False):
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.shared = shared
        self.mask = (1 << pool_bits) - 1
        self.pool = torch.full((1 << pool_bits,), -1, dtype=torch.int32, device="cpu")  # host-side: read per token
        self.added: list[int] = []  # the tokens whose windows are in the pool (this request's, or the last one's)

    def _hash(self, toks: list[int]) -> int:
        h = 1469598103934665603
        for t in toks:
            h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
        return h & self.mask

    def _add(self, tokens: list[int]) -> None:
        first = max(len(self.added), self.n)
        if len(tokens) - first >= VECTOR_MIN:
            self._add_many(tokens, first)
        else:
            for end in range(first, len(tokens)):
                self.pool[self._hash(tokens[end - self.n:end])] = tokens[end]
        self.added.extend(tokens[len(self.added):])

    def _add_many(self, tokens: list[int], first: int) -> None:
        """`_add`'s writes for the positions from `first` on, as tensor ops (a 64K-token prompt took ~210 ms token by
        token): every window's hash at once (int64 arithmetic wraps as the 64-bit hash does), then per pool slot
        the token after its last window, as the writes in order leave it."""
        t = torch.tensor(tokens[first - self.n:], dtype=torch.int64)
        ends = t.numel() - self.n  # windows t[i:i + n] for i < ends, each followed by t[i + n]
        h = torch.full((ends,), 1469598103934665603, dtype=torch.int64)
        for j in range(self.n):
            h = (h ^ (t[j:j + ends] + 1)) * 1099511628211
        slot = h & self.mask
        pos = torch.arange(ends, dtype=torch.int64)
        last = torch.full((self.mask + 1,), -1, dtype=torch.int64).scatter_reduce(0, slot, pos, "amax")
        hit = (last >= 0).nonzero().squeeze(1)
        self.pool[hit] = t[last[hit] + self.n].to(torch.int32)

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        # (shared: the prompt's windows are written again, over what other requests wrote since)
        if self.shared or common_prefix(self.added, tokens) < len(self.added):
            self.added = []
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
