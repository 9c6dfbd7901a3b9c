"""A decoder layer's decode / verification step in one to three C++ calls (turbospec/kernels/gemv.cpp).

`attn_in`: input RMSNorm, the fused qkv product, q/k RMSNorm and RoPE. `out_mlp`: the output gate, the output
projection and residual, the post-mixer RMSNorm, the SwiGLU MLP and its residual. Between them the step's K/V go
into the cache and attention runs (or the Gated DeltaNet recurrence, after `norm_linear`). Causal tokens or a draft
tree over a plain `KVCache` (decoding, verification) run the whole layer in one call (`layer_decode`). For up to
`SKINNY_MAX_ROWS` tokens this replaces ~30 torch ops per layer; every intermediate is rounded to the model
dtype where the op-by-op path rounds (tests/test_block.py compares the two). `TURBOSPEC_NO_FUSED=1` (read at
import) turns it off.
"""

from __future__ import annotations

import math

import torch

from turbospec import env
from turbospec.kernels.gemv import load_kernel
from turbospec.kv.cache import KVCache
from turbospec.kv.paged import PagedBatch
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.linear import Linear, RowParallelLinear, SplitLinear, skinny_rows
from turbospec.layers.moe import MoE, RowParallelMoE
from turbospec.layers.norm import rms_norm

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENABLED = env.FUSED  # read once (TURBOSPEC_NO_FUSED): this is checked per layer per token


def kernel_for(x: torch.Tensor, norm: torch.Tensor):
    """The kernel module when rows x [N, hidden] can go through the fused calls (few rows, matching dtypes),
    else None."""
    if (not ENABLED or x.dim() != 2 or x.shape[0] > skinny_rows(x.dtype) or x.dtype not in _DTYPES
            or norm.dtype != x.dtype):
        return None
    return load_kernel()


def _one_matrix(m) -> bool:
    return isinstance(m.inner if isinstance(m, RowParallelLinear) else m, Linear)


def _input_projection(m) -> bool:
    """A mixer's input projection (qkv, the Gated DeltaNet's inputs): one matrix, or parts in different formats,
    which the kernels take as a list (`matrices`)."""
    return isinstance(m, Linear) or (isinstance(m, SplitLinear) and all(isinstance(p, Linear) for p in m.parts))


def fusable_structure(mlp, mixer) -> bool:
    """Whether a decoder layer's MLP is a SwiGLU `MLP` (not MoE) whose projections are single matrices and its
    mixer's output projection is one matrix (its input projection may be parts)."""
    inp, out = mixer.linears()
    return isinstance(mlp, MLP) and all(_one_matrix(m) for m in (*mlp.linears(), out)) and _input_projection(inp)


def fusable(x: torch.Tensor, mlp, norm: torch.Tensor, mixer):
    """`kernel_for(x, norm)` for a layer of `fusable_structure`, else None."""
    return kernel_for(x, norm) if fusable_structure(mlp, mixer) else None


class OneCall:
    """The arguments of a layer's one-call kernel that stay the same from step to step (weights, norms, sizes), worked
    out on the layer's first step and again when one of the objects in `key` is replaced (the MTP block's bf16
    copies, tensor-parallel wrapping): a decode step then pays for the call, not for the checks and attribute
    lookups that pick it (several microseconds per layer, a tenth of a small model's step)."""

    __slots__ = ("key", "args")

    def __init__(self) -> None:
        self.key: tuple = ()
        self.args = None

    def get(self, key: tuple, build):
        """`build()` (a tuple of argument groups, or None where the layer cannot take the call) for these `key`
        objects; compared by identity (layers and projections define no equality)."""
        if key != self.key:
            self.key, self.args = key, build()
        return self.args


def layer_decode_args(attn: Attention, mlp, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, zc: bool
                      ) -> tuple | None:
    """`layer_decode`'s unchanging arguments as (before the RoPE tables, between them and the cache, after the
    cache's length) for a layer that `fusable` takes, with whole output and down projections and a head size the
    one-call attention takes; None otherwise."""
    inp, out = attn.linears()
    if not fusable_structure(mlp, attn) or split(out, mlp.down) or attn.hd % 8:
        return None
    return ((in_norm, eps, zc, inp.matrices, inp.bias, attn.q_norm, attn.k_norm), (attn.nh, attn.nkv, attn.hd, attn.gated),
            (1.0 / math.sqrt(attn.hd), out.weight, out.bias, post_norm, mlp.gate_up.weight, mlp.gate_up.bias,
             mlp.down.weight, mlp.down.bias))


def layer_key(mixer, mlp) -> tuple:
    """The objects whose replacement changes a layer's one-call arguments (`OneCall.get`)."""
    return (mixer, *mixer.linears(), mlp, *(mlp.linears() if isinstance(mlp, MLP) else ()))


def decode_layer(k, args: tuple, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan,
                 cache, layer: int, out_rows: int | None = None) -> torch.Tensor | None:
    """A decoder layer in one `layer_decode` call with the arguments of `layer_decode_args` (whose head size the
    one-call attention takes): causal tokens or a draft tree at the end of a plain cache (each row equal to its
    single-token step); None for any other step (`attention_layer` then). `out_rows` = r (causal rows): every row's
    K/V are stored, the last r rows alone attend and go on ([r, hidden])."""
    if not isinstance(cache, KVCache) or not at_end(plan, cache):
        return None
    pre, mid, post = args
    parents = tree_parents(plan)
    keep = out_rows if out_rows is not None and out_rows < x.shape[0] and not parents else 0
    return k.layer_decode(x, *pre, rope[0], rope[1], *mid, cache.k[layer], cache.v[layer], cache.length, *post,
                          parents, keep)


def paged_layer(k, args: tuple, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Attention, cache,
                layer: int) -> torch.Tensor | None:
    """A decoder layer in one `layer_paged_rows` call with the arguments of `layer_decode_args`: the step rows of a
    paged batch (`_paged_rows`); None for any other step, or where the kernel declines it (`attention_layer`
    then). The call `attention_layer` makes, without its checks and lookups per layer and step."""
    if not _paged_rows(attn, cache):
        return None
    pre, mid, post = args
    return k.layer_paged_rows(x, *pre, rope[0], rope[1], *mid, *cache.pool.step_args(layer), cache.slots, cache.tables,
                              cache.lens, cache.pool.block, post[0], cache.masks, *post[1:])


def split(*projections) -> bool:
    """Whether one of a layer's output / down `projections` is one part of a tensor-parallel sum
    (`RowParallelLinear`): then its kernels run up to each sum, which the projection does between them."""
    return any(isinstance(p, RowParallelLinear) for p in projections)


def fusable_moe(x: torch.Tensor, moe, norm: torch.Tensor, mixer):
    """`kernel_for(x, norm)` for a layer whose feed-forward is a mixture of experts (`moe_layer`; under tensor
    parallelism its part, with the mixer's output projection's), else None."""
    inp, out = mixer.linears()
    if not isinstance(moe, (MoE, RowParallelMoE)) or not (_one_matrix(out) and _input_projection(inp)):
        return None
    return kernel_for(x, norm)


def moe_layer(k, x: torch.Tensor, attn: Attention, moe: MoE | RowParallelMoE, in_norm: torch.Tensor,
              post_norm: torch.Tensor, eps: float, zc: bool, rope: tuple[torch.Tensor, torch.Tensor],
              plan: AttentionPlan, cache, layer: int) -> torch.Tensor:
    """x + attention + MoE for x [N, hidden], N <= SKINNY_MAX_ROWS (k from `fusable_moe`): `attention_rows`, then
    `moe_tail`."""
    a, gate = attention_rows(k, x, attn, in_norm, eps, zc, rope, plan, cache, layer)
    return moe_tail(x, a, gate, attn.o, moe, post_norm, eps, zc)


def attention_rows(k, x: torch.Tensor, attn: Attention, in_norm: torch.Tensor, eps: float, zc: bool,
                   rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, cache, layer: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attention output [N, H*D], output gate or None) of rows x over `cache`, as `attention_layer` computes them
    (each causal or tree row equal to its single-token step): in one call where the kernels take the step (a
    packed cache's, a paged batch's step rows, a plain cache's), else `attn_in` and the cache's own attention."""
    if ((_packed_step(attn, plan, cache)
         and (r := _packed_attention(k, x, attn, in_norm, eps, zc, rope, plan, cache, layer)) is not None)
            or (_paged_rows(attn, cache)
                and (r := _paged_attention(k, x, attn, in_norm, eps, zc, rope, cache, layer)) is not None)):
        return r
    if _one_call(attn, plan, cache):
        a, qkv = k.attn_decode(x, in_norm, eps, zc, attn.qkv.matrices, attn.qkv.bias, attn.q_norm, attn.k_norm,
                               rope[0], rope[1], attn.nh, attn.nkv, attn.hd, attn.gated, cache.k[layer],
                               cache.v[layer], cache.length, 1.0 / math.sqrt(attn.hd),
                               tree_parents(plan))
        return a, attn.split(qkv, x.shape[0])[3]
    return _attend(k, x, attn, in_norm, eps, zc, rope, plan, cache, layer)


def moe_tail(x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor | None, o, moe: MoE | RowParallelMoE,
             post_norm: torch.Tensor, eps: float, zc: bool) -> torch.Tensor:
    """x1 = x + o(a * sigmoid(gate)); x1 + moe(norm(x1)): every op row by row, so a row's result does not depend
    on the other rows of the step."""
    if gate is not None:
        a = a * torch.sigmoid(gate)
    x = x + o(a)
    return x + moe(rms_norm(x, post_norm, eps, zc))


def ffn_tail(k, x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor | None, o, ffn: MLP | MoE | RowParallelMoE,
             post_norm: torch.Tensor, eps: float, zc: bool) -> torch.Tensor:
    """`moe_tail` for a mixture of experts, else `out_mlp`."""
    if isinstance(ffn, (MoE, RowParallelMoE)):
        return moe_tail(x, a, gate, o, ffn, post_norm, eps, zc)
    return out_mlp(k, x, a, gate, o, ffn, post_norm, eps, zc)


def attention_layer(k, x: torch.Tensor, attn: Attention, mlp: MLP, in_norm: torch.Tensor, post_norm: torch.Tensor,
                    eps: float, zc: bool, rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, cache,
                    layer: int) -> torch.Tensor:
    """x + attention + MLP for x [N, hidden], N <= SKINNY_MAX_ROWS (k: the loaded kernel from `fusable`), for the
    steps `decode_layer` and `paged_layer` do not take (the layers try them first): tensor-parallel parts, packed
    caches, paged batches that mix step rows with prompt chunks, rows that do not end the cache."""
    if _packed_step(attn, plan, cache) and not split(attn.o, mlp.down):  # the whole layer in one call
        out = k.layer_packed(x, in_norm, eps, zc, attn.qkv.matrices, attn.qkv.bias, attn.q_norm, attn.k_norm,
                             rope[0], rope[1], attn.nh, attn.nkv, attn.hd, attn.gated, *cache.step_args(layer),
                             cache.length, cache.base, 1.0 / math.sqrt(attn.hd), attn.o.weight, attn.o.bias,
                             post_norm, mlp.gate_up.weight, mlp.gate_up.bias, mlp.down.weight, mlp.down.bias,
                             tree_parents(plan))
        if out is not None:
            return out
    # the attention (in one call where the kernels take the step: under tensor parallelism, then out_mlp's parts)
    a, gate = attention_rows(k, x, attn, in_norm, eps, zc, rope, plan, cache, layer)
    return out_mlp(k, x, a, gate, attn.o, mlp, post_norm, eps, zc)


def at_end(plan: AttentionPlan, cache) -> bool:
    """Causal tokens (decode, chain verification) or a draft tree at the cache's end."""
    return (plan.mask is None or plan.parents is not None) and plan.start == cache.length


def _step_rows(attn: Attention, plan: AttentionPlan, cache) -> bool:
    """`at_end` rows with a head size that is a multiple of 8: the rows the one-call kernels compute, each equal to
    the single-token step that decodes it."""
    return attn.hd % 8 == 0 and at_end(plan, cache)


def _one_call(attn: Attention, plan: AttentionPlan, cache) -> bool:
    """`_step_rows` over a plain cache: the attention runs inside one kernel call (`layer_decode`, `attn_decode`)."""
    return isinstance(cache, KVCache) and _step_rows(attn, plan, cache)


def _packed_step(attn: Attention, plan: AttentionPlan, cache) -> bool:
    """`_step_rows` over a packed cache whose formats the kernels encode and read: the step's K/V stored and the
    attention run inside one kernel call (`layer_packed`, `attn_packed`; a decode token: the same cache bytes and
    output as `QuantKVCache.attend`)."""
    return isinstance(cache, QuantKVCache) and _step_rows(attn, plan, cache) and packed_kernels_take(plan, cache)


def packed_kernels_take(plan: AttentionPlan, cache: QuantKVCache) -> bool:
    """Whether the one-call kernels write and read this packed cache for the step: its formats have C++ paths and
    the step does not start before the cache's first attended position."""
    return cache.base <= plan.start and cache.step_args(0) is not None


def _paged_rows(attn: Attention, cache) -> bool:
    """Decode rows of many sequences (one each) over a paged pool whose formats the kernels encode and read: the
    rows' K/V stored and their attention run inside one kernel call (`attn_paged_rows`; the same arithmetic as
    `PagedBatch.attend`)."""
    return (isinstance(cache, PagedBatch) and cache.decode_only and attn.hd % 8 == 0
            and cache.pool.step_args(0) is not None)


def _paged_attention(k, x: torch.Tensor, attn: Attention, in_norm: torch.Tensor, eps: float, zc: bool,
                     rope: tuple[torch.Tensor, torch.Tensor], cache: PagedBatch, layer: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(attention output [S, H*D], output gate or None) of `_paged_rows` in one call, or None: a K/V value that is
    not finite (the general path then handles the step)."""
    r = k.attn_paged_rows(x, in_norm, eps, zc, attn.qkv.matrices, attn.qkv.bias, attn.q_norm, attn.k_norm, rope[0],
                          rope[1], attn.nh, attn.nkv, attn.hd, attn.gated, *cache.pool.step_args(layer), cache.slots,
                          cache.tables, cache.lens, cache.pool.block, 1.0 / math.sqrt(attn.hd), cache.masks)
    return (r[0], attn.split(r[1], x.shape[0])[3]) if r else None


def tree_parents(plan: AttentionPlan) -> list[int]:
    """The step's token tree as the attention kernels take it (empty for causal rows)."""
    return plan.parents if plan.mask is not None else []


def _packed_attention(k, x: torch.Tensor, attn: Attention, in_norm: torch.Tensor, eps: float, zc: bool,
                      rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, cache, layer: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(attention output [N, H*D], output gate or None) of a `_packed_step` in one call, or None: a K/V value that
    is not finite (the general path then raises the error)."""
    r = k.attn_packed(x, in_norm, eps, zc, attn.qkv.matrices, attn.qkv.bias, attn.q_norm, attn.k_norm, rope[0], rope[1],
                      attn.nh, attn.nkv, attn.hd, attn.gated, *cache.step_args(layer), cache.length, cache.base,
                      1.0 / math.sqrt(attn.hd), tree_parents(plan))
    return (r[0], attn.split(r[1], x.shape[0])[3]) if r else None


def _attend(k, x: torch.Tensor, attn: Attention, in_norm: torch.Tensor, eps: float, zc: bool,
            rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, cache, layer: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attention output [N, H*D], output gate or None) through `attn_in` and the cache's own attention."""
    qkv = k.attn_in(x, in_norm, eps, zc, attn.qkv.matrices, attn.qkv.bias, attn.q_norm, attn.k_norm, rope[0],
                    rope[1], attn.nh, attn.nkv, attn.hd, attn.gated)
    q, kk, v, gate = attn.split(qkv, x.shape[0])
    return attn.mix(q, kk, v, plan, cache, layer), gate


def out_mlp(k, x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor | None, o, mlp: MLP, post_norm: torch.Tensor,
            eps: float, zc: bool) -> torch.Tensor:
    """x1 = x + o(a * sigmoid(gate)); x1 + mlp(norm(x1)). With a tensor-parallel output or down projection: the
    gate, each projection with its sum, the norm with the gate/up product (one call) and SwiGLU."""
    if split(o, mlp.down):
        if gate is not None:
            a = a * torch.sigmoid(gate)
        x = x + o(a)
        h = k.norm_linear(x, post_norm, eps, zc, mlp.gate_up.matrices, mlp.gate_up.bias)
        return x + mlp.down(k.silu_mul(h))
    return k.out_mlp(x, a, gate, o.weight, o.bias, post_norm, eps, zc, mlp.gate_up.weight, mlp.gate_up.bias,
                     mlp.down.weight, mlp.down.bias)
