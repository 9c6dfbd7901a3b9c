"""Fused few-row attention over a KV cache in any plain or packed format (turbospec/kernels/attention.cpp).

`partial(q, k_spec, k_fields, v_spec, v_fields, v_width, start, end)` returns the partial softmax state
(max m, sum l, unnormalized accumulator acc) of q's rows over positions [start, end); the caller finishes
(`acc / l`) or keeps merging other positions into it (online softmax). A spec is plain data, (kind, index
bits, field names, centroid table); the KV layer (kv/kernel_args.py, `attention_spec`) derives it from a
format (None for formats without a kernel path, e.g. TurboQuant-prod: callers use torch).
"""

from __future__ import annotations

import torch

from turbospec import env
from turbospec.kernels.gemv import load_extension

# kinds shared with attention.cpp (TURBO: 128-value rotation blocks, TURBO64: 64-value blocks)
F32, F16, BF16, Q8_0, Q4_0, TBQ4_0, TURBO, TURBO64 = range(8)
_PLAIN = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
NO_TABLE = torch.empty(0)
PLAIN_SPECS = {dt: (kind, 0, ("data",), NO_TABLE) for dt, kind in _PLAIN.items()}
MAX_ROWS = 64  # above this many query rows per KV head (prefill), batched matmuls win
TILE = 256  # positions per parallel task
PREFILL_BLOCK = 8192  # committed positions per flash call in `prefill_rows`
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def load():
    if env.on("TURBOSPEC_NO_ATTN_KERNEL"):
        return None
    return load_extension("turbospec_attn", "attention.cpp", "attention")


def partial(q: torch.Tensor, k_spec, k_fields: list[torch.Tensor], v_spec, v_fields: list[torch.Tensor],
            v_width: int, start: int, end: int, mod=None):
    """q float32 [KVH, R, Dk] (scaled; rotated and zero-padded to K's decoded width); fields [KVH, T, ...].
    Returns m [KVH, R], l [KVH, R], acc [KVH, R, v_width]. `mod`: the loaded kernel, when the caller has
    it."""
    mod = mod or load()
    return mod.attend_partial(q, k_spec[0], k_spec[1], k_fields, k_spec[3], v_spec[0], v_spec[1], v_width,
                              v_fields, v_spec[3], start, end, TILE)


def decode(spec, fields: list[torch.Tensor], width: int, start: int, end: int, mod=None) -> torch.Tensor:
    """Positions [start, end) of a K or V source in `spec`'s format (fields [heads, T, ...]) as float32 [heads,
    end - start, width]: the values of the format's torch decoder (rotated formats in the rotated domain)."""
    mod = mod or load()
    return mod.decode_rows(spec[0], spec[1], width, fields, spec[3], start, end)


def dense_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
    """Attention of q [H, 1, D] over plain K/V views [KVH, L, D] (any of f32/f16/bf16), or None when the
    kernel is unavailable. Output [H, 1, D] in q's dtype."""
    h, _, d = q.shape
    kvh = keys.shape[0]
    mod = load()
    if mod is None or d % 8 or keys.dtype not in _PLAIN or values.dtype not in _PLAIN:
        return None
    qg = q.reshape(kvh, h // kvh, d).to(torch.float32) * scale
    _, lsum, acc = partial(qg, PLAIN_SPECS[keys.dtype], [keys], PLAIN_SPECS[values.dtype], [values], d, 0,
                           keys.shape[1], mod)
    return (acc / lsum.unsqueeze(-1)).to(q.dtype).reshape(h, 1, d)


def paged(q: torch.Tensor, k_spec, k_fields: list[torch.Tensor], v_spec, v_fields: list[torch.Tensor], v_width: int,
          tables: torch.Tensor, lens: torch.Tensor, block: int, masks: torch.Tensor | None = None,
          mod=None) -> torch.Tensor:
    """Attention of many sequences over a paged cache: q float32 [S, KVH, R, Dk] (scaled, rotated and padded as
    for `partial`), fields [KVH, blocks * block, ...], tables int32 [S, max blocks], lens int64 [S] (positions
    each sequence attends), masks int64 [S] or None (bit k clear: the position k places before the last one is
    not attended, for k < 64; -1: all). Returns the normalized output [S, KVH, R, v_width] float32."""
    mod = mod or load()
    return mod.attend_paged(q, k_spec[0], k_spec[1], k_fields, k_spec[3], v_spec[0], v_spec[1], v_width, v_fields,
                            v_spec[3], tables, lens, block, masks)


def prefill_rows_available() -> bool:
    """Whether this torch has the CPU flash kernel `flash` and `prefill_rows` call."""
    return _FLASH is not None


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of float32 q [B, H, R, D] over k, v [B, H, T, D] on the CPU, with its log-sum-exp:
    (out [B, H, R, D], lse [B, H, R]) from torch's CPU flash kernel (the one SDPA calls, which keeps lse to
    itself). `scale` defaults to 1/sqrt(D)."""
    if _FLASH is None:
        raise RuntimeError("this torch has no CPU flash attention kernel")
    out, lse = _FLASH(q, k, v, is_causal=causal, scale=scale)[:2]
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions of the same rows over disjoint positions (outputs [..., R, D], log-sum-exps
    [..., R]) -> the attention over their union."""
    m = torch.maximum(lse, lse2)
    w, w2 = torch.exp(lse - m), torch.exp(lse2 - m)
    total = w + w2
    out = out.mul(w.div(total).unsqueeze(-1)).add_(out2.mul(w2.div_(total).unsqueeze(-1)))
    return out, m.add_(total.log_())


def prefill_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                 scale: float | None = None) -> torch.Tensor | None:
    """Causal attention of q [H, R, D] (rows at positions start .. start+R-1) over a plain CPU cache's keys and
    values [KVH, start+R, D], in float32: the rows' own positions causally per head, then the committed positions
    in blocks of PREFILL_BLOCK with the query heads of a group as rows of their KV head (no mask over the
    context, no per-head copy of the cache), merged by log-sum-exp. About 2.5x SDPA with a mask over a 16-bit
    cache (docs/speed.md). `scale` defaults to 1/sqrt(D). None where torch has no CPU flash kernel (callers use
    SDPA)."""
    if not prefill_rows_available():
        return None
    h, r, d = q.shape
    kvh = keys.shape[0]
    g = h // kvh
    qf = q.to(torch.float32)
    own_k, own_v = keys[:, start:].to(torch.float32), values[:, start:].to(torch.float32)
    if g > 1:
        own_k, own_v = own_k.repeat_interleave(g, 0), own_v.repeat_interleave(g, 0)
    out, lse = flash(qf[None], own_k[None], own_v[None], causal=True, scale=scale)
    out, lse = out[0].reshape(kvh, g * r, d), lse[0].reshape(kvh, g * r)  # rows: (query head in group, token)
    qg = qf.reshape(1, kvh, g * r, d)
    for s in range(0, start, PREFILL_BLOCK):
        e = min(start, s + PREFILL_BLOCK)
        o2, l2 = flash(qg, keys[None, :, s:e].to(torch.float32), values[None, :, s:e].to(torch.float32), scale=scale)
        out, lse = merge(out, lse, o2[0], l2[0])
    return out.reshape(h, r, d).to(q.dtype)
