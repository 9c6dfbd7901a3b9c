"""Dense decoder family: Qwen3, Qwen2 and Llama (GQA, optional q/k norm, biases, tied embeddings)."""

from __future__ import annotations

import torch

from turbospec.kv.base import Cache
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import make_kv_cache
from turbospec.layers.linear import float_logits
from turbospec.layers.moe import ExpertCache
from turbospec.layers.norm import rms_norm
from turbospec.layers.rope import Rope
from turbospec.model.config import ModelConfig
from turbospec.model.decoder import DecoderLayer, load_attention, load_embedding, load_ffn
from turbospec.model.loader import TensorSource
from turbospec.model.mtp import MTPModule
from turbospec.weights import embedding_bytes, embedding_rows


class DenseModel:
    """forward(tokens, plan, cache) -> final-normed hidden states; logits(hidden) -> float32 logits."""

    def __init__(self, cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype, prefix: str = "model"):
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        self.embed, self.lm_head = load_embedding(ws, prefix, cfg, dtype)
        self.experts = ExpertCache(ws.expert_budget)  # Qwen3-MoE's routed experts
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"{prefix}.layers.{i}"
            self.layers.append(DecoderLayer(
                load_attention(ws, f"{p}.self_attn", cfg, dtype), load_ffn(ws, f"{p}.mlp", cfg, dtype, i, self.experts),
                ws.get(f"{p}.input_layernorm.weight", dtype, (h,)),
                ws.get(f"{p}.post_attention_layernorm.weight", dtype, (h,)), cfg.rms_norm_eps,
            ))
        self.norm = ws.get(f"{prefix}.norm.weight", dtype, (h,))
        self.rope = Rope(cfg.rope, cfg.head_dim, min(cfg.max_position_embeddings, 8192), dtype)
        self.mtp: MTPModule | None = None
        if ws.has("mtp.fc.weight"):
            self.mtp = MTPModule(cfg, ws, dtype, self.embed, self.lm_head, self.rope, experts=self.experts)

    def new_cache(self, max_len: int, *, k_type: str | None = None, v_type: str | None = None,
                  checkpoints: int = 0) -> Cache:
        """Dense `KVCache` in the model dtype by default; a packed `QuantKVCache` when a K or V format
        (`k_type`/`v_type`: f16, q8_0, turbo3, ...) other than the model's own float type is asked."""
        c = self.cfg
        return make_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, self.dtype, k_type, v_type)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttentionPlan, cache: Cache, out_rows: int | None = None
                ) -> torch.Tensor:
        """Final-normed hidden rows [N, H]; `out_rows` = r: only the last r rows are wanted ([r, H]; prefill wants
        one for the next token's logits, an MTP drafter its prompt window), so the last layer attends and projects
        those alone (llama.cpp skips the unused output rows the same way)."""
        cache.begin(tokens.numel())
        x = embedding_rows(self.embed, tokens, self.dtype)
        rope = self.rope.tables_for(plan)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, plan, cache, i, out_rows if i == last else None)
        return rms_norm(x[-out_rows:] if out_rows else x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return float_logits(self.lm_head, hidden)

    @property
    def weight_bytes(self) -> int:
        n = embedding_bytes(self.embed, self.lm_head)
        for layer in self.layers:
            n += layer.attn.qkv.nbytes + layer.attn.o.nbytes + layer.mlp.nbytes
        return n
