"""Dense decoder family: Qwen3, Qwen2 and Llama (GQA, optional q/k norm, biases, tied embeddings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec.config import ModelConfig
from turbospec.kv.cache import KVCache
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache, make_kv_cache
from turbospec.layers import block
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.linear import SKINNY_MAX_ROWS, Linear
from turbospec.layers.norm import rms_norm
from turbospec.layers.rope import Rope
from turbospec.loader import WeightSource


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: MLP, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 zero_centred: bool = False):
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm, self.eps, self.zc = in_norm, post_norm, eps, zero_centred

    def __call__(self, x, rope, plan, cache, layer, out_rows: int | None = None):
        if (out_rows is not None and out_rows < x.shape[0] and x.shape[0] > SKINNY_MAX_ROWS and plan.mask is None
                and isinstance(cache, KVCache)):
            # prefill's last layer: only the last rows go on (K/V of every row are still stored)
            h = self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer, out_rows)
            x = x[-out_rows:] + h
            return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))
        k = block.fusable(x, self.mlp, self.in_norm)
        if k is not None:  # decode / verification: two C++ calls around the attention
            return block.attention_layer(k, x, self.attn, self.mlp, self.in_norm, self.post_norm, self.eps, self.zc,
                                         rope, plan, cache, layer)
        x = x + self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))


def load_attention(ws: WeightSource, p: str, cfg: ModelConfig, dtype: torch.dtype, gated: bool = False,
                   zero_centred: bool = False) -> Attention:
    h, q, kv = cfg.hidden_size, cfg.q_size * (2 if gated else 1), cfg.kv_size
    names = ("q_proj", "k_proj", "v_proj")
    sizes = (q, kv, kv)
    ws_ = [ws.get(f"{p}.{n}.weight", dtype, (s, h)) for n, s in zip(names, sizes)]
    bs = [ws.get(f"{p}.{n}.bias", dtype, (s,)) if cfg.attention_bias else None for n, s in zip(names, sizes)]
    o_bias = ws.get(f"{p}.o_proj.bias", dtype, (h,)) if cfg.o_bias else None
    qn = kn = None
    if cfg.qk_norm:
        qn = ws.get(f"{p}.q_norm.weight", dtype, (cfg.head_dim,))
        kn = ws.get(f"{p}.k_norm.weight", dtype, (cfg.head_dim,))
    return Attention(
        Linear.fused(ws_, bs), Linear(ws.get(f"{p}.o_proj.weight", dtype, (h, cfg.q_size)), o_bias),
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qn, kn, cfg.rms_norm_eps, gated, zero_centred,
    )


def load_mlp(ws: WeightSource, p: str, cfg: ModelConfig, dtype: torch.dtype) -> MLP:
    h, i = cfg.hidden_size, cfg.intermediate_size
    bias = cfg.mlp_bias
    gate = ws.get(f"{p}.gate_proj.weight", dtype, (i, h))
    up = ws.get(f"{p}.up_proj.weight", dtype, (i, h))
    gb = [ws.get(f"{p}.{n}.bias", dtype, (i,)) if bias else None for n in ("gate_proj", "up_proj")]
    down_b = ws.get(f"{p}.down_proj.bias", dtype, (h,)) if bias else None
    return MLP(Linear.fused([gate, up], gb), Linear(ws.get(f"{p}.down_proj.weight", dtype, (h, i)), down_b))


class DenseModel:
    """forward(tokens, plan, cache) -> final-normed hidden states; logits(hidden) -> float32 logits."""

    def __init__(self, cfg: ModelConfig, ws: WeightSource, dtype: torch.dtype, prefix: str = "model"):
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        self.embed = ws.get(f"{prefix}.embed_tokens.weight", dtype, (cfg.vocab_size, h))
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"{prefix}.layers.{i}"
            self.layers.append(DecoderLayer(
                load_attention(ws, f"{p}.self_attn", cfg, dtype), load_mlp(ws, f"{p}.mlp", cfg, dtype),
                ws.get(f"{p}.input_layernorm.weight", dtype, (h,)),
                ws.get(f"{p}.post_attention_layernorm.weight", dtype, (h,)), cfg.rms_norm_eps,
            ))
        self.norm = ws.get(f"{prefix}.norm.weight", dtype, (h,))
        if cfg.tie_word_embeddings and not ws.has("lm_head.weight"):
            self.lm_head = Linear(self.embed)
            self.embed = self.lm_head.weight  # one matrix for both (Linear may have moved it)
        else:
            self.lm_head = Linear(ws.get("lm_head.weight", dtype, (cfg.vocab_size, h)))
        self.rope = Rope(cfg.rope, cfg.head_dim, min(cfg.max_position_embeddings, 8192), dtype)
        self.mtp = None
        if ws.has("mtp.fc.weight"):
            from turbospec.spec.mtp import MTPModule

            self.mtp = MTPModule(cfg, ws, dtype, self.embed, self.lm_head)

    def new_cache(self, max_len: int, kv_dtype: torch.dtype | None = None, k_type: str | None = None,
                  v_type: str | None = None) -> KVCache | QuantKVCache:
        """Dense `KVCache` by default (model dtype, or `kv_dtype`); a packed `QuantKVCache` when a K or V
        format (`k_type`/`v_type`: f16, q8_0, turbo3, ...) other than the model's own float type is asked."""
        c = self.cfg
        return make_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, self.dtype, k_type, v_type,
                             kv_dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttentionPlan, cache: KVCache, out_rows: int | None = None
                ) -> torch.Tensor:
        """Final-normed hidden rows [N, H]; `out_rows` = r: only the last r rows are wanted ([r, H]; prefill wants
        one for the next token's logits, an MTP drafter its prompt window), so the last layer attends and projects
        those alone (llama.cpp skips the unused output rows the same way)."""
        cache.begin(tokens.numel())
        x = F.embedding(tokens, self.embed)
        rope = self.rope.tables_for(plan)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, plan, cache, i, out_rows if i == last else None)
        return rms_norm(x[-out_rows:] if out_rows else x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weight_bytes(self) -> int:
        n = self.embed.numel() * self.embed.element_size()
        for layer in self.layers:
            n += layer.attn.qkv.nbytes + layer.attn.o.nbytes + layer.mlp.gate_up.nbytes + layer.mlp.down.nbytes
        if self.lm_head.weight is not self.embed:
            n += self.lm_head.nbytes
        return n
