"""Verification of a draft tree against the target's logits: greedy or lossless sampling."""

from __future__ import annotations

import torch

from turbospec.sampling import Sampler, probs_from_logits
from turbospec.speculative.tree import DraftTree


def verify(tree: DraftTree, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """Walk the tree from the root; return (accepted node indices root-to-leaf, the next token to emit).

    logits[0] is the target's row at the root (the last emitted token), logits[1 + i] the row after node i.
    Greedy: follow the child equal to the target's argmax. Sampling: where a child has a draft distribution q
    (drafts sampled from the drafter's distribution), the children are tried in order, each accepted with
    probability min(1, p/q) and p replaced by norm(max(p - q, 0)) after a rejection (Leviathan et al. for one
    child, SpecInfer's recursive rejection for several; a child without q counts as one-hot); when every child is
    deterministic the target samples x ~ p and the walk continues if x is one of them (the same rule, in one draw).
    Both keep the output distribution exactly p. The sampler's penalty window is advanced token by token, and each emitted
    token's logprobs (when asked for) come from the row it was chosen at, with the bias and penalties applied.
    """
    path: list[int] = []
    node, row = -1, 0
    while True:
        kids = tree.children(node)
        if kids and not sampler.params.greedy and any(tree.q[k] is not None for k in kids):
            k, nxt = _recursive_rejection(tree, kids, logits[row], sampler)
            if k is None:
                return path, nxt
            path.append(k)
            node, row = k, 1 + k
            continue
        x = sampler.sample(logits[row])
        match = next((k for k in kids if tree.tokens[k] == x), None)
        if match is None:
            return path, x
        path.append(match)
        node, row = match, 1 + match


def _recursive_rejection(tree: DraftTree, kids: list[int], logits: torch.Tensor,
                         sampler: Sampler) -> tuple[int | None, int]:
    """Children drawn independently, child k from its q (one-hot for a deterministic child), tried in order:
    accepted with min(1, p(x) / q(x)); on a rejection p becomes norm(max(p - q, 0)) (SpecInfer's multi-draft rule,
    exact for any q). Returns (the accepted child, its token) or (None, a token from the last residual)."""
    processed = sampler.process(logits)
    p = probs_from_logits(processed, sampler.params)
    for k in kids:
        x = tree.tokens[k]
        q = tree.q[k]
        qx = float(q[x]) if q is not None else 1.0
        u = float(torch.rand((), generator=sampler.generator, device=sampler.generator.device))
        if qx > 0 and u < min(1.0, float(p[x]) / qx):
            sampler.chose(x, processed)
            return k, x
        if q is None:
            resid = p.clone()
            resid[x] = 0.0
        else:
            resid = torch.clamp(p - q, min=0)
        total = float(resid.sum())
        if total <= 0:  # p is covered by what was rejected: sample p itself (cannot happen for exact draws)
            break
        p = resid / total
    nxt = int(torch.multinomial(p, 1, generator=sampler.generator))
    sampler.chose(nxt, processed)
    return None, nxt
