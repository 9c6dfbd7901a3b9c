"""A decoder layer's decode / verification step in two C++ calls around the mixer (turbospec/kernels/gemv.cpp).

`attn_in`: input RMSNorm, the fused qkv product, q/k RMSNorm and RoPE. `out_mlp`: the output gate, the output
projection and residual, the post-mixer RMSNorm, the SwiGLU MLP and its residual. Between them the step's K/V go
into the cache and attention runs (or the Gated DeltaNet recurrence, after `norm_linear`). For up to
`SKINNY_MAX_ROWS` tokens this replaces ~30 torch ops per layer; every intermediate is rounded to the model
dtype where the op-by-op path rounds (tests/test_block.py compares the two). `TURBOSPEC_NO_FUSED=1` (read at
import) turns it off.
"""

from __future__ import annotations

import math
import os
from functools import cache

import torch

from turbospec.kernels import attention as fused_attention
from turbospec.kernels.gemv import load_kernel
from turbospec.kv.cache import KVCache
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.attention import MLP, Attention
from turbospec.layers.linear import SKINNY_MAX_ROWS

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENABLED = not os.environ.get("TURBOSPEC_NO_FUSED")  # read once: this is checked per layer per token


@cache
def _modules():
    """(the skinny-GEMM / fused-layer module, the attention module); either may be None."""
    return load_kernel(), fused_attention.load()


def fusable(x: torch.Tensor, mlp, norm: torch.Tensor):
    """The kernel module when this step can run fused (few rows, a SwiGLU MLP, matching dtypes), else None."""
    if not ENABLED or not isinstance(mlp, MLP):
        return None
    if x.dim() != 2 or x.shape[0] > SKINNY_MAX_ROWS or x.dtype not in _DTYPES or norm.dtype != x.dtype:
        return None
    return _modules()[0]


def attention_layer(k, x: torch.Tensor, attn: Attention, mlp: MLP, in_norm: torch.Tensor, post_norm: torch.Tensor,
                    eps: float, zc: bool, rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, cache,
                    layer: int) -> torch.Tensor:
    """x + attention + MLP for x [N, hidden], N <= SKINNY_MAX_ROWS (k: the loaded kernel from `fusable`)."""
    n = x.shape[0]
    qkv = k.attn_in(x, in_norm, eps, zc, attn.qkv.weight, attn.qkv.bias, attn.q_norm, attn.k_norm, rope[0],
                    rope[1], attn.nh, attn.nkv, attn.hd, attn.gated)
    a = _plain_decode(qkv, attn, plan, cache, layer)
    if a is not None:
        gate = qkv[:, : attn.q_width].view(attn.nh, 2 * attn.hd)[:, attn.hd:].reshape(1, -1) if attn.gated else None
    else:
        q, kk, v, gate = attn.split(qkv, n)
        a = attn.mix(q, kk, v, plan, cache, layer)
    return out_mlp(k, x, a, gate, attn.o, mlp, post_norm, eps, zc)


def _plain_decode(qkv: torch.Tensor, attn: Attention, plan: AttentionPlan, cache, layer: int) -> torch.Tensor | None:
    """A single decode token over a plain `KVCache`: store K/V and attend in one C++ call; None otherwise."""
    if qkv.shape[0] != 1 or plan.mask is not None or not isinstance(cache, KVCache) or attn.hd % 8:
        return None
    mod = _modules()[1]
    if mod is None:
        return None
    return mod.decode_step(qkv, cache.k[layer], cache.v[layer], cache.length, attn.nh, attn.nkv, attn.hd, attn.gated,
                           1.0 / math.sqrt(attn.hd))


def out_mlp(k, x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor | None, o, mlp: MLP, post_norm: torch.Tensor,
            eps: float, zc: bool) -> torch.Tensor:
    """x1 = x + o(a * sigmoid(gate)); x1 + mlp(norm(x1))."""
    return k.out_mlp(x, a, gate, o.weight, o.bias, post_norm, eps, zc, mlp.gate_up.weight, mlp.gate_up.bias,
                     mlp.down.weight, mlp.down.bias)
