"""The decoder pieces every model family shares: the pre-norm attention + MLP layer, and its weight loaders
(Hugging Face tensor names)."""

from __future__ import annotations

import torch

from turbospec.kv.cache import KVCache
from turbospec.layers import block
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.linear import Linear, skinny_rows
from turbospec.layers.norm import rms_norm
from turbospec.model.config import ModelConfig
from turbospec.model.loader import TensorSource


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: MLP, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 zero_centred: bool = False):
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm, self.eps, self.zc = in_norm, post_norm, eps, zero_centred

    def __call__(self, x, rope, plan, cache, layer, out_rows: int | None = None):
        if (out_rows is not None and out_rows < x.shape[0] and x.shape[0] > skinny_rows(x.dtype) and plan.mask is None
                and isinstance(cache, KVCache)):
            # prefill's last layer: only the last rows go on (K/V of every row are still stored)
            h = self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer, out_rows)
            x = x[-out_rows:] + h
            return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))
        k = block.fusable(x, self.mlp, self.in_norm, self.attn)
        if k is not None:  # decode / verification: two C++ calls around the attention
            return block.attention_layer(k, x, self.attn, self.mlp, self.in_norm, self.post_norm, self.eps, self.zc,
                                         rope, plan, cache, layer)
        x = x + self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))


def load_attention(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype, gated: bool = False,
                   zero_centred: bool = False) -> Attention:
    h, q, kv = cfg.hidden_size, cfg.q_size * (2 if gated else 1), cfg.kv_size
    names = ("q_proj", "k_proj", "v_proj")
    sizes = (q, kv, kv)
    ws_ = [ws.matrix(f"{p}.{n}.weight", dtype, (s, h)) for n, s in zip(names, sizes)]
    bs = [ws.get(f"{p}.{n}.bias", dtype, (s,)) if cfg.attention_bias else None for n, s in zip(names, sizes)]
    o_bias = ws.get(f"{p}.o_proj.bias", dtype, (h,)) if cfg.o_bias else None
    qn = kn = None
    if cfg.qk_norm:
        qn = ws.get(f"{p}.q_norm.weight", dtype, (cfg.head_dim,))
        kn = ws.get(f"{p}.k_norm.weight", dtype, (cfg.head_dim,))
    return Attention(
        Linear.fused(ws_, bs, dtype), Linear(ws.matrix(f"{p}.o_proj.weight", dtype, (h, cfg.q_size)), o_bias),
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qn, kn, cfg.rms_norm_eps, gated, zero_centred,
    )


def load_mlp(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype) -> MLP:
    h, i = cfg.hidden_size, cfg.intermediate_size
    bias = cfg.mlp_bias
    gate = ws.matrix(f"{p}.gate_proj.weight", dtype, (i, h))
    up = ws.matrix(f"{p}.up_proj.weight", dtype, (i, h))
    gb = [ws.get(f"{p}.{n}.bias", dtype, (i,)) if bias else None for n in ("gate_proj", "up_proj")]
    down_b = ws.get(f"{p}.down_proj.bias", dtype, (h,)) if bias else None
    return MLP(Linear.fused([gate, up], gb, dtype), Linear(ws.matrix(f"{p}.down_proj.weight", dtype, (h, i)), down_b))


def load_embedding(ws: TensorSource, prefix: str, cfg: ModelConfig, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, Linear]:
    """The token embedding and the LM head. Tied (no `lm_head.weight` and `tie_word_embeddings`): one matrix for
    both, placed as the head at once, so a converted embedding is not held through the layers' loading. Untied
    without `lm_head.weight`: the source's one-line missing-tensor error."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    embed = ws.matrix(f"{prefix}.embed_tokens.weight", dtype, shape)
    if cfg.tie_word_embeddings and not ws.has("lm_head.weight"):
        head = Linear(embed)
        return head.weight, head
    return embed, Linear(ws.matrix("lm_head.weight", dtype, shape))
