"""Suffix drafter (SuffixDecoding-style): the longest earlier occurrences of the context's last tokens, in the
request's own prompt and output and optionally in earlier requests of the same server, and a tree of what followed
them, branches weighted by how often each continuation occurred.

Occurrences are found through hash tables of short and long n-grams (the end positions of every n-gram), then
each candidate's match is extended backwards token by token; the draft grows with the match (up to `factor` times
the matched length, at most `n_max` nodes), so a one-off bigram drafts a token or two and a copied span of a file
drafts a long run.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree
from turbospec.tokens import common_prefix

LONG = 8  # the long n-gram table's key length: found first, so long matches are not lost among common bigrams
SCAN = 32  # most recent occurrences read per table and step
MAX_MATCH = 64  # matches are measured up to this many tokens


class SuffixIndex:
    """Token sequences (documents) with the end positions of every `short`- and LONG-gram, newest last."""

    def __init__(self, short: int = 2):
        self.short = short
        self.tokens: list[int] = []  # documents back to back, each followed by -1 (never matches a token)
        self.starts: list[int] = []  # where each document begins
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after its occurrences
        self.seen = 0  # tokens indexed

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Append a whole document."""
        self.starts.append(len(self.tokens))
        self.tokens.extend(tokens)
        self._index()
        self.tokens.append(-1)
        self.seen = len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Grow the last document to `tokens` (which starts with what the document holds)."""
        if not self.starts:
            self.starts.append(0)
        have = len(self.tokens) - self.starts[-1]
        self.tokens.extend(tokens[have:])
        self._index()

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of a one-document index (a drafter's own context), and their n-grams."""
        t = self.tokens
        assert self.starts == [0] and n <= len(t)
        for end in range(len(t), n, -1):  # each list's last end is this one
            for g in (self.short, LONG):
                if end - g >= 0:
                    key = tuple(t[end - g:end])
                    occ = self.ends[key]
                    occ.pop()
                    if not occ:
                        del self.ends[key]
        del t[n:]
        self.seen = n + 1

    def _index(self) -> None:
        t, first = self.tokens, self.starts[-1]
        for end in range(max(self.seen, first + self.short), len(t) + 1):
            for n in (self.short, LONG):
                if end - n >= first:
                    self.ends.setdefault(tuple(t[end - n:end]), []).append(end)
        self.seen = len(t) + 1

    def matches(self, pattern: Sequence[int], before: int | None = None) -> list[tuple[int, int]]:
        """(match length, end position) of the most recent occurrences of pattern's tail, longest first; an
        occurrence must end before `before` (default: anywhere) and be followed by a token."""
        t = self.tokens
        limit = len(t) if before is None else before
        found: dict[int, int] = {}
        for n in (LONG, self.short):
            if len(pattern) < n:
                continue
            ends = self.ends.get(tuple(pattern[-n:]))
            if not ends:
                continue
            scanned = 0
            for end in reversed(ends):
                if end >= limit or end >= len(t) or t[end] < 0 or end in found:
                    continue
                m = n
                while m < MAX_MATCH and m < len(pattern) and end - m - 1 >= 0 and t[end - m - 1] == pattern[-m - 1]:
                    m += 1
                found[end] = m
                scanned += 1
                if scanned >= SCAN:
                    break
            if n == LONG and found:
                break  # long matches found: the bigram table would add only shorter ones
        return sorted(((m, e) for e, m in found.items()), reverse=True)

    def follow(self, end: int, n: int, before: int | None = None) -> list[int]:
        """Up to n tokens from `end`, stopping at a document's end. An occurrence that runs into `before` (the
        context's own end: the text repeats with period before - end) goes on periodically."""
        t = self.tokens
        stop = len(t) if before is None else min(before, len(t))
        out: list[int] = []
        for i in range(end, end + n):
            if i >= stop:
                if before is None or i < before:
                    break
                out.append(out[i - before])  # = the token `before - end` positions earlier
                continue
            if t[i] < 0:
                break
            out.append(t[i])
        return out


class SuffixStore:
    """Earlier requests' token sequences, shared by the drafters of one server (`--spec-suffix-shared`); the
    oldest are dropped once it holds more than `max_tokens`."""

    def __init__(self, max_tokens: int = 1 << 18, short: int = 2):
        self.max_tokens, self.short = max_tokens, short
        self.docs: list[list[int]] = []
        self.index = SuffixIndex(short)

    def add(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        self.docs.append(list(tokens[-self.max_tokens:]))
        if sum(len(d) for d in self.docs) > self.max_tokens:  # drop the oldest, re-index what stays
            while len(self.docs) > 1 and sum(len(d) for d in self.docs) > self.max_tokens // 2:
                self.docs.pop(0)
            self.index = SuffixIndex(self.short)
            for d in self.docs[:-1]:
                self.index.add(d)
        self.index.add(self.docs[-1])


class SuffixDrafter(Drafter):
    """Drafts from the longest earlier matches of the context's suffix: a chain where one continuation follows
    them, a tree where they disagree (each node kept while its share of the matches is at least `p_min`)."""

    name = "suffix"
    needs_hidden = False

    def __init__(self, n_max: int = 24, factor: float = 1.0, p_min: float = 0.1, n_min: int = 2,
                 store: SuffixStore | None = None):
        self.n_max, self.factor, self.p_min, self.n_min = n_max, factor, p_min, n_min
        self.store = store
        self.local = SuffixIndex(n_min)

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        # what the request shares with the last one (a conversation's next turn, the same prompt again) stays
        # indexed: indexing a 64K-token prompt took ~0.3 s
        keep = common_prefix(self.local.tokens, tokens)
        if 2 * keep < len(self.local.tokens):  # (fewer tokens to index afresh than to drop)
            self.local = SuffixIndex(self.n_min)
        elif keep < len(self.local.tokens):
            self.local.truncate(keep)
        self.local.extend(tokens)

    def sync(self, tokens: list[int]) -> None:
        self.local.extend(tokens)

    def finish(self, tokens: list[int]) -> None:
        if self.store is not None:
            self.store.add(tokens)

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        self.local.extend(tokens)
        pattern = tokens[-MAX_MATCH:]
        L = len(tokens)
        cands = [(m, e, self.local) for m, e in self.local.matches(pattern, before=L)]
        if self.store is not None:
            cands += [(m, e, self.store.index) for m, e in self.store.index.matches(pattern)]
        if not cands:
            return DraftTree()
        best = max(c[0] for c in cands)
        if best < self.n_min:
            return DraftTree()
        size = min(n_max, self.n_max, max(1, int(self.factor * best)))
        top = [c for c in cands if c[0] == best]
        return self._tree([idx.follow(e, size, before=L if idx is self.local else None) for _, e, idx in top], size)

    def _tree(self, runs: list[list[int]], size: int) -> DraftTree:
        """The most likely `size` nodes of the trie of `runs` (likelihood: the share of runs through a node)."""
        trie: list[dict[int, list]] = [{}]  # node -> {token: [count, child node]}
        for run in runs:
            node = 0
            for t in run:
                kid = trie[node].setdefault(t, [0, len(trie)])
                if kid[1] == len(trie):
                    trie.append({})
                kid[0] += 1
                node = kid[1]
        total = len(runs)
        tree = DraftTree(source=self.name)
        # most likely first; among equals the shallower (then the more recent match's) node
        heap = [(-c / total, 1, trie_node, tok, -1, c) for tok, (c, trie_node) in trie[0].items()]
        heapq.heapify(heap)
        while heap and len(tree) < size:
            neg_p, depth, trie_node, tok, parent, count = heapq.heappop(heap)
            if -neg_p < self.p_min:
                break
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.q.append(None)
            here = len(tree) - 1
            for t2, (c2, n2) in trie[trie_node].items():
                heapq.heappush(heap, (neg_p * c2 / count, depth + 1, n2, t2, here, c2))
        return tree
