"""Full (optionally gated) attention over a KV cache, following an AttentionPlan."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from turbospec.kernels import attention as fused
from turbospec.kernels import gpu
from turbospec.kernels import triton_attention as gpu_attention
from turbospec.kernels.gemv import load_kernel
from turbospec.kv.paged import PagedBatch
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.layers.linear import Linear, SplitLinear
from turbospec.layers.norm import rms_norm


class Attention:
    def __init__(
        self,
        qkv: Linear | SplitLinear,
        o: Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
        gated: bool = False,
        zero_centred: bool = False,
    ):
        self.qkv, self.o = qkv, o
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim
        self.q_norm, self.k_norm = q_norm, k_norm
        self.eps, self.gated, self.zc = eps, gated, zero_centred
        self.q_width = num_heads * head_dim * (2 if gated else 1)
        self.kv_width = num_kv_heads * head_dim

    def linears(self) -> tuple:
        return self.qkv, self.o

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan,
                 cache, layer: int, out_rows: int | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, hidden]; with `out_rows` = r < N (causal plan over one sequence's cache) every row's
        K/V is stored but only the last r rows are attended and projected: [r, hidden]."""
        from turbospec.layers.rope import apply_rope

        n = x.shape[0]
        q, k, v, gate = self.split(self.qkv(x), n)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps, self.zc)
            k = rms_norm(k, self.k_norm, self.eps, self.zc)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)  # [N, 1, rot]: broadcast over heads
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if out_rows is not None and out_rows < n:
            out = self.attend_last(q, k, v, plan, cache, layer, out_rows)
            gate = gate[-out_rows:] if gate is not None else None
        else:
            out = self.mix(q, k, v, plan, cache, layer)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out)

    def attend_last(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, cache, layer: int,
                    r: int) -> torch.Tensor:
        """Store every row's k/v (a plain or packed cache); attend the last r query rows only (causally) ->
        [r, H*D]."""
        if isinstance(cache, QuantKVCache):  # the packed cache's attend takes the last rows itself
            return self.mix(q[-r:], k, v, plan, cache, layer)
        n = q.shape[0]
        qs = q[-r:].transpose(0, 1)
        keys, values = cache.write(layer, k.transpose(0, 1), v.transpose(0, 1))
        if r == 1:  # the last position sees every cached key: no mask
            out = _decode_attention(qs, keys, values)
        elif (out := _cpu_rows(qs, keys, values, plan.start + n - r)) is None:
            mask, causal = AttentionPlan.causal(plan.start + n - r, r).sdpa_mask(q.device)
            out = F.scaled_dot_product_attention(qs.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                 attn_mask=mask, is_causal=causal, enable_gqa=self.nh != self.nkv)[0]
        return out.transpose(0, 1).reshape(r, self.nh * self.hd)

    def split(self, qkv: torch.Tensor, n: int):
        """q [N, H, D], k and v [N, KVH, D] and the output gate ([N, H*D] or None) from the qkv product."""
        q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        gate = None
        if self.gated:
            qg = q.view(n, self.nh, 2 * self.hd)
            q, gate = qg[..., : self.hd], qg[..., self.hd:].reshape(n, self.nh * self.hd)
        return q.reshape(n, self.nh, self.hd), k.reshape(n, self.nkv, self.hd), v.view(n, self.nkv, self.hd), gate

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, cache,
            layer: int) -> torch.Tensor:
        """Store the step's k/v and attend: q [N, H, D] (normed, rotated), k/v [N, KVH, D] -> [N, H*D]; a packed
        cache also takes the step's last R < N query rows under a causal plan (-> [R, H*D])."""
        n = q.shape[0]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if isinstance(cache, (QuantKVCache, PagedBatch)):  # packed KV formats / many sequences: the cache attends
            out = (cache.attend(layer, q, k, v, plan, 1.0 / math.sqrt(self.hd)) if isinstance(cache, QuantKVCache)
                   else cache.attend(layer, q, k, v, 1.0 / math.sqrt(self.hd)))
        else:
            keys, values = cache.write(layer, k, v)
            if n == 1 and plan.mask is None:
                out = _decode_attention(q, keys, values)
            elif gpu_rows(q, keys):
                out = _rows_attention(q, keys, values, plan)
            elif plan.mask is not None or (out := _cpu_rows(q, keys, values, plan.start)) is None:
                mask, causal = plan.sdpa_mask(q.device)
                out = F.scaled_dot_product_attention(
                    q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, is_causal=causal,
                    enable_gqa=self.nh != self.nkv,
                )[0]
        return out.transpose(0, 1).reshape(n, self.nh * self.hd)


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row per head (q [H, 1, D]) over [KVH, L, D]: batched matmuls (GQA by grouping query heads),
    cheaper than SDPA's setup for a single row. A kernel reads 16-bit caches directly (no float32 copy of the cache):
    Triton's on a GPU, the fused C++ one on the CPU when it is built; otherwise 16-bit caches are multiplied in
    float32: without AVX-512 BF16/FP16, torch's 16-bit batched matmul is ~3x slower than converting
    (docs/speed.md)."""
    h, _, d = q.shape
    if gpu.wanted(q) and gpu_attention.supports(fused.PLAIN_SPECS.get(keys.dtype), d):
        return gpu_attention.decode(q, keys, values, 1.0 / math.sqrt(d))  # reads the 16-bit cache directly
    out = fused.dense_decode(q, keys, values, 1.0 / math.sqrt(d))
    if out is not None:
        return out
    kvh = keys.shape[0]
    qg = q.reshape(kvh, h // kvh, d).float()
    scores = torch.matmul(qg, keys.transpose(1, 2).float()) * (1.0 / math.sqrt(d))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).to(q.dtype).reshape(h, 1, d)


def _cpu_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor | None:
    """Causal rows from position `start` (a prompt chunk) over a plain cache on the CPU through
    `fused.prefill_rows`, or None (another device, or no CPU flash kernel in this torch: SDPA)."""
    return fused.prefill_rows(q, keys, values, start) if q.device.type == "cpu" else None


def gpu_rows(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether a few-row step (verification, a short prompt at depth) over a plain cache takes `_rows_attention`: on
    a GPU, up to the Triton kernel's rows per KV head, head sizes it reads."""
    h, n, d = q.shape
    return ((h // keys.shape[0]) * n <= gpu_attention.MAX_ROWS and gpu_attention.supports(fused.PLAIN_SPECS.get(keys.dtype), d)
            and gpu.wanted(q))


def _rows_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q [H, N, D] over a plain cache's views [KVH, start + N, D] following `plan` (causal, or a tree mask): the
    committed positions in the Triton kernel, the step's own N positions in torch with the plan's mask, merged as
    an online softmax. SDPA would expand the cache per query head for GQA and build a mask over the whole
    context."""
    h, n, d = q.shape
    kvh = keys.shape[0]
    g = h // kvh
    start = plan.start
    qf = q.reshape(kvh, g * n, d).to(torch.float32) * (1.0 / math.sqrt(d))  # rows (query head in group, token)
    if start > 0:
        spec = (fused.PLAIN_SPECS[keys.dtype], fused.PLAIN_SPECS[values.dtype])
        m, lsum, acc = gpu_attention.partial(qf, spec[0], [keys], spec[1], [values], d, 0, start)
    else:
        m = torch.full((kvh, g * n), -math.inf, device=q.device)
        lsum = torch.zeros(kvh, g * n, device=q.device)
        acc = torch.zeros(kvh, g * n, d, device=q.device)
    out = gpu_attention.with_own_rows(m, lsum, acc, qf, keys[:, start:].to(torch.float32),
                                      values[:, start:].to(torch.float32),
                                      plan.mask[:, start:] if plan.mask is not None else None, g)
    return out.to(q.dtype).reshape(h, n, d)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused into one matrix."""

    def __init__(self, gate_up: Linear | SplitLinear, down: Linear):
        self.gate_up, self.down = gate_up, down
        self.inter = down.in_features

    def linears(self) -> tuple:
        return self.gate_up, self.down

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        k = load_kernel()
        if k is not None and gu.dim() == 2 and gu.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return self.down(k.silu_mul(gu))  # one pass, rows in parallel; rounds as the two ops below do
        g, u = gu.split([self.inter, self.inter], dim=-1)
        return self.down(F.silu(g) * u)
