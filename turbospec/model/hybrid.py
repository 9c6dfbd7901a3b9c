"""Hybrid decoders: Qwen3.5 (`qwen3_5_text`, the text part of `qwen3_5`) and Qwen3-Next (`qwen3_next`).

Layers are Gated DeltaNet ("linear_attention") or gated full attention ("full_attention"); the pattern comes
from config `layer_types` (or `full_attention_interval`, default 4: three GDN layers per attention layer).
All RMSNorms except the GDN output norm are zero-centred (y = x / rms(x) * (1 + w)). Attention rotates only
the first `partial_rotary_factor` (default 0.25) of each head and gates its output with sigmoid(gate) from
q_proj.

The `mtp.*` weights (native multi-token prediction head) are loaded into `self.mtp` (an `MTPModule`, or None
when the checkpoint has none); their names are in `self.mtp_names`. See `turbospec.model.mtp.MTPModule` for the
interface.
"""

from __future__ import annotations

import logging

import torch

from turbospec import env
from turbospec.errors import TurboSpecError
from turbospec.kv.base import Cache
from turbospec.kv.cache import KVCache
from turbospec.kv.hybrid_cache import HybridCache
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache, make_kv_cache
from turbospec.kv.state_pool import HybridBatch, StatePool
from turbospec.layers import block
from turbospec.layers.gated_deltanet import _CHAIN, GatedDeltaNet, load_gdn_kernel
from turbospec.layers.linear import Linear, float_logits, skinny_rows
from turbospec.layers.moe import ExpertCache
from turbospec.layers.norm import rms_norm
from turbospec.layers.rope import Rope
from turbospec.model.config import ModelConfig
from turbospec.model.decoder import load_attention, load_embedding, load_ffn
from turbospec.model.loader import TensorSource
from turbospec.model.mtp import MTPModule
from turbospec.weights import embedding_bytes, embedding_rows

log = logging.getLogger("turbospec")


def load_gdn(ws: TensorSource, p: str, cfg: ModelConfig, dtype: torch.dtype) -> GatedDeltaNet:
    d = cfg.linear_dims()
    nk, nv, dk, dv, kern = (
        d["num_k_heads"],
        d["num_v_heads"],
        d["k_head_dim"],
        d["v_head_dim"],
        d["conv_kernel"],
    )
    h = cfg.hidden_size
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    if nv % nk:
        raise TurboSpecError(
            f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})"
        )
    if ws.has(f"{p}.in_proj_qkv.weight"):  # Qwen3.5: separate projections, head-major
        if ws.has(f"{p}.in_proj_b.weight"):
            b, a = ws.matrix(f"{p}.in_proj_b.weight", dtype, (nv, h)), ws.matrix(f"{p}.in_proj_a.weight", dtype, (nv, h))
        else:  # a Qwen3-Next GGUF file: q, k, v and z as Qwen3.5's, b and a in the checkpoint's in_proj_ba
            b, a = _split_ba(ws.get(f"{p}.in_proj_ba.weight", dtype, (2 * nv, h)), nk)
        rows = [
            ws.matrix(f"{p}.in_proj_qkv.weight", dtype, (conv_dim, h)),
            ws.matrix(f"{p}.in_proj_z.weight", dtype, (value_dim, h)),
            b,
            a,
        ]
    else:  # Qwen3-Next: per key-head groups [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]; float
        qkv, z = split_qkvz(ws.get(f"{p}.in_proj_qkvz.weight", dtype, (2 * key_dim + 2 * value_dim, h)), nk, nv, dk, dv)
        b, a = _split_ba(ws.get(f"{p}.in_proj_ba.weight", dtype, (2 * nv, h)), nk)
        rows = [qkv, z, b, a]
    gdn = GatedDeltaNet(
        Linear.fused(rows, [None] * 4, dtype),
        ws.get(f"{p}.conv1d.weight", dtype, (conv_dim, 1, kern)),
        ws.get(f"{p}.A_log", torch.float32, (nv,)),
        ws.get(f"{p}.dt_bias", torch.float32, (nv,)),
        ws.get(f"{p}.norm.weight", dtype, (dv,)),
        Linear(ws.matrix(f"{p}.out_proj.weight", dtype, (h, value_dim))),
        nk,
        nv,
        dk,
        dv,
        cfg.rms_norm_eps,
    )
    gdn.out_tiling = ws.value_tiling(f"{p}.out_proj.weight")
    return gdn


def split_qkvz(qkvz: torch.Tensor, nk: int, nv: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz, per key head [q | k | v (r value heads) | z (r value heads)], as Qwen3.5's
    in_proj_qkv (every head's q, then k, then v) and in_proj_z (as llama.cpp's converter writes attn_qkv and
    attn_gate)."""
    r, h = nv // nk, qkvz.shape[-1]
    q, k, v, z = qkvz.view(nk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
    return torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]), z.reshape(-1, h)


def _split_ba(ba: torch.Tensor, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_ba, per key head [b (r value heads) | a (r value heads)], as Qwen3.5's in_proj_b and
    in_proj_a (value heads in order)."""
    h = ba.shape[-1]
    b, a = ba.view(nk, -1, h).split(ba.shape[0] // nk // 2, dim=1)
    return b.reshape(-1, h), a.reshape(-1, h)


class HybridLayer:
    def __init__(
        self, kind: str, slot: int, mixer, mlp, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float
    ):
        self.kind, self.slot = kind, slot  # slot: index among layers of the same kind (cache index)
        self.mixer, self.mlp = mixer, mlp
        self.in_norm, self.post_norm, self.eps = in_norm, post_norm, eps
        self._calls = block.OneCall()

    def _one_call_args(self) -> tuple | None:
        """The unchanging arguments of this layer's one-call kernel (`layer_decode` or `gdn_layer`), or None."""
        if self.kind == "full_attention":
            return block.layer_decode_args(self.mixer, self.mlp, self.in_norm, self.post_norm, self.eps, True)
        gdn, mlp = self.mixer, self.mlp
        if (block.fusable_structure(mlp, gdn) and gdn.out_tiling == 1 and not block.split(gdn.out, mlp.down)):
            return ((self.in_norm, self.eps, True, gdn.proj.matrices, gdn.proj.bias),
                    (gdn.conv_t, gdn.neg_a, gdn.dt_bias, gdn.norm_weight),
                    (gdn.nk, gdn.nv, gdn.dk, gdn.dv, gdn.eps, gdn.out.weight, gdn.out.bias, self.post_norm,
                     mlp.gate_up.weight, mlp.gate_up.bias, mlp.down.weight, mlp.down.bias))
        return None

    def one_call_args(self) -> tuple | None:
        """This layer's `_one_call_args`, worked out again only when one of its projections was replaced."""
        return self._calls.get(block.layer_key(self.mixer, self.mlp), self._one_call_args)

    def _one_call(self, k, x: torch.Tensor, rope, plan: AttentionPlan, cache) -> torch.Tensor | None:
        """A decode / verification step of this layer in one C++ call with its cached arguments, or None where the
        step or the layer needs the general path."""
        args = self.one_call_args()
        if args is not None and isinstance(cache, HybridBatch):
            if self.kind == "full_attention":  # decode rows of a batch
                return block.paged_layer(k, args, x, rope, self.mixer, cache.kv, self.slot)
            # one sequence's step in the batch (one stream): the lone sequence's one call over its states; with more
            # sequences the projections and the MLP run once over every row (`_gdn_batch`)
            if len(cache.segments) == 1 and cache.all_states(0) and not env.on("TURBOSPEC_NO_GDN_KERNEL"):
                return self.lone_call(k, args, x, cache, _parents_tensor(cache.parents(0)))
            return None
        if args is None or not isinstance(cache, HybridCache):
            return None
        if self.kind == "full_attention":
            return block.decode_layer(k, args, x, rope, plan, cache.kv, self.slot)
        if not cache.track_all_states or env.on("TURBOSPEC_NO_GDN_KERNEL"):  # (the GDN kernel's off switch)
            return None
        return self.gdn_call(k, args, x, cache, _parents_tensor(cache.tree_parents))

    def lone_call(self, k, args: tuple, x: torch.Tensor, cache: HybridBatch, parents: torch.Tensor) -> torch.Tensor:
        """`gdn_layer` for a batch's one sequence (its state slot); its conv window and states to the batch's stash."""
        conv, ssm = cache.gdn_state(0, self.slot)
        pre, mid, post = args
        x, window, states = k.gdn_layer(x, *pre, conv, *mid, ssm, parents, *post)
        cache.gdn_stash(0, self.slot, window, states)
        return x

    def gdn_call(self, k, args: tuple, x: torch.Tensor, cache: HybridCache, parents: torch.Tensor) -> torch.Tensor:
        """`gdn_layer` with this layer's one-call `args`; its conv window and states go to the cache's stash."""
        conv, ssm = cache.gdn_state_raw(self.slot)
        pre, mid, post = args
        x, window, states = k.gdn_layer(x, *pre, conv, *mid, ssm, parents, *post)
        cache.gdn_stash(self.slot, window, states)
        return x

    def __call__(self, x: torch.Tensor, rope, plan: AttentionPlan, cache: HybridCache, out_rows: int | None = None
                 ) -> torch.Tensor:
        k = block.kernel_for(x, self.in_norm)
        if k is not None and (out := self._one_call(k, x, rope, plan, cache)) is not None:
            return out
        if (out_rows is not None and out_rows < x.shape[0] and self.kind == "full_attention"
                and x.shape[0] > skinny_rows(x.dtype) and plan.mask is None
                and isinstance(cache.kv, (KVCache, QuantKVCache))):
            # prefill's last layer: only the last rows are wanted
            h = self.mixer(rms_norm(x, self.in_norm, self.eps, True), rope, plan, cache.kv, self.slot, out_rows)
            x = x[-out_rows:] + h
            return x + self.mlp(rms_norm(x, self.post_norm, self.eps, True))
        k = block.fusable(x, self.mlp, self.in_norm, self.mixer)
        if k is not None and self.kind == "full_attention":  # decode / verification: fused C++ calls
            return block.attention_layer(k, x, self.mixer, self.mlp, self.in_norm, self.post_norm, self.eps, True,
                                         rope, plan, cache.kv, self.slot)
        km = block.fusable_moe(x, self.mlp, self.in_norm, self.mixer)
        if km is not None and self.kind == "full_attention":
            return block.moe_layer(km, x, self.mixer, self.mlp, self.in_norm, self.post_norm, self.eps, True, rope,
                                   plan, cache.kv, self.slot)
        if self.kind == "full_attention":
            x = x + self.mixer(rms_norm(x, self.in_norm, self.eps, True), rope, plan, cache.kv, self.slot)
            return x + self.mlp(rms_norm(x, self.post_norm, self.eps, True))
        if isinstance(cache, HybridBatch):
            return self._gdn_batch(x, cache, k, km)
        conv, ssm = cache.gdn_state(self.slot)
        gdn = self.mixer
        if k is not None or km is not None:
            proj = (k or km).norm_linear(x, self.in_norm, self.eps, True, gdn.proj.matrices, gdn.proj.bias)
            o, window, states = gdn.mix(proj, conv, ssm, cache.track_all_states, cache.tree_parents)
            cache.gdn_stash(self.slot, window, states)
            return block.ffn_tail(k or km, x, gdn.out_order(o), None, gdn.out, self.mlp, self.post_norm, self.eps, True)
        y, window, states = gdn(rms_norm(x, self.in_norm, self.eps, True), conv, ssm, cache.track_all_states,
                                cache.tree_parents)
        cache.gdn_stash(self.slot, window, states)
        x = x + y
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, True))

    def _gdn_batch(self, x: torch.Tensor, cache: HybridBatch, k, km) -> torch.Tensor:
        """A Gated DeltaNet layer over many sequences' rows: the projections and the MLP over all rows at once, the
        conv and recurrence segment by segment from each sequence's own states."""
        gdn = self.mixer
        if k is not None or km is not None:
            proj = (k or km).norm_linear(x, self.in_norm, self.eps, True, gdn.proj.matrices, gdn.proj.bias)
        else:
            proj = gdn.proj(rms_norm(x, self.in_norm, self.eps, True))
        segments = range(len(cache.segments))
        kernel = load_gdn_kernel() if proj.device.type == "cpu" else None
        if kernel is not None and all(cache.all_states(i) for i in segments):  # every sequence in one C++ call
            got = kernel.gdn_steps(proj, gdn.conv_t, gdn.neg_a, gdn.dt_bias, gdn.norm_weight,
                                   *zip(*(cache.gdn_state(i, self.slot) for i in segments)),
                                   [seg.row for seg in cache.segments] + [x.shape[0]],
                                   [_parents_tensor(cache.parents(i)) for i in segments],
                                   [cache.buffer(i) for i in segments], gdn.nk, gdn.nv, gdn.dk, gdn.dv, gdn.eps)
            for i in segments:
                cache.gdn_stash(i, self.slot, got[1 + 2 * i], got[2 + 2 * i])
            o = got[0]
        else:
            outs = []
            for i, seg in enumerate(cache.segments):
                conv, ssm = cache.gdn_state(i, self.slot)
                o, window, states = gdn.mix(proj[seg.row:seg.row + seg.n], conv, ssm, cache.all_states(i),
                                            cache.parents(i))
                cache.gdn_stash(i, self.slot, window, states)
                outs.append(o)
            o = torch.cat(outs) if len(outs) > 1 else outs[0]
        o = gdn.out_order(o)
        if k is not None or km is not None:
            return block.ffn_tail(k or km, x, o, None, gdn.out, self.mlp, self.post_norm, self.eps, True)
        x = x + gdn.out(o)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, True))


def _parents_tensor(parents: list[int] | None) -> torch.Tensor:
    """A step's token tree as the Gated DeltaNet kernels take it (empty for a chain: None)."""
    return _CHAIN if parents is None else torch.tensor(parents, dtype=torch.int64)


class HybridModel:
    """forward(tokens, plan, cache) -> final-normed hidden states; logits(hidden) -> float32 logits.

    `new_cache(max_len)` returns a `HybridCache`; chain verification with rollback works through
    `cache.commit(keep=list(range(j)))`; tree plans (with parents) keep a recurrent state per node.
    """

    def __init__(self, cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        if ws.has("model.language_model.embed_tokens.weight"):
            prefix = "model.language_model"
            skipped = [n for n in ws.names() if n.startswith(("model.visual.", "visual."))]
            if skipped:
                log.warning("qwen3_5: ignoring %d vision tensors (model.visual.*); text only", len(skipped))
        else:
            prefix = "model"
        self.prefix = prefix
        self.layer_types = cfg.layer_types()
        self.embed, self.lm_head = load_embedding(ws, prefix, cfg, dtype)
        self.experts = ExpertCache(ws.expert_budget)  # Qwen3.5-MoE / Qwen3-Next routed experts
        self.layers: list[HybridLayer] = []
        n_attn = n_gdn = 0
        for i, kind in enumerate(self.layer_types):
            p = f"{prefix}.layers.{i}"
            if kind == "full_attention":
                mixer = load_attention(ws, f"{p}.self_attn", cfg, dtype, gated=True, zero_centred=True)
                slot, n_attn = n_attn, n_attn + 1
            else:
                mixer = load_gdn(ws, f"{p}.linear_attn", cfg, dtype)
                slot, n_gdn = n_gdn, n_gdn + 1
            mlp = load_ffn(ws, f"{p}.mlp", cfg, dtype, i, self.experts)
            self.layers.append(
                HybridLayer(
                    kind,
                    slot,
                    mixer,
                    mlp,
                    ws.get(f"{p}.input_layernorm.weight", dtype, (h,)),
                    ws.get(f"{p}.post_attention_layernorm.weight", dtype, (h,)),
                    cfg.rms_norm_eps,
                )
            )
        self.num_attn_layers, self.num_gdn_layers = n_attn, n_gdn
        self.norm = ws.get(f"{prefix}.norm.weight", dtype, (h,))
        self.rope = Rope(cfg.rope, cfg.head_dim, min(cfg.max_position_embeddings, 8192), dtype)
        self.mtp_names = [n for n in ws.names() if n.startswith("mtp.")]
        self.mtp: MTPModule | None = None
        if self.mtp_names:
            self.mtp = MTPModule(cfg, ws, dtype, self.embed, self.lm_head, self.rope, experts=self.experts)
        gdn = next((layer.mixer for layer in self.layers if layer.kind == "linear_attention"), None)
        d = cfg.linear_dims()
        self._conv_shape = gdn.conv_state_shape if gdn else (d["conv_kernel"] - 1, 1)
        self._ssm_shape = gdn.ssm_state_shape if gdn else (1, 1, 1)

    def new_cache(self, max_len: int, *, k_type: str | None = None, v_type: str | None = None,
                  rollback_limit: int = 16, checkpoints: int = 0) -> HybridCache:
        """KV formats (-ctk/-ctv) apply to the attention layers only; recurrent states stay float32.
        `checkpoints`: states kept for prefix reuse across requests (`HybridCache.checkpoint`)."""
        c = self.cfg
        kv = make_kv_cache(self.num_attn_layers, c.num_kv_heads, c.head_dim, max_len, self.dtype, k_type, v_type)
        return HybridCache(self.num_attn_layers, c.num_kv_heads, c.head_dim, self.num_gdn_layers, self._conv_shape,
                           self._ssm_shape, max_len, self.dtype, rollback_limit=rollback_limit, kv=kv,
                           max_checkpoints=checkpoints)

    def new_state_pool(self, slots: int, snapshots: int, per_owner: int = 3, rollback_limit: int = 16) -> StatePool:
        """Recurrent states for `slots` sequences batched together and `snapshots` prefix-cache snapshots (at most
        `per_owner` taken by one sequence)."""
        return StatePool(self.num_gdn_layers, self._conv_shape, self._ssm_shape, self.dtype, slots, snapshots,
                         per_owner=per_owner, rollback_limit=rollback_limit)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttentionPlan, cache: Cache, out_rows: int | None = None
                ) -> torch.Tensor:
        """Final-normed hidden rows [N, H] (the last `out_rows` of them, as DenseModel.forward)."""
        if isinstance(cache, HybridBatch):  # many sequences' causal rows (continuous batching)
            cache.begin(tokens.numel())
        elif not isinstance(cache, HybridCache):
            raise TurboSpecError("hybrid models need the cache from HybridModel.new_cache()")
        else:
            if plan.mask is not None and plan.parents is None:
                raise TurboSpecError("hybrid models need tree steps as AttentionPlan.tree(...) (with parents)")
            cache.begin(tokens.numel())
            cache.set_tree(plan.parents)
        x = embedding_rows(self.embed, tokens, self.dtype)
        rope = self.rope.tables_for(plan)
        if (one := self._one_calls(x, plan, cache)) is not None:  # decode, verification: one C++ call per layer
            x = self._decode_layers(*one, x, rope, plan, cache)  # type: ignore[arg-type]
        elif (rows := self._batch_calls(x, cache)) is not None:  # a batch's step rows
            x = self._batch_layers(*rows, x, rope, plan, cache)  # type: ignore[arg-type]
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, plan, cache, out_rows if i == last else None)
        if out_rows:
            x = x[-out_rows:]  # a last Gated DeltaNet layer computes every row
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, True)

    def _one_calls(self, x: torch.Tensor, plan: AttentionPlan, cache: Cache) -> tuple[object, list[tuple]] | None:
        """(the kernel module, every layer's one-call arguments) where the whole step takes the one-call kernels (a
        few causal or tree rows at the end of a plain cache, or of a packed one whose formats the kernels write,
        every layer's structure fusable), else None: the layers then choose one by one, as `HybridLayer.__call__`."""
        if (not isinstance(cache, HybridCache) or not cache.track_all_states or not block.at_end(plan, cache)
                or env.on("TURBOSPEC_NO_GDN_KERNEL")):
            return None
        kv = cache.kv
        if not isinstance(kv, KVCache) and not (isinstance(kv, QuantKVCache) and block.packed_kernels_take(plan, kv)):
            return None
        return self._layer_calls(x)

    def _layer_calls(self, x: torch.Tensor) -> tuple[object, list[tuple]] | None:
        """(the kernel module, every layer's one-call arguments) where the rows x take the fused calls and every
        layer's structure has them, else None."""
        k = block.kernel_for(x, self.layers[0].in_norm)
        calls = [layer.one_call_args() for layer in self.layers] if k is not None else [None]
        return None if any(c is None for c in calls) else (k, calls)  # type: ignore[return-value]

    def _batch_calls(self, x: torch.Tensor, cache: Cache) -> tuple[object, list[tuple]] | None:
        """`_one_calls` for a batch (`HybridBatch`) of step rows only (decode rows, chains, small trees) over a pool
        the paged kernel reads, else None."""
        if (not isinstance(cache, HybridBatch) or not cache.kv.decode_only or cache.kv.pool.step_args(0) is None
                or env.on("TURBOSPEC_NO_GDN_KERNEL")):
            return None
        return self._layer_calls(x)

    def _batch_layers(self, k, calls: list[tuple], x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      plan: AttentionPlan, cache: HybridBatch) -> torch.Tensor:
        """The layers of a `_batch_calls` step without the per-layer choices: each layer's result equals its
        `HybridLayer.__call__` (one sequence's Gated DeltaNet layers as its one call, several sequences' through
        `_gdn_batch`)."""
        alone = len(cache.segments) == 1 and cache.all_states(0)
        par = _parents_tensor(cache.parents(0)) if alone else _CHAIN
        for layer, args in zip(self.layers, calls):
            if layer.kind == "full_attention":  # None where a K/V value is not finite (the general path says so)
                out = block.paged_layer(k, args, x, rope, layer.mixer, cache.kv, layer.slot)
                x = out if out is not None else layer(x, rope, plan, cache)
            elif alone:
                x = layer.lone_call(k, args, x, cache, par)
            else:
                x = layer._gdn_batch(x, cache, k, None)
        return x

    def _decode_layers(self, k, calls: list[tuple], x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       plan: AttentionPlan, cache: HybridCache) -> torch.Tensor:
        """The layers of a `_one_calls` step without the per-layer choices (several percent of a small model's
        step): each layer's result equals its `HybridLayer.__call__`."""
        kv, pos = cache.kv, cache.length
        attn_parents = block.tree_parents(plan)
        gdn_parents = _parents_tensor(cache.tree_parents)
        for layer, (pre, mid, post) in zip(self.layers, calls):
            if layer.kind != "full_attention":
                x = layer.gdn_call(k, (pre, mid, post), x, cache, gdn_parents)
            elif isinstance(kv, KVCache):
                x = k.layer_decode(x, *pre, rope[0], rope[1], *mid, kv.k[layer.slot], kv.v[layer.slot], pos, *post,
                                   attn_parents, 0)
            else:  # a packed cache: None where a K/V value is not finite (the layer's general path says so)
                out = k.layer_packed(x, *pre, rope[0], rope[1], *mid, *kv.step_args(layer.slot), pos, kv.base, *post,
                                     attn_parents)
                x = out if out is not None else layer(x, rope, plan, cache)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return float_logits(self.lm_head, hidden)

    @property
    def weight_bytes(self) -> int:
        n = embedding_bytes(self.embed, self.lm_head)
        for layer in self.layers:
            m = layer.mixer
            n += m.nbytes if isinstance(m, GatedDeltaNet) else m.qkv.nbytes + m.o.nbytes
            n += layer.mlp.nbytes
        return n
