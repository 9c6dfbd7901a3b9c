"""MTP drafting: chains (or top-k trees) from recursing the model's own multi-token-prediction block."""

from __future__ import annotations

import math
import secrets

import torch

from turbospec import device, env
from turbospec.kv.base import Cache
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.linear import Linear, LinearRows, skinny_rows
from turbospec.model.mtp import MTPModule
from turbospec.sampling import SamplingParams, argmax
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree

# most waiting (hidden, token) pairs fed when the MTP drafts after steps it did not draft (other drafters of a chain
# drafted, or adaptive speculation's plain steps before a probe): each costs a row of the MTP layer (a probe on the
# bundled model at 8K: ~0.45 ms with 4, ~1 ms with 16), and probes every 8 or 32 steps hit about as often with 4 as
# with 16 (hit rates over seven prompts 0.975 / 0.962 against 0.975 / 0.981)
CATCH_UP = 4


class MTPDrafter(Drafter):
    """Drafts a chain of up to n_max tokens by recursing the MTP block.

    The MTP cache holds one entry per target position j < L (pairs (h_j, x_{j+1})); drafted entries are scratch
    and dropped after each step. `prompt_window` limits how many prompt positions are fed to the MTP at begin()
    (0 = all) so prompt processing is not slowed down by drafting.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, mtp: MTPModule, max_len: int, p_min: float = 0.0, prompt_window: int = 0,
                 k_type: str | None = None, v_type: str | None = None,
                 draft_vocab: int = 0, topk: int = 1, ranked_vocab: list[int] | None = None,
                 sample: bool = True):
        self.mtp = mtp
        # sample: when the request samples, drafts are drawn from the MTP's distribution under the request's
        # settings and passed as the tree's q (accepted with min(1, p/q): more than an argmax draft at T > 0)
        self.sample = sample
        self.params: SamplingParams | None = None
        self.device = device.current()  # where its tensors live (a draft step makes them with the default-device hook off)
        self.generator = torch.Generator(device=self.device)
        # topk > 1: a tree -- at every depth the top-k candidates of the MTP's distribution; the best one is
        # continued (one MTP step per depth, as for a chain), the others are leaves that cost only a verify row
        self.topk = max(1, topk)
        self.width = self.topk  # candidates drafted per depth now (adaptive speculation narrows it: set_width)
        self._ranked: list[list[int]] = []  # per depth of the last draft, the top-k candidates (greedy, topk > 1)
        # Reduced-vocabulary drafting (as FR-Spec): score only `draft_vocab` tokens -- the most frequent ones of the
        # training text when the model ships a ranking (draft_vocab.json, `ranked_vocab`), else the lowest ids
        # (byte-level BPE assigns ids in merge order, a rough frequency order); verification stays exact.
        # The draft head and the MTP's own matrices are read in bf16 where that is exact (a bf16 checkpoint run in
        # float32): bit-identical drafts from half the bytes.
        self.full_head = mtp.draft_head()
        vocab = self.full_head.out_features
        # reduced vocabulary: the base set, plus every token of the request's context as it arrives (a document's
        # own identifiers are rare in the training text but copied often); rows gathered from the bf16 head
        self.reduced = 0 < draft_vocab < vocab
        self._base = set((ranked_vocab or range(vocab))[:draft_vocab]) if self.reduced else set()
        self._ids: set[int] = set(self._base)  # the reduced vocabulary: the base set and the context's tokens
        # the same set as a mask over the ids: its set entries, ascending, are the head's rows (a few new ids mark
        # it; a list of thousands of ids sorted and made a tensor again each time the vocabulary grew took ~0.6 ms)
        self._base_mask = torch.zeros(vocab if self.reduced else 0, dtype=torch.bool, device=self.device)
        self._base_mask[torch.tensor(sorted(self._base), dtype=torch.int64, device=self.device)] = True
        self._inside = self._base_mask.clone()
        self._head_ids: list[int] | None = None  # head row -> token id (reduced vocabulary; made when asked for)
        self._head_rows = torch.zeros(0, dtype=torch.int64, device=self.device)  # head row -> token id
        # (the union of a batch's vocabularies it was last drafted with, its head rows then, its columns in it)
        self._columns: tuple = (None, None, None)
        self._reduced_head: Linear | LinearRows | None = None  # rows of full_head (in place on the CPU)
        self._outside: torch.Tensor | None = None  # ids outside the reduced vocabulary while the full head stands in
        self._stale_head = False  # tokens joined the vocabulary since the head rows were gathered
        mtp.compact_weights()
        self.cache = mtp.new_cache(max_len, k_type=k_type, v_type=v_type)
        self.p_min = p_min
        self.prompt_window = prompt_window
        self.pending_tokens: list[int] = []  # x_{j+1} of true pairs not yet in the MTP cache
        self.pending_hidden: list[torch.Tensor] = []  # h_j rows for them (the last one waits for its token)
        self._waiting = 0  # rows in pending_hidden
        self.offset = 0  # target position of MTP cache entry 0

    def sampling(self, params: SamplingParams) -> None:
        self.params = None if params.greedy or not self.sample else params
        if self.params is not None:
            # a stream of its own: the draws must not be correlated with the target sampler's (seeded by params.seed)
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            self.generator.manual_seed((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 63))

    def _draws(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """The depth's candidates (token ids) and the distribution they were drawn from over the whole vocabulary
        (None: argmax / top-k, deterministic)."""
        if self.params is None:
            rows = logits.topk(self.topk).indices.tolist() if self.topk > 1 else [argmax(logits)]
            return (rows if self._reduced_head is None else [int(self._head_rows[r]) for r in rows]), None
        # q: the request's temperature over the top-k (40 when unset) candidates above min-p, without top-p: any q
        # keeps verification exact, and this one costs a few small ops per depth instead of the sampler's filters
        p = self.params
        vals, rows_t = logits.topk(min(p.top_k if p.top_k > 0 else 40, logits.numel()))
        scaled = (vals - vals[0]) / max(p.temperature, 1e-6)
        if p.min_p > 0:
            scaled = scaled.masked_fill(vals < vals[0] + math.log(p.min_p), -math.inf)
        q_top = torch.softmax(scaled, -1)
        picks = torch.multinomial(q_top, self.topk, replacement=True, generator=self.generator).tolist()
        ids = rows_t if self._reduced_head is None else self._head_rows[rows_t]
        full = torch.zeros(self.full_head.out_features, device=q_top.device)
        full[ids] = q_top
        return [int(ids[i]) for i in picks], full

    def widths(self) -> int:
        return self.topk

    def set_width(self, width: int) -> None:
        self.width = max(1, min(width, self.topk))

    def ranked(self) -> list[list[int]]:
        return self._ranked

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits of the MTP output rows h (over the reduced vocabulary's rows when there is one; when the
        full head stands in for it, the ids outside it at -inf: the same drafts)."""
        self._gather_head()
        if self._reduced_head is not None:
            return self._reduced_head(h)
        logits = self.full_head(h)
        return logits if self._outside is None else logits.masked_fill(self._outside, float("-inf"))

    @property
    def head_ids(self) -> list[int] | None:
        """Head row -> token id (reduced vocabulary; None: the full one)."""
        self._gather_head()
        if self._reduced_head is None:
            return None
        if self._head_ids is None:
            self._head_ids = self._head_rows.tolist()
        return self._head_ids

    def _add_vocab(self, tokens: list[int]) -> None:
        """Grow the reduced vocabulary by the tokens not yet in it (the head rows are gathered when next drafted
        from: a step that does not draft, adaptive speculation's plain steps, copies nothing)."""
        if not self.reduced:
            return
        new = set(tokens) - self._ids
        if not new and (self._reduced_head is not None or self._outside is not None or self._stale_head):
            return
        self._ids |= new
        if new:
            ids = torch.tensor(list(new), dtype=torch.int64, device=self.device)
            self._inside[ids] = True
            if self._outside is not None:  # the full head stands in: unmask the new ids (nothing to gather)
                self._outside[ids] = False
                return
        self._stale_head = True

    def _gather_head(self) -> None:
        if not self._stale_head:
            return
        self._stale_head = False
        n, vocab = len(self._ids), self.full_head.out_features
        if n >= vocab or (2 * n >= vocab and not self.full_head.takes_in_place):
            # the whole vocabulary, or most of it where the reduced head would be a copy of its rows (a random or
            # very long context): the full head and a mask. Rows read in place cost what they are, fewer than all
            # of them less than the full head and a mask (4.9K of 8K rows of the default model's: 49 us against 92)
            self._head_ids, self._reduced_head = None, None
            self._outside = None if n >= vocab else ~self._inside
            return
        self._outside = None
        self._head_rows = self._inside.nonzero().squeeze(1)  # ascending: ties go to the lower id, as over the whole
        self._head_ids = None  # vocabulary
        self._reduced_head = self.full_head.take(self._head_rows)  # re-taken as tokens arrive

    def window(self, n: int) -> int:
        """Prompt positions fed to the MTP for an n-token prompt (0: all): `prompt_window`, or for -1 (auto) a
        quarter of the prompt between 64 and 256 -- the MTP pass and the target rows it reads then cost <= ~6% of
        prefill (at 512 tokens a 256-position window cost 13%, docs/speculative.md)."""
        if self.prompt_window >= 0:
            return self.prompt_window
        return min(256, max(64, n // 4))

    def prompt_rows(self, n: int) -> int | None:
        """Trailing prompt rows `begin` reads: the prompt window's pairs plus the last row (None: all)."""
        w = self.window(n)
        return w + 1 if w > 0 else None

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Feed the prompt's pairs (h_j, x_{j+1}) to the MTP now, so prompt processing is counted as prefill."""
        assert hidden is not None and 0 < hidden.shape[0] <= len(tokens)
        self._ids = set(self._base)
        self._inside.copy_(self._base_mask)
        self._reduced_head, self._outside = None, None
        self._add_vocab(tokens)
        self.cache.reset()
        n = len(tokens)
        # hidden may cover only the last rows (the engine reused a cached prompt prefix, or read only the window's):
        # its row i is position first + i (indexed in place: never padded to the whole prompt, which at 262K
        # positions of a 5120-wide model would be gigabytes)
        first = n - hidden.shape[0]
        start = first
        w = self.window(n)
        if w > 0:
            start = max(start, n - 1 - w)
        # MTP cache entry i holds target position i + offset: skipped prompt positions take no cache room and
        # need no mask (RoPE gets the true positions from the plan)
        self.offset = start
        chunk = 512
        for s in range(start, n - 1, chunk):
            e = min(s + chunk, n - 1)
            toks = torch.tensor(tokens[s + 1:e + 1], dtype=torch.int64, device=hidden.device)
            # (only the K/V of these rows are read later: one row goes on past the attention)
            self.mtp.forward(toks, hidden[s - first:e - first], _plan(self.cache, s, e - s), self.cache, out_rows=1)
            self.cache.commit()
        self.pending_tokens = []
        self.pending_hidden = [hidden[-1:]]
        self._waiting = 1

    @property
    def next_pos(self) -> int:
        """Target position of the next pair fed to the MTP."""
        return self.cache.length + self.offset

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        return self.propose_many([self], [tokens], [n_max])[0]

    def batch_key(self) -> object:
        return self.mtp  # the drafters of one MTP block draft together

    def propose_many(self, drafters: list, tokens: list[list[int]], n_max: list[int]) -> list[DraftTree]:
        """The drafts of several sequences' MTP drafters (this one's block): per depth one MTP forward over every
        sequence still drafting (each attends over its own MTP cache) and the draft head over their rows in one
        product (`_heads`); a lone drafter's forward as before. Each draft is the one its drafter draws alone (the
        same arithmetic per row, where the fused calls take the rows)."""
        ds: list[MTPDrafter] = drafters
        h = _first_rows(ds, tokens)
        committed = [d.cache.length for d in ds]
        nodes: list[list[int]] = [[] for _ in ds]
        parents: list[list[int]] = [[] for _ in ds]
        qs: list[list[torch.Tensor | None]] = [[] for _ in ds]
        spine = [-1] * len(ds)  # per drafter, tree index of the last drafted top-1 token (topk = 1: a chain)
        for d in ds:
            d._ranked = []
        active = [a for a in range(len(ds)) if n_max[a] > 0]  # drafters still drafting; row j of h is active[j]'s
        if len(active) < len(ds):
            h = h[active]
        for i in range(max(n_max, default=0)):
            logits = _heads([ds[a] for a in active], h)
            rows, toks = [], []
            for j, a in enumerate(active):
                d = ds[a]
                top, q = d._draws(logits[j])
                if d.p_min > 0 and float(torch.softmax(logits[j], -1).max()) < d.p_min:
                    continue
                if q is None and d.topk > 1:  # greedy: the ranked candidates, drafted or not
                    d._ranked.append(top)
                tok, top = top[0], top[:d.width]
                nodes[a] += top
                parents[a] += [spine[a]] * len(top)
                qs[a] += [q] * len(top)
                spine[a] = len(nodes[a]) - len(top)
                if i + 1 < n_max[a]:
                    rows.append(j)
                    toks.append(tok)
            if not rows:
                break
            active = [active[j] for j in rows]
            more = [ds[a] for a in active]
            h = ds[0].mtp.forward_many(toks, h if len(rows) == h.shape[0] else h[rows],
                                       [_plan(d.cache, d.next_pos, 1) for d in more], [d.cache for d in more],
                                       [1] * len(more), step=i + 1)
            for d in more:
                d.cache.commit()
        for d, n in zip(ds, committed):
            d.cache.length = n  # drop speculative MTP entries
        return [DraftTree(n, p, q, self.name) for n, p, q in zip(nodes, parents, qs)]

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        # committed = [root, d1..dj] at target positions L..L+j with hidden rows h_L..h_{L+j}
        assert hidden is not None and hidden.shape[0] == len(committed)
        self._add_vocab(committed + [next_token])
        if self._waiting > len(self.pending_tokens):  # the MTP did not draft this step: root completes the waiting pair
            self.pending_tokens.append(committed[0])
        self.pending_tokens += committed[1:]
        self.pending_hidden.append(hidden)
        self._waiting += hidden.shape[0]
        # while other drafters of a chain draft, only the last CATCH_UP pairs wait (the skipped positions take no
        # cache room, as the prompt's outside the window): a long accepted run costs the MTP at most that many rows
        skip = len(self.pending_tokens) - CATCH_UP
        if skip > 0:
            self.pending_tokens = self.pending_tokens[skip:]
            self.offset += skip
            self._waiting -= skip
            while skip:  # the first `skip` hidden rows go (no copy of the others: this runs on every undrafted step)
                first = self.pending_hidden[0]
                if first.shape[0] <= skip:
                    self.pending_hidden.pop(0)
                    skip -= first.shape[0]
                else:
                    self.pending_hidden[0] = first[skip:]
                    skip = 0


def _first_rows(ds: list[MTPDrafter], tokens: list[list[int]]) -> torch.Tensor:
    """Each drafter's waiting true pairs plus (h_{L-1}, root) into its MTP cache, all in one forward; the last MTP
    output row of each [S, H]."""
    toks = [t for d, ts in zip(ds, tokens) for t in d.pending_tokens + [ts[-1]]]
    hid = torch.cat([r for d in ds for r in d.pending_hidden], 0)
    counts = [len(d.pending_tokens) + 1 for d in ds]
    assert all(sum(r.shape[0] for r in d.pending_hidden) == n for d, n in zip(ds, counts))
    # (the waiting pairs' rows only store their K/V: a probe after 4 of them takes ~0.7x the time it took when they
    # went through the whole layer)
    out = ds[0].mtp.forward_many(toks, hid, [_plan(d.cache, d.next_pos, n) for d, n in zip(ds, counts)],
                                 [d.cache for d in ds], counts, last_only=True)
    # everything but the root pair is final; the root pair is final too (root is emitted, h is the target's)
    for d in ds:
        d.cache.commit()
        d.pending_tokens, d.pending_hidden, d._waiting = [], [], 0
    return out


def _heads(ds: list[MTPDrafter], h: torch.Tensor) -> list[torch.Tensor]:
    """Draft logits (float32, 1-D) of row j of h under drafter ds[j]'s head, each as that drafter's own head gives
    them. The drafters whose head is the whole draft head (no reduced vocabulary, or one so large that the whole
    head and a mask stand in) in one product of it over their rows; those whose reduced vocabularies are rows of it
    read in place (`LinearRows`) in one product over the union of their rows, each taking its own columns; any
    other (rows copied out of a packed head) through its own head."""
    if len(ds) == 1:
        return [ds[0].head(h).float()[0]]
    for d in ds:
        d._gather_head()
    out: list[torch.Tensor | None] = [None] * len(ds)
    whole = [j for j, d in enumerate(ds) if d._reduced_head is None]
    for part in _parts(whole, skinny_rows(h.dtype)):
        y = ds[part[0]].full_head(h[part]).float()
        for r, j in enumerate(part):
            mask = ds[j]._outside
            out[j] = y[r] if mask is None else y[r].masked_fill(mask, float("-inf"))
    inplace = [j for j, d in enumerate(ds) if isinstance(d._reduced_head, LinearRows)]
    for part in _parts(inplace, env.SKINNY_MAX_ROWS):
        union = _UNION.rows([ds[j] for j in part])
        y = LinearRows(ds[part[0]]._reduced_head.layer, union)(h[part]).float()  # type: ignore[union-attr]
        for r, j in enumerate(part):
            out[j] = y[r, _UNION.columns(ds[j], union)]
    return [o if o is not None else ds[j].head(h[j:j + 1]).float()[0] for j, o in enumerate(out)]


def _parts(rows: list[int], most: int) -> list[list[int]]:
    """`rows` in runs of at most `most` (as many as one call of the skinny kernels takes: each row's product is then
    the one it has alone); none for fewer than 2 rows (their drafters' own heads)."""
    return [rows[i:i + most] for i in range(0, len(rows), most)] if len(rows) > 1 else []


class _Union:
    """The union of a batch's reduced vocabularies (sorted head rows) and each drafter's columns in it, kept while
    the vocabularies stay the same (a drafter gathers a new row-id tensor when its vocabulary grows)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.union = torch.zeros(0, dtype=torch.int64)

    def rows(self, ds: list[MTPDrafter]) -> torch.Tensor:
        parts = [d._head_rows for d in ds]
        if len(parts) != len(self.parts) or any(a is not b for a, b in zip(parts, self.parts)):
            self.parts, self.union = parts, torch.unique(torch.cat(parts))  # (sorted)
        return self.union

    @staticmethod
    def columns(d: MTPDrafter, union: torch.Tensor) -> torch.Tensor:
        if d._columns[0] is not union or d._columns[1] is not d._head_rows:
            d._columns = (union, d._head_rows, torch.searchsorted(union, d._head_rows))
        return d._columns[2]


_UNION = _Union()


def _plan(cache: Cache, pos: int, n: int) -> AttentionPlan:
    """Causal step over the MTP cache's entries, with RoPE at the true target positions [pos, pos + n)."""
    return AttentionPlan.causal(cache.length, n, first=pos)
