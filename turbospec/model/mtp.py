"""The native multi-token-prediction block (Qwen3.5 / Qwen3-Next `mtp.*` weights): loading and forward.

The MTP element at position j combines the target's final-normed hidden h_j with the embedding of token x_{j+1}
and predicts x_{j+2}: u = fc([norm_e(embed(x_{j+1})), norm_h(h_j)]) -> one decoder layer (own KV cache, rotary
position j) -> norm -> shared lm_head. `turbospec.speculative.mtp` drafts with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.errors import TurboSpecError
from turbospec.kv.base import Cache
from turbospec.kv.cache import KVCache
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import make_kv_cache
from turbospec.layers import block
from turbospec.layers.attention import MLP
from turbospec.layers.linear import Linear, exact_bf16, float_logits, skinny_rows
from turbospec.layers.moe import ExpertCache
from turbospec.layers.norm import rms_norm
from turbospec.layers.rope import Rope
from turbospec.model.config import HYBRID_ARCHS, ModelConfig
from turbospec.model.decoder import DecoderLayer, load_attention, load_ffn
from turbospec.model.loader import TensorSource
from turbospec.weights import embedding_rows, is_packed


class MTPModule:
    """The weights and forward of the MTP block; logits come from the target's lm_head."""

    def __init__(self, cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype, embed: torch.Tensor,
                 lm_head: Linear, rope: Rope, prefix: str = "mtp", experts: ExpertCache | None = None):
        h = cfg.hidden_size
        hybrid = cfg.arch in HYBRID_ARCHS
        self.cfg, self.dtype, self.zc = cfg, dtype, hybrid
        self.embed, self.lm_head = embed, lm_head
        self.fc = Linear(ws.matrix(f"{prefix}.fc.weight", dtype, (h, 2 * h)))
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
                load_ffn(ws, f"{p}.mlp", cfg, dtype, i, experts if experts is not None else ExpertCache()),
                ws.get(f"{p}.input_layernorm.weight", dtype, (h,)),
                ws.get(f"{p}.post_attention_layernorm.weight", dtype, (h,)), cfg.rms_norm_eps, hybrid,
            )
            self.layers.append(layer)
        # the target's tables (the same rotary settings): a table of its own, built for 4096 positions, was rebuilt
        # for the whole context the first time the MTP drafted at depth -- 48 + 121 ms inside the first drafts at 64K
        # when the prompt's prefix came from the cache (nothing fed the MTP during prefill)
        self.rope = rope
        self._draft_head: Linear | None = None
        self._compacted = False
        # the draft-vocabulary ranking (turbospec.model.draft_vocab) a GGUF file carried, set as it loads ([]: it
        # carried none); None: not known here (a checkpoint directory: draft_vocab.json beside it)
        self.ranked_vocab: list[int] | None = None

    def new_cache(self, max_len: int, *, k_type: str | None = None, v_type: str | None = None,
                  checkpoints: int = 0) -> Cache:
        """The MTP layers' own KV cache (formats as the target's `new_cache`)."""
        c = self.cfg
        return make_kv_cache(len(self.layers), c.num_kv_heads, c.head_dim, max_len, self.dtype, k_type, v_type)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], hidden: torch.Tensor, plan: AttentionPlan, cache: KVCache,
                step: int = 0, out_rows: int | None = None) -> torch.Tensor:
        """tokens x_{j+1} [N] (a tensor or a list of ids), hidden h_j [N, H], plan positions j -> normed MTP
        hidden [N, H]; `out_rows` = r: the last r rows alone ([r, H]; every row's K/V are stored, and where the
        step allows only those rows attend and go through the feed-forward: a drafter catching up, or fed a
        prompt, reads the last row or none)."""
        u = self._input(tokens, hidden)
        cache.begin(u.shape[0])
        li = step % len(self.layers)
        x = self.layers[li](u, self.rope.tables_for(plan), plan, cache, li, out_rows)
        return rms_norm(x[-out_rows:] if out_rows else x, self.norm, self.cfg.rms_norm_eps, self.zc)

    @torch.inference_mode()
    def forward_many(self, tokens: list[int], hidden: torch.Tensor, plans: list[AttentionPlan], caches: list[Cache],
                     counts: list[int], step: int = 0, last_only: bool = False) -> torch.Tensor:
        """`forward` for several sequences at once (the drafters of a batch): `counts[i]` rows of tokens / hidden
        over `caches[i]` with `plans[i]`, in order. The input projection, the layer's output projection and
        feed-forward run once over the rows of as many sequences as the fused calls take at once (`skinny_rows`);
        each sequence attends over its own cache. `last_only`: each sequence's last row alone ([len(caches), H];
        the rows before it only store their K/V)."""
        if len(caches) == 1:
            return self.forward(tokens, hidden, plans[0], caches[0], step, 1 if last_only else None)
        limit, rows = skinny_rows(self.dtype), 0
        for i, n in enumerate(counts):  # more rows than one fused call takes: the first sequences that fit, the rest
            if i > 0 and rows + n > limit:
                first = self.forward_many(tokens[:rows], hidden[:rows], plans[:i], caches[:i], counts[:i], step,
                                          last_only)
                rest = self.forward_many(tokens[rows:], hidden[rows:], plans[i:], caches[i:], counts[i:], step,
                                         last_only)
                return torch.cat([first, rest])
            rows += n
        u = self._input(tokens, hidden)
        for cache, n in zip(caches, counts):
            cache.begin(n)
        li = step % len(self.layers)
        x = self.layers[li].over_caches(u, [self.rope.tables_for(p) for p in plans], plans, caches, counts, li,
                                        last_only)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.zc)

    def _input(self, tokens: torch.Tensor | list[int], hidden: torch.Tensor) -> torch.Tensor:
        """u = fc([norm_e(embed(tokens)), norm_h(hidden)])."""
        eps = self.cfg.rms_norm_eps
        if not isinstance(self.embed, torch.Tensor) or is_packed(self.embed):  # split (tensor parallel) or packed
            e = embedding_rows(self.embed, torch.as_tensor(tokens), self.dtype)
        elif isinstance(tokens, list):  # drafting: a row view for one token (tensor creation + gather cost ~20 us)
            e = (self.embed[tokens[0]:tokens[0] + 1] if len(tokens) == 1
                 else self.embed[torch.tensor(tokens, device=self.embed.device)])
        else:
            e = F.embedding(tokens, self.embed)
        h = hidden.to(self.dtype)
        k = block.kernel_for(e, self.norm_e)
        if k is not None:  # drafting / catching up: one C++ call
            return k.mtp_in(e, self.norm_e, h, self.norm_h, eps, self.zc, self.fc.weight, self.fc.bias)
        return self.fc(torch.cat([rms_norm(e, self.norm_e, eps, self.zc), rms_norm(h, self.norm_h, eps, self.zc)], -1))

    def compact_weights(self) -> None:
        """Store the MTP's own matrices in bf16 where that is exact (see `exact_bf16`); once."""
        if self._compacted:
            return
        self._compacted = True
        self.fc = exact_bf16(self.fc)
        for layer in self.layers:
            layer.attn.qkv, layer.attn.o = exact_bf16(layer.attn.qkv), exact_bf16(layer.attn.o)
            if isinstance(layer.mlp, MLP):  # (a MoE layer's experts stay as loaded)
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
        return float_logits(self.lm_head, hidden)

    @property
    def nbytes(self) -> int:
        n = self.fc.nbytes + 3 * self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            n += layer.attn.qkv.nbytes + layer.attn.o.nbytes + layer.mlp.nbytes
        return n
