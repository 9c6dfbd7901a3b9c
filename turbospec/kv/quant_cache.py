"""A KV cache stored in packed codec formats, with block-wise (flash-decoding style) attention.

`QuantKVCache` has the bookkeeping API of `KVCache` (begin / commit(keep) / reset / truncate / length /
base / pending / nbytes) but keeps K and V of every layer in packed buffers of two independently chosen
formats from `turbospec.kv.formats` (f32/f16/bf16, q8_0, q4_0, tbq4_0, turbo2/3/4, turbo*p, ...),
allocated once for `max_len` positions.

Instead of `write()` returning dense views it offers

    out = cache.attend(layer, q, k_new, v_new, plan, scale)   # q [H, N, D] (after rope), k/v [KVH, N, D]

which encodes the new tokens into scratch and then walks committed + scratch positions in blocks of
`block` positions: decode one block of K and V, scores, online-softmax accumulate.  Nothing ever holds
more than one block of decoded K/V, so peak memory is the packed cache plus O(block) floats.

Rotated formats (turbo*): q is rotated once per call and K blocks are read with `decode_rotated`
(centroid x norm, no inverse transform per token); a rotated V is accumulated in the rotated domain and
the output is `unrotate`d once.
"""

from __future__ import annotations

import math
from functools import cached_property

import torch

from turbospec.dtypes import short_name
from turbospec.errors import TurboSpecError
from turbospec.kernels import attention as fused
from turbospec.kernels import encode as encoder
from turbospec.kernels import gpu
from turbospec.kernels import triton_attention as gpu_attention
from turbospec.kernels import triton_encode as gpu_encode
from turbospec.kv import kernel_args
from turbospec.kv.cache import CachePositions, KVCache
from turbospec.kv.formats import KVFormat, Packed, PlainFormat, get_format
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.query_rounding import key_block, round_queries

DEFAULT_BLOCK = 1024
GPU_BLOCK = 16384  # on a GPU the torch blocks (prefill chunks) are few large launches


class QuantKVCache(CachePositions):
    """Attention KV for one sequence in packed formats: `length` committed positions, then `pending`
    scratch positions (the tokens of the current step), exactly like `KVCache`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 k_type: str = "f16", v_type: str = "f16", block: int | None = None):
        if block is None:
            block = GPU_BLOCK if torch.get_default_device().type == "cuda" else DEFAULT_BLOCK
        if block < 1:
            raise ValueError("block must be >= 1")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_len = max_len
        self.k_fmt: KVFormat = get_format(k_type)
        self.v_fmt: KVFormat = get_format(v_type)
        self.k_type, self.v_type = self.k_fmt.name, self.v_fmt.name
        self.block = block
        lead = (num_layers, num_kv_heads, max_len)
        self.k: Packed = self.k_fmt.allocate(head_dim, lead)
        self.v: Packed = self.v_fmt.allocate(head_dim, lead)
        self.length = 0
        self.pending = 0
        self.base = 0  # first attended position (drafters may skip a prompt prefix)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (*self.k.values(), *self.v.values())

    def fields(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return dict(self.k), dict(self.v)

    # ---- memory accounting ------------------------------------------------------------------------------
    def bytes_per_token_per_layer(self) -> int:
        d = self.head_dim
        return self.num_kv_heads * (self.k_fmt.bytes_per_vector(d) + self.v_fmt.bytes_per_vector(d))

    # ---- storage ----------------------------------------------------------------------------------------
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode k, v [kv_heads, N, D] into scratch positions [length, length + N) of `layer`."""
        n = k.shape[1]
        if self.length + n > self.max_len:
            raise TurboSpecError(f"context full: {self.length} + {n} > {self.max_len}")
        end = self.length + n
        specs = self._encode_specs if k.shape[0] * n <= encoder.MAX_ROWS else (None, None)
        gpu_kinds = self._gpu_encode if gpu.enabled("encode") else (None, None)
        for i, (fmt, buf, x) in enumerate(((self.k_fmt, self.k, k), (self.v_fmt, self.v, v))):
            spec = specs[i]
            if spec is not None and encoder.encode_into(x, spec, self._encode_fields[layer][i], self.length,
                                                        self._encoder):
                continue
            if gpu_kinds[i] is not None:
                kind, fields, turbo = gpu_kinds[i]
                try:
                    gpu_encode.encode_into(x, kind, fields[layer], self.length, turbo)
                    continue
                except Exception as e:  # noqa: BLE001 -- a Triton that cannot build it: the torch encoder
                    gpu.failed("encode", e)
            for name, t in fmt.encode(x).items():
                buf[name][layer, :, self.length:end] = t

    def _slice(self, buf: Packed, layer: int, s: int, e: int) -> Packed:
        return Packed({name: t[layer, :, s:e] for name, t in buf.items()}, dim=self.head_dim)

    def read(self, layer: int, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 K and V [kv_heads, e - s, D] of positions [s, e) (tests and fallbacks)."""
        return (self.k_fmt.decode(self._slice(self.k, layer, s, e), self.head_dim),
                self.v_fmt.decode(self._slice(self.v, layer, s, e), self.head_dim))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KVCache-compatible fallback: store, then return *decoded* K/V over committed + scratch positions
        (materializes the whole layer; attention code should call `attend` instead)."""
        self.store(layer, k, v)
        kd, vd = self.read(layer, 0, self.length + k.shape[1])
        return kd.to(k.dtype), vd.to(v.dtype)

    # ---- attention --------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: AttentionPlan, scale: float | None = None) -> torch.Tensor:
        """Store the step's k/v [KVH, N, D], then attention of q [H, R, D] over positions [base, length + N)
        following `plan` (causal, or plan.mask [N, start + N]); returns [H, R, D] in q's dtype. R = N, or, under a
        causal plan, R < N: q holds the step's last R rows only (a prompt chunk whose other rows nobody reads)."""
        h, r, d = q.shape
        n = k_new.shape[1]
        if n == 1 and plan.mask is None and plan.start == self.length and self._one_row:
            return self._attend_one(layer, q, k_new, v_new, scale)
        kvh = self.num_kv_heads
        if h % kvh:
            raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
        g = h // kvh
        start = self.length
        if plan.start != start or plan.n != n:
            raise ValueError(f"plan (start {plan.start}, n {plan.n}) does not match the cache "
                             f"({start} committed, {n} new)")
        if not 0 < r <= n or (r < n and plan.mask is not None):
            raise ValueError(f"{r} query rows for {n} new positions (fewer only under a causal plan)")
        self.store(layer, k_new, v_new)
        total = start + n
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        # rows are (query head within group, token): [KVH, G*R, D]
        qf = q.to(torch.float32).reshape(kvh, g * r, d)
        if self.k_fmt.rotated:
            qf = kernel_args.rotate_fast(qf, mod=self._encoder)
        qf = qf * scale
        rows = g * r
        mask = plan.mask
        # the fused kernel covers the committed positions (and a last row's own positions: nothing to mask)
        fused_end = total if (r == 1 and mask is None) else start
        if rows <= fused.MAX_ROWS and fused_end > self.base and self._kernel_ok:
            m, lsum, acc = self._attend_fused(layer, qf, d, self.base, fused_end)
        else:
            fused_end = self.base
            m = torch.full((kvh, rows, 1), -math.inf)
            lsum = torch.zeros(kvh, rows, 1)
            acc = torch.zeros(kvh, rows, self.v_fmt.padded_dim(d) if self.v_fmt.rotated else d)
        if fused_end < total:  # the kernel rounds q for integer keys itself, the torch blocks here
            qr = round_queries(qf, self._q_block)
            m, lsum, acc = self._attend_blocks(layer, qr, d, plan, fused_end, m, lsum, acc, r)
        out = acc / torch.where(lsum > 0, lsum, torch.ones_like(lsum))
        if self.v_fmt.rotated:
            out = kernel_args.rotate_fast(out, inverse=True, dim=d, mod=self._encoder)
        return out.reshape(h, r, d).to(q.dtype)

    @cached_property
    def _q_block(self) -> int | None:
        """The key block over which queries are rounded to 8 bits (integer keys; turbospec.kv.query_rounding)."""
        return key_block(self.k_fmt, self.head_dim)

    @cached_property
    def _kernel_ok(self) -> bool:
        """Whether both formats have a kernel path here: C++ on the CPU, Triton on a GPU."""
        return self._kernel_specs is not None or self._triton_specs is not None

    @cached_property
    def _one_row(self) -> bool:
        """Whether a decode token takes `_attend_one` (a kernel path)."""
        return self._kernel_ok

    def _attend_one(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    scale: float | None) -> torch.Tensor:
        """`attend` for one decode token, without the general path's setup (the same arithmetic): store its K/V,
        then the kernel over [base, length + 1) and the normalisation."""
        self.store(layer, k_new, v_new)
        h, _, d = q.shape
        kvh = self.num_kv_heads
        qf = q.to(torch.float32).reshape(kvh, h // kvh, d)
        if self.k_fmt.rotated:
            qf = kernel_args.rotate_fast(qf, mod=self._encoder)
        qf = qf * (1.0 / math.sqrt(d) if scale is None else scale)
        _, lsum, acc = self._attend_fused(layer, qf, d, self.base, self.length + 1)
        out = acc / lsum
        if self.v_fmt.rotated:
            out = kernel_args.rotate_fast(out, inverse=True, dim=d, mod=self._encoder)
        return out.reshape(h, 1, d).to(q.dtype)

    def _attend_blocks(self, layer: int, qf: torch.Tensor, d: int, plan: AttentionPlan, s0: int, m: torch.Tensor,
                       lsum: torch.Tensor, acc: torch.Tensor, r: int):
        """Online-softmax accumulation (torch) over positions [s0, length + n) in blocks, with the plan's
        causal / tree mask over the step's own positions; qf's rows are those of the step's last r tokens."""
        start, n, mask = plan.start, plan.n, plan.mask
        total = start + n
        g = qf.shape[1] // r
        first = total - r  # position of the first query row
        tok_pos = torch.arange(first, total, device=qf.device).repeat(g)  # position of each row's token, [G*R]
        # without a mask: torch's CPU flash kernel (K and V decoded as wide) for committed blocks, and for the step's
        # own positions when every one of them has its row (causal, one head per row group)
        widths = [f.padded_dim(d) if f.rotated else d for f in (self.k_fmt, self.v_fmt)]
        flash = (mask is None and qf.device.type == "cpu" and widths[0] == widths[1]
                 and fused.prefill_rows_available())
        own_flash = flash and r == n and s0 <= start
        end = start if own_flash else total
        for s in range(s0, end, self.block):
            e = min(s + self.block, end)
            kb, vb = self._decoded(layer, s, e, d)
            if flash and e <= start:  # the block's softmax state from the kernel's output and log-sum-exp
                out, lse = fused.flash(qf[None], kb[None], vb[None], scale=1.0)
                m = _merge_state(m, lsum, acc, out[0], lse[0])
                continue
            sc = torch.matmul(qf, kb.transpose(-1, -2))  # [KVH, rows, B]
            if mask is not None:
                allowed = mask[:, s:e].repeat(g, 1)  # [rows, B]
                sc.masked_fill_(~allowed, -math.inf)
            elif e > first + 1:  # block reaches past the first row's position: causal within the step
                keys = torch.arange(s, e, device=qf.device)
                sc.masked_fill_(keys[None, :] > tok_pos[:, None], -math.inf)
            bmax = sc.amax(-1, keepdim=True)
            m_new = torch.maximum(m, bmax)
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc.sub_(safe))
            corr = torch.exp(m - safe)
            lsum.mul_(corr).add_(p.sum(-1, keepdim=True))
            acc.mul_(corr).add_(torch.matmul(p, vb))
            m = m_new
        if own_flash:
            kb, vb = self._decoded(layer, start, total, d)
            kvh, dk = qf.shape[0], qf.shape[2]
            heads = qf.reshape(1, kvh * g, n, dk)  # rows (query head in group, token) -> one head per group row
            out, lse = fused.flash(heads, kb.repeat_interleave(g, 0)[None], vb.repeat_interleave(g, 0)[None],
                                   causal=True, scale=1.0)
            m = _merge_state(m, lsum, acc, out[0].reshape(kvh, g * n, -1), lse[0].reshape(kvh, g * n))
        return m, lsum, acc

    def _decoded(self, layer: int, s: int, e: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [s, e) decoded to float32 [KVH, e - s, width] (rotated formats left rotated): by the
        C++ decoder where the attention kernel reads both formats (the same values), else by the formats' own."""
        if self._kernel_specs is not None:
            out = []
            for fmt, spec, fields in zip((self.k_fmt, self.v_fmt), self._kernel_specs, self._kernel_fields[layer]):
                width = fmt.padded_dim(d)
                x = fused.decode(spec, fields, width, s, e)
                out.append(x if fmt.rotated or width == d else x[..., :d])
            return out[0], out[1]
        kp, vp = self._slice(self.k, layer, s, e), self._slice(self.v, layer, s, e)
        return (self.k_fmt.decode_rotated(kp) if self.k_fmt.rotated else self.k_fmt.decode(kp, d),
                self.v_fmt.decode_rotated(vp) if self.v_fmt.rotated else self.v_fmt.decode(vp, d))

    @cached_property
    def _gpu_encode(self) -> tuple:
        """Per side, the Triton encoder's arguments (a cache on a GPU), or None (torch's encoder)."""
        return kernel_args.triton_encoders(self.k_fmt, self.v_fmt, self.head_dim, self.k, self.v, self.num_layers)

    @cached_property
    def _encoder(self):
        return encoder.load()

    @cached_property
    def _encode_specs(self) -> tuple:
        return kernel_args.encode_specs(self.k_fmt, self.v_fmt, self.head_dim)

    @cached_property
    def _encode_fields(self) -> list[tuple[list[torch.Tensor] | None, ...]]:
        """Per layer, the K and V buffers in the C++ encoder's field order (None: that format has no C++ encoder)."""
        specs = self._encode_specs
        return [tuple(None if spec is None else [buf[f][i] for f in spec.fields] for spec, buf in zip(specs, (self.k, self.v)))
                for i in range(self.num_layers)]

    @cached_property
    def _kernel_specs(self):
        """(K spec, V spec) for the fused C++ kernel, or None (no kernel here, or a format it cannot read)."""
        ks = kernel_args.attention_spec(self.k_fmt, self.head_dim)
        vs = kernel_args.attention_spec(self.v_fmt, self.head_dim)
        return (ks, vs) if ks is not None and vs is not None and fused.load() is not None else None

    @cached_property
    def _kernel_fields(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per layer, the K and V buffers in the attention kernel's field order (the C++ kernel's, else Triton's)."""
        ks, vs = self._kernel_specs or self._triton_specs
        return [([self.k[f][i] for f in ks[2]], [self.v[f][i] for f in vs[2]]) for i in range(self.num_layers)]

    def step_args(self, layer: int) -> tuple | None:
        """The K and V arguments of the kernels' one-call decode / verification step over this cache
        (`layer_packed` / `attn_packed` in kernels/gemv.cpp: per format its ints (kind, bits, width, norm mode),
        tables and this layer's buffers), or None when a format has no C++ encoder or attention path here."""
        sides = self._step_sides
        return None if sides is None else sides[layer]

    @cached_property
    def _step_sides(self) -> list[tuple] | None:
        return kernel_args.step_sides(self.k_fmt, self.v_fmt, self.head_dim, self.k, self.v, self.num_layers)

    @cached_property
    def _triton_specs(self):
        """(K spec, V spec) for the Triton kernel (a cache on a GPU; centroid tables on its device), or None."""
        return kernel_args.triton_specs(self.k_fmt, self.v_fmt, self.head_dim, next(iter(self.k.values())))

    def _attend_fused(self, layer: int, qf: torch.Tensor, d: int, s: int, e: int):
        """Partial softmax state (m, l [KVH, R, 1], acc [KVH, R, Dv]) over positions [s, e) from the kernel (C++, or
        Triton on a GPU: queries against integer keys rounded first, as the C++ kernel rounds them itself)."""
        kw, vw = self.k_fmt.padded_dim(d), self.v_fmt.padded_dim(d)
        q = qf if qf.shape[-1] == kw else torch.nn.functional.pad(qf, (0, kw - qf.shape[-1]))
        k_fields, v_fields = self._kernel_fields[layer]
        if self._kernel_specs is None:
            ks, vs = self._triton_specs
            m, lsum, acc = gpu_attention.partial(round_queries(q, self._q_block), ks, k_fields, vs, v_fields, vw, s, e)
        else:
            ks, vs = self._kernel_specs
            m, lsum, acc = fused.partial(q.contiguous(), ks, k_fields, vs, v_fields, vw, s, e)
        if not self.v_fmt.rotated and vw != d:
            acc = acc[..., :d].contiguous()
        return m.unsqueeze(-1), lsum.unsqueeze(-1), acc

    def __repr__(self) -> str:
        return (f"<QuantKVCache K {self.k_type} V {self.v_type}: {self.num_layers} layers x {self.num_kv_heads} "
                f"heads x {self.max_len} x {self.head_dim}, {self.nbytes / 2**20:.1f} MiB>")


def _merge_state(m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> torch.Tensor:
    """Fold a normalized attention output [KVH, R, W] with its log-sum-exp [KVH, R] over other positions into the
    online-softmax state (max m, sum lsum, accumulator acc; the last two in place); returns the new max."""
    bm = lse.unsqueeze(-1)
    m_new = torch.maximum(m, bm)
    corr, w = torch.exp(m - m_new), torch.exp(bm - m_new)
    lsum.mul_(corr).add_(w)
    acc.mul_(corr).add_(out * w)
    return m_new


def make_kv_cache(num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, model_dtype: torch.dtype,
                  k_type: str | None = None, v_type: str | None = None) -> KVCache | QuantKVCache:
    """The fast dense `KVCache` when K and V both use the same plain float type as the model computes in
    (or no type is given); a `QuantKVCache` otherwise."""
    if not k_type and not v_type:  # only a dense dtype was asked: the existing fast path
        return KVCache(num_layers, num_kv_heads, head_dim, max_len, model_dtype)
    kf = get_format(k_type) if k_type else None
    vf = get_format(v_type) if v_type else None
    kd = kf.dtype if isinstance(kf, PlainFormat) else (model_dtype if kf is None else None)
    vd = vf.dtype if isinstance(vf, PlainFormat) else (model_dtype if vf is None else None)
    if kd is not None and kd == vd == model_dtype:
        return KVCache(num_layers, num_kv_heads, head_dim, max_len, kd)
    return QuantKVCache(num_layers, num_kv_heads, head_dim, max_len, k_type or short_name(model_dtype),
                        v_type or short_name(model_dtype))
