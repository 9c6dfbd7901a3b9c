"""Native MTP (Qwen3.5 / Qwen3-Next `mtp.*` weights) as a drafter.

The MTP element at position j combines the target's final-normed hidden h_j with the embedding of token x_{j+1}
and predicts x_{j+2}: u = fc([norm_e(embed(x_{j+1})), norm_h(h_j)]) -> one decoder layer (own KV cache, rotary
position j) -> norm -> shared lm_head. Drafting recurses by feeding the MTP's own output row as the next h.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.config import HYBRID_ARCHS, ModelConfig
from turbospec.errors import TurboSpecError
from turbospec.kv.cache import KVCache
from turbospec.kv.plan import AttentionPlan
from turbospec.layers import block
from turbospec.layers.linear import Linear, exact_bf16
from turbospec.layers.norm import rms_norm
from turbospec.layers.rope import Rope
from turbospec.loader import WeightSource
from turbospec.sampling import argmax
from turbospec.spec.tree import DraftTree


class MTPModule:
    """The weights and forward of the MTP block; logits come from the target's lm_head."""

    def __init__(self, cfg: ModelConfig, ws: WeightSource, dtype: torch.dtype, embed: torch.Tensor,
                 lm_head: Linear, prefix: str = "mtp"):
        from turbospec.models.dense import DecoderLayer, load_attention, load_mlp

        h = cfg.hidden_size
        hybrid = cfg.arch in HYBRID_ARCHS
        self.cfg, self.dtype, self.zc = cfg, dtype, hybrid
        self.embed, self.lm_head = embed, lm_head
        self.fc = Linear(ws.get(f"{prefix}.fc.weight", dtype, (h, 2 * h)))
        self.norm_e = ws.get(f"{prefix}.pre_fc_norm_embedding.weight", dtype, (h,))
        self.norm_h = ws.get(f"{prefix}.pre_fc_norm_hidden.weight", dtype, (h,))
        self.norm = ws.get(f"{prefix}.norm.weight", dtype, (h,))
        n = 0
        while ws.has(f"{prefix}.layers.{n}.input_layernorm.weight"):
            n += 1
        if n == 0:
            raise TurboSpecError(f"{prefix}.* weights present but no {prefix}.layers.N found")
        self.layers = []
        for i in range(n):
            p = f"{prefix}.layers.{i}"
            layer = DecoderLayer(
                load_attention(ws, f"{p}.self_attn", cfg, dtype, gated=hybrid, zero_centred=hybrid),
                load_mlp(ws, f"{p}.mlp", cfg, dtype),
                ws.get(f"{p}.input_layernorm.weight", dtype, (h,)),
                ws.get(f"{p}.post_attention_layernorm.weight", dtype, (h,)), cfg.rms_norm_eps, hybrid,
            )
            self.layers.append(layer)
        self.rope = Rope(cfg.rope, cfg.head_dim, 4096, dtype)
        self._draft_head: Linear | None = None
        self._compacted = False

    def new_cache(self, max_len: int, kv_dtype: torch.dtype | None = None, k_type: str | None = None,
                  v_type: str | None = None) -> KVCache:
        from turbospec.kv.quant_cache import make_kv_cache

        c = self.cfg
        return make_kv_cache(len(self.layers), c.num_kv_heads, c.head_dim, max_len, self.dtype, k_type, v_type,
                             kv_dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], hidden: torch.Tensor, plan: AttentionPlan, cache: KVCache,
                step: int = 0) -> torch.Tensor:
        """tokens x_{j+1} [N] (a tensor or a list of ids), hidden h_j [N, H], plan positions j -> normed MTP
        hidden [N, H]."""
        eps = self.cfg.rms_norm_eps
        if isinstance(tokens, list):  # drafting: a row view for one token (tensor creation + gather cost ~20 us)
            e = self.embed[tokens[0]:tokens[0] + 1] if len(tokens) == 1 else self.embed[torch.tensor(tokens)]
        else:
            e = F.embedding(tokens, self.embed)
        cache.begin(e.shape[0])
        h = hidden.to(self.dtype)
        k = block.kernel_for(e, self.norm_e)
        if k is not None:  # drafting / catching up: one C++ call
            u = k.mtp_in(e, self.norm_e, h, self.norm_h, eps, self.zc, self.fc.weight, self.fc.bias)
        else:
            u = self.fc(torch.cat([rms_norm(e, self.norm_e, eps, self.zc), rms_norm(h, self.norm_h, eps, self.zc)], -1))
        li = step % len(self.layers)
        x = self.layers[li](u, self.rope.tables_for(plan), plan, cache, li)
        return rms_norm(x, self.norm, eps, self.zc)

    def compact_weights(self) -> None:
        """Store the MTP's own matrices in bf16 where that is exact (see `exact_bf16`); once."""
        if self._compacted:
            return
        self._compacted = True
        self.fc = exact_bf16(self.fc)
        for layer in self.layers:
            layer.attn.qkv, layer.attn.o = exact_bf16(layer.attn.qkv), exact_bf16(layer.attn.o)
            layer.mlp.gate_up, layer.mlp.down = exact_bf16(layer.mlp.gate_up), exact_bf16(layer.mlp.down)

    def draft_head(self) -> Linear:
        """The lm_head for drafting, in bf16 where that is exact; built once and shared by every drafter of this
        module (the target's lm_head itself is untouched)."""
        if self._draft_head is None:
            self._draft_head = exact_bf16(self.lm_head)
        return self._draft_head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def nbytes(self) -> int:
        n = self.fc.nbytes + 3 * self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            n += layer.attn.qkv.nbytes + layer.attn.o.nbytes + layer.mlp.gate_up.nbytes + layer.mlp.down.nbytes
        return n


class MTPDrafter:
    """Drafts a chain of up to n_max tokens by recursing the MTP block.

    The MTP cache holds one entry per target position j < L (pairs (h_j, x_{j+1})); drafted entries are scratch
    and dropped after each step. `prompt_window` limits how many prompt positions are fed to the MTP at begin()
    (0 = all) so prompt processing is not slowed down by drafting.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, mtp: MTPModule, max_len: int, p_min: float = 0.0, prompt_window: int = 0,
                 kv_dtype: torch.dtype | None = None, k_type: str | None = None, v_type: str | None = None,
                 draft_vocab: int = 0, topk: int = 1, ranked_vocab: list[int] | None = None):
        self.mtp = mtp
        # topk > 1: a tree -- at every depth the top-k candidates of the MTP's distribution; the best one is
        # continued (one MTP step per depth, as for a chain), the others are leaves that cost only a verify row
        self.topk = max(1, topk)
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
        self._ids: set[int] = set()
        self.head_ids: list[int] | None = None  # head row -> token id (reduced vocabulary)
        self._reduced_head: Linear | None = None
        mtp.compact_weights()
        self.cache = mtp.new_cache(max_len, kv_dtype, k_type, v_type) if k_type or v_type else \
            mtp.new_cache(max_len, kv_dtype)
        self.p_min = p_min
        self.prompt_window = prompt_window
        self.pending_tokens: list[int] = []  # x_{j+1} of true pairs not yet in the MTP cache
        self.pending_hidden: list[torch.Tensor] = []  # h_j rows for them (the last one waits for its token)
        self.offset = 0  # target position of MTP cache entry 0

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits of the MTP output rows h (over the reduced vocabulary's rows when there is one)."""
        return (self._reduced_head or self.full_head)(h)

    def _add_vocab(self, tokens: list[int]) -> None:
        """Grow the reduced vocabulary by the tokens not yet in it (rebuilds the gathered head rows)."""
        if not self.reduced:
            return
        new = set(tokens) - self._ids
        if not new and self._reduced_head is not None:
            return
        self._ids |= new | self._base
        self.head_ids = sorted(self._ids)  # ascending: ties go to the lower id, as over the full vocabulary
        rows = self.full_head.weight[torch.tensor(self.head_ids, dtype=torch.int64)]
        self._reduced_head = Linear(rows, hugepages=False)  # rebuilt as tokens arrive: ordinary memory

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
        self._ids = set()
        self._reduced_head = None
        self._add_vocab(tokens)
        self.cache.reset()
        n = len(tokens)
        # hidden may cover only the last rows (the engine reused a cached prompt prefix)
        start = n - hidden.shape[0]
        w = self.window(n)
        if w > 0:
            start = max(start, n - 1 - w)
        hidden = torch.cat([hidden.new_zeros(n - hidden.shape[0], hidden.shape[1]), hidden])
        # MTP cache entry i holds target position i + offset: skipped prompt positions take no cache room and
        # need no mask (RoPE gets the true positions from the plan)
        self.offset = start
        chunk = 512
        for s in range(start, n - 1, chunk):
            e = min(s + chunk, n - 1)
            toks = torch.tensor(tokens[s + 1:e + 1], dtype=torch.int64)
            self.mtp.forward(toks, hidden[s:e], _plan(self.cache, s, e - s), self.cache)
            self.cache.commit()
        self.pending_tokens = []
        self.pending_hidden = [hidden[n - 1:n]]

    def _flush_and_first(self, root: int) -> torch.Tensor:
        """Process all pending true pairs plus (h_{L-1}, root); return the last MTP output row."""
        toks = self.pending_tokens + [root]
        hid = torch.cat(self.pending_hidden, 0)
        assert hid.shape[0] == len(toks)
        plan = _plan(self.cache, self.next_pos, len(toks))
        out = self.mtp.forward(toks, hid, plan, self.cache)
        # everything but the root pair is final; the root pair is final too (root is emitted, h is the target's)
        self.cache.commit()
        self.pending_tokens, self.pending_hidden = [], []
        return out[-1:]

    @property
    def next_pos(self) -> int:
        """Target position of the next pair fed to the MTP."""
        return self.cache.length + self.offset

    def propose(self, tokens: list[int], n_max: int) -> DraftTree:
        h = self._flush_and_first(tokens[-1])
        committed = self.cache.length
        nodes: list[int] = []
        parents: list[int] = []
        spine = -1  # tree index of the last drafted top-1 token (topk = 1: a chain)
        for i in range(n_max):
            logits = self.head(h).float()[0]
            rows = logits.topk(self.topk).indices.tolist() if self.topk > 1 else [argmax(logits)]
            top = rows if self.head_ids is None else [self.head_ids[r] for r in rows]  # head rows -> token ids
            tok = top[0]
            if self.p_min > 0 and float(torch.softmax(logits, -1)[rows[0]]) < self.p_min:
                break
            nodes += top
            parents += [spine] * len(top)
            spine = len(nodes) - len(top)
            if i + 1 == n_max:
                break
            plan = _plan(self.cache, self.next_pos, 1)
            h = self.mtp.forward([tok], h, plan, self.cache, step=i + 1)
            self.cache.commit()
        self.cache.length = committed  # drop speculative MTP entries
        return DraftTree(nodes, parents, [None] * len(nodes), self.name)

    def sync(self, tokens: list[int]) -> None:
        """Process the pending true pairs without drafting (another drafter of a chain won this step)."""
        self._flush_and_first(tokens[-1])

    def accept(self, committed: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        # committed = [root, d1..dj] at target positions L..L+j with hidden rows h_L..h_{L+j}
        assert hidden is not None and hidden.shape[0] == len(committed)
        self._add_vocab(committed + [next_token])
        self.pending_tokens = list(committed[1:])
        self.pending_hidden = [hidden]


def _plan(cache: KVCache, pos: int, n: int) -> AttentionPlan:
    """Causal step over the MTP cache's entries, with RoPE at the true target positions [pos, pos + n)."""
    return AttentionPlan.causal(cache.length, n, first=pos)
