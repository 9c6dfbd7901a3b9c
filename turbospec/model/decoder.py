"""The decoder pieces every model family shares: the pre-norm attention + MLP layer, and its weight loaders
(Hugging Face tensor names)."""

from __future__ import annotations

from itertools import accumulate

import torch

from turbospec.errors import TurboSpecError
from turbospec.kv.cache import KVCache
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.layers import block
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.linear import Linear, skinny_rows
from turbospec.layers.moe import ExpertCache, MoE
from turbospec.layers.norm import rms_norm
from turbospec.model.config import ModelConfig
from turbospec.model.loader import TensorSource


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: MLP, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 zero_centred: bool = False):
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm, self.eps, self.zc = in_norm, post_norm, eps, zero_centred
        self._calls = block.OneCall()

    def _decode_args(self) -> tuple | None:
        return block.layer_decode_args(self.attn, self.mlp, self.in_norm, self.post_norm, self.eps, self.zc)

    def __call__(self, x, rope, plan, cache, layer, out_rows: int | None = None):
        """x + attention + feed-forward of rows x; `out_rows` = r: the caller reads the last r rows alone (every
        row's K/V are stored; where the step allows, only those rows attend and go on, and the output is [r, H])."""
        k = block.kernel_for(x, self.in_norm)
        if k is not None:  # decode / verification over a plain cache: one C++ call
            args = self._calls.get(block.layer_key(self.attn, self.mlp), self._decode_args)
            if args is not None and (
                    (out := block.decode_layer(k, args, x, rope, plan, cache, layer, out_rows)) is not None
                    or (out := block.paged_layer(k, args, x, rope, self.attn, cache, layer)) is not None):
                return out
        if (out_rows is not None and out_rows < x.shape[0] and x.shape[0] > skinny_rows(x.dtype) and plan.mask is None
                and isinstance(cache, (KVCache, QuantKVCache))):
            # prefill's last layer: only the last rows go on (K/V of every row are still stored)
            h = self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer, out_rows)
            x = x[-out_rows:] + h
            return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))
        k = block.fusable(x, self.mlp, self.in_norm, self.attn)
        if k is not None:  # decode / verification: two C++ calls around the attention
            return block.attention_layer(k, x, self.attn, self.mlp, self.in_norm, self.post_norm, self.eps, self.zc,
                                         rope, plan, cache, layer)
        k = block.fusable_moe(x, self.mlp, self.in_norm, self.attn)
        if k is not None:  # a mixture-of-experts layer's decode / verification
            return block.moe_layer(k, x, self.attn, self.mlp, self.in_norm, self.post_norm, self.eps, self.zc, rope,
                                   plan, cache, layer)
        x = x + self.attn(rms_norm(x, self.in_norm, self.eps, self.zc), rope, plan, cache, layer)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))

    def over_caches(self, x: torch.Tensor, ropes: list, plans: list[AttentionPlan], caches: list, counts: list[int],
                    layer: int, last_only: bool = False) -> torch.Tensor:
        """Rows of several sequences, `counts[i]` of them over `caches[i]` with `plans[i]` and `ropes[i]` (the MTP
        drafting for a batch): each sequence's attention over its own cache, the output projection and the
        feed-forward over all the rows at once (each row as its own step computes it, where the fused calls take
        the rows: drafts as one sequence drafting alone). `last_only`: each sequence's last row alone goes on past
        the attention ([len(caches), H]; the others only store their K/V)."""
        spans = list(zip(accumulate([0, *counts[:-1]]), counts))  # (first row, rows) per sequence
        last = torch.tensor([r + n - 1 for r, n in spans], device=x.device) if last_only else None
        k = (block.fusable(x, self.mlp, self.in_norm, self.attn)
             or block.fusable_moe(x, self.mlp, self.in_norm, self.attn))
        if k is not None:
            parts = [block.attention_rows(k, x[r:r + n], self.attn, self.in_norm, self.eps, self.zc, rope, plan,
                                          cache, layer)
                     for (r, n), rope, plan, cache in zip(spans, ropes, plans, caches)]
            a = torch.cat([p[0] for p in parts])
            gate = None if parts[0][1] is None else torch.cat([p[1] for p in parts])  # type: ignore[misc]
            if last is not None:
                x, a, gate = x[last], a[last], None if gate is None else gate[last]
            return block.ffn_tail(k, x, a, gate, self.attn.o, self.mlp, self.post_norm, self.eps, self.zc)
        h = rms_norm(x, self.in_norm, self.eps, self.zc)
        x = x + torch.cat([self.attn(h[r:r + n], rope, plan, cache, layer)
                           for (r, n), rope, plan, cache in zip(spans, ropes, plans, caches)])
        if last is not None:
            x = x[last]
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, self.zc))


def load_attention(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype, gated: bool = False,
                   zero_centred: bool = False) -> Attention:
    h, q, kv = cfg.hidden_size, cfg.q_size * (2 if gated else 1), cfg.kv_size
    names = ("q_proj", "k_proj", "v_proj")
    sizes = (q, kv, kv)
    if ws.has(f"{p}.qkv_proj.weight"):  # Phi-3: q, k and v in one matrix (no biases)
        ws_, bs = [ws.matrix(f"{p}.qkv_proj.weight", dtype, (q + 2 * kv, h))], [None]
    else:
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
    if ws.has(f"{p}.gate_up_proj.weight"):  # Phi-3: gate then up in one matrix (no biases)
        return MLP(Linear.fused([ws.matrix(f"{p}.gate_up_proj.weight", dtype, (2 * i, h))], [None], dtype),
                   Linear(ws.matrix(f"{p}.down_proj.weight", dtype, (h, i))))
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


def load_ffn(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype, layer: int, experts: ExpertCache
             ) -> MLP | MoE:
    """Layer `layer`'s feed-forward at `p` (`{prefix}.layers.N.mlp`): a mixture of experts where the config and
    the checkpoint say so (an MTP layer's too: it has a router), else a SwiGLU MLP."""
    if (cfg.moe_layer(layer) if not p.startswith("mtp.") else cfg.moe()["experts"] > 0) and ws.has(f"{p}.gate.weight"):
        return load_moe(ws, p, cfg, dtype, layer, experts)
    return load_mlp(ws, p, cfg, dtype)


def load_moe(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype, layer: int, experts: ExpertCache
             ) -> MoE:
    """A MoE feed-forward at `p`. Experts come from per-expert tensors (`experts.{e}.gate_proj.weight`, as released
    checkpoints), transformers-5's stacked `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I], or
    stacked gate / up / down (`experts.gate_proj` [E, I, H], a GGUF file's `ffn_*_exps`), read one expert at a
    time (`TensorSource.expert_matrix`) when it is first needed."""
    m, h = cfg.moe(), cfg.hidden_size
    e, inter = m["experts"], m["inter"]
    router = ws.get(f"{p}.gate.weight", dtype, (e, h))
    x = f"{p}.experts"
    if ws.has(f"{x}.gate_up_proj"):
        def load(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            gu = ws.expert_matrix(f"{x}.gate_up_proj", i, dtype, (2 * inter, h))
            return gu[:inter], gu[inter:], ws.expert_matrix(f"{x}.down_proj", i, dtype, (h, inter))
    elif ws.has(f"{x}.gate_proj"):
        def load(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (ws.expert_matrix(f"{x}.gate_proj", i, dtype, (inter, h)),
                    ws.expert_matrix(f"{x}.up_proj", i, dtype, (inter, h)),
                    ws.expert_matrix(f"{x}.down_proj", i, dtype, (h, inter)))
    else:
        def load(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (ws.matrix(f"{x}.{i}.gate_proj.weight", dtype, (inter, h)),
                    ws.matrix(f"{x}.{i}.up_proj.weight", dtype, (inter, h)),
                    ws.matrix(f"{x}.{i}.down_proj.weight", dtype, (h, inter)))
    shared = shared_gate = None
    if m["shared_inter"] and ws.has(f"{p}.shared_expert.gate_proj.weight"):
        scfg = ModelConfig(**{**cfg.__dict__, "intermediate_size": m["shared_inter"], "mlp_bias": False})
        shared = load_mlp(ws, f"{p}.shared_expert", scfg, dtype)
        shared_gate = ws.get(f"{p}.shared_expert_gate.weight", dtype).reshape(1, -1)
        if shared_gate.shape[1] != h:
            raise TurboSpecError(f"{p}.shared_expert_gate.weight has {shared_gate.numel()} values, expected {h}")
    layer_key = layer if not p.startswith("mtp.") else -1 - layer
    return MoE(router, e, load, m["top_k"], m["norm_topk"], shared, shared_gate, experts, layer_key)
