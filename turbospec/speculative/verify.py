"""Verification of a draft tree against the target's logits: greedy or lossless sampling."""

from __future__ import annotations

import torch

from turbospec.sampling import Sampler, probs_from_logits
from turbospec.speculative.tree import DraftTree


def verify(tree: DraftTree, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """Walk the tree from the root; return (accepted node indices root-to-leaf, the next token to emit).

    logits[0] is the target's row at the root (the last emitted token), logits[1 + i] the row after node i.
    Greedy: follow the child equal to the target's argmax. Sampling: at each node, a child with a draft
    distribution q (chains from probabilistic drafters) is accepted with probability min(1, p/q) and on
    rejection the next token comes from norm(max(p - q, 0)) (Leviathan et al.); children without q are
    deterministic candidates: the target samples x ~ p and the walk continues if x is one of them. Both keep
    the output distribution exactly p. The sampler's penalty window is advanced token by token, and each emitted
    token's logprobs (when asked for) come from the row it was chosen at, with the bias and penalties applied.
    """
    path: list[int] = []
    node, row = -1, 0
    while True:
        kids = tree.children(node)
        q = tree.q[kids[0]] if len(kids) == 1 and not sampler.params.greedy else None
        if q is not None:  # one child with a draft distribution: accept with min(1, p/q)
            k = kids[0]
            processed = sampler.process(logits[row])
            p = probs_from_logits(processed, sampler.params)
            x = tree.tokens[k]
            u = float(torch.rand((), generator=sampler.generator))
            if float(q[x]) > 0 and u < min(1.0, float(p[x]) / float(q[x])):
                sampler.chose(x, processed)
                path.append(k)
                node, row = k, 1 + k
                continue
            resid = torch.clamp(p - q, min=0)
            if float(resid.sum()) <= 0:
                resid = p
            nxt = int(torch.multinomial(resid / resid.sum(), 1, generator=sampler.generator))
            sampler.chose(nxt, processed)
            return path, nxt
        x = sampler.sample(logits[row])
        match = next((k for k in kids if tree.tokens[k] == x), None)
        if match is None:
            return path, x
        path.append(match)
        node, row = match, 1 + match
