"""The drafter interface: what every drafter (MTP, Medusa, n-gram, draft model, chains) provides to the engine."""

from __future__ import annotations

from typing import Protocol

import torch

from turbospec.sampling import SamplingParams
from turbospec.speculative.tree import DraftTree


class Drafter(Protocol):
    """Proposes candidate tokens as a `DraftTree`; is told what the target accepted.

    Drafters subclass this protocol, which gives them the defaults below for the optional parts.

    name: the label in statistics (`by_source`).
    needs_hidden: begin() and accept() receive the target's final hidden rows (MTP, Medusa); otherwise None.
    """

    name: str
    needs_hidden: bool

    def prompt_rows(self, n: int) -> int | None:
        """How many trailing rows of an n-token prompt begin() reads (None: all of them), so that the target
        computes no others in its last layer. Only asked when `needs_hidden`."""
        return None

    def sampling(self, params: SamplingParams) -> None:
        """The request's sampling settings, before begin(): drafters that can draw their drafts from their own
        distribution (and pass it as the tree's q) do so when the request samples."""
        return None

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """After prefill, with the prompt tokens and the target's hidden rows for them (or None)."""
        return None

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        """A draft of at most n_max tokens deep, given every token so far (the last one is emitted but not yet
        in the target's cache)."""
        ...

    def batch_key(self) -> object | None:
        """Drafters whose keys are equal draft together in a batch (`propose_many`: the MTP drafters of one block,
        one forward per depth for all of them; chains of drafters, member by member); None: this one drafts alone."""
        return None

    def propose_many(self, drafters: list, tokens: list[list[int]], n_max: list[int]) -> list[DraftTree]:
        """`propose` of each of `drafters` (this one's batch_key) for its sequence's tokens and depth."""
        return [d.propose(t, n) for d, t, n in zip(drafters, tokens, n_max)]

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        """After verification, with the tokens committed this step (the root token plus accepted drafts) and the
        target's hidden rows for them; `next_token` (the bonus) is not yet committed. Several steps may arrive in
        one call (adaptive speculation's undrafted steps are told together before the next draft): their tokens in
        order, their rows, and the last step's next token -- the same as those steps told one by one."""
        return None

    def widths(self) -> int:
        """The most candidates per depth this drafter drafts (its tree width: `--spec-mtp-topk`); 1: chains."""
        return 1

    def set_width(self, width: int) -> None:
        """Draft at most `width` candidates per depth from now on (1..widths(); adaptive speculation narrows the
        tree where its alternatives do not pay)."""
        return None

    def ranked(self) -> list[list[int]]:
        """Of the last draft, per depth the drafter's best candidates, best first: widths() of them, drafted or not
        (adaptive speculation learns from them whether wider drafts would pay); [] when unknown."""
        return []

    def sync(self, tokens: list[int]) -> None:
        """Keep internal state current on a step where another drafter of a chain drafted (default: nothing)."""
        return None

    def finish(self, tokens: list[int]) -> None:
        """The request ended with these tokens (prompt and output); drafters that learn across requests keep them."""
        return None


def propose_all(drafters: list[Drafter], tokens: list[list[int]], n_max: list[int]) -> list[DraftTree]:
    """`propose` of every drafter (a batch's sequences, each with its tokens and depth), those that share a
    `batch_key` together."""
    trees: list[DraftTree | None] = [None] * len(drafters)
    groups: dict[object, list[int]] = {}
    for i, d in enumerate(drafters):
        key = d.batch_key()
        if key is None:
            trees[i] = d.propose(tokens[i], n_max[i])
        else:
            groups.setdefault(key, []).append(i)
    for idx in groups.values():
        made = drafters[idx[0]].propose_many([drafters[i] for i in idx], [tokens[i] for i in idx],
                                             [n_max[i] for i in idx])
        for i, t in zip(idx, made):
            trees[i] = t
    return trees  # type: ignore[return-value]
