"""A separate, smaller draft model with the same tokenizer."""

from __future__ import annotations

import torch

from turbospec.kv.plan import AttentionPlan
from turbospec.model.base import Model
from turbospec.sampling import argmax
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree
from turbospec.tokens import kept


class DraftModelDrafter(Drafter):
    """Greedy chain drafts from a draft model; its cache mirrors the target's committed tokens."""

    name = "draft"
    needs_hidden = False

    def __init__(self, model: Model, max_len: int, p_min: float = 0.0, k_type: str | None = None,
                 v_type: str | None = None):
        self.model = model
        # (a hybrid draft model keeps its recurrent states at its last prompts' ends: the same prompt again resumes)
        self.cache = model.new_cache(max_len, k_type=k_type, v_type=v_type, checkpoints=2)
        self.p_min = p_min
        self.tokens: list[int] = []  # tokens whose KV is in the draft cache

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        # what the draft cache shares with the prompt stays, as in the target's cache: a conversation's next turn
        # feeds only its new tokens (the whole prompt was fed again every request: minutes at long context)
        self._follow(tokens, len(tokens) - 1, check=True)
        self.cache.checkpoint()

    def _follow(self, tokens: list[int], upto: int, check: bool = False) -> torch.Tensor | None:
        """Bring the draft cache to tokens[:upto]: keep the prefix it shares with them (within a request the tokens
        only grow: `check` compares them all, else only the last one fed), feed the rest; the last fed row's hidden
        state (None: nothing new)."""
        have = self.tokens
        n = kept(have, tokens, upto, check)
        if n < self.cache.length:
            n = self.cache.resume_point(n)  # (recurrent states go back only to a checkpoint, else to 0)
            self.cache.truncate(n)
        del have[n:]
        return self._feed(tokens[n:upto])

    def _feed(self, toks: list[int]) -> torch.Tensor | None:
        h = None
        for s in range(0, len(toks), 512):
            chunk = torch.tensor(toks[s:s + 512], dtype=torch.int64)
            h = self.model.forward(chunk, AttentionPlan.causal(self.cache.length, chunk.numel()), self.cache)
            self.cache.commit()
        self.tokens += toks
        return h

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        h = self._follow(tokens, len(tokens))  # (the root at least is new)
        assert h is not None
        committed = self.cache.length
        out: list[int] = []
        for i in range(n_max):
            logits = self.model.logits(h[-1:])[0]
            tok = argmax(logits)
            if self.p_min > 0 and float(torch.softmax(logits, -1)[tok]) < self.p_min:
                break
            out.append(tok)
            if i + 1 == n_max:
                break
            if self.cache.prefix_reusable:  # one row per draft, cut back afterwards
                h = self.model.forward(torch.tensor([tok]), AttentionPlan.causal(self.cache.length, 1), self.cache)
                self.cache.commit()
            else:  # recurrent state: the drafts so far as one scratch step, dropped (a hybrid keeps no prefix)
                h = self.model.forward(torch.tensor(out), AttentionPlan.causal(committed, len(out)), self.cache)
                self.cache.commit([])
        if self.cache.prefix_reusable:
            self.cache.truncate(committed)
        return DraftTree.chain(out, source=self.name)

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        pass
