"""Rotary position embeddings: default, linear, llama3, yarn and longrope frequency schedules."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq_and_scale(rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the rotated dims and the cos/sin scale (yarn's attention factor). `freq_factors`
    (llama.cpp's per-frequency divisors, the rope_freqs tensor of a GGUF file) divide the schedule's frequencies."""
    inv_freq, scale = _schedule(rope, head_dim)
    if rope.get("freq_factors") is not None:
        inv_freq = inv_freq / torch.tensor(rope["freq_factors"], dtype=torch.float32)
    return inv_freq, scale


def _schedule(rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(dim, base, rope)
    if kind == "longrope":
        return _longrope(inv_freq, rope)
    raise ValueError(f"unsupported rope type {kind!r}")


def _longrope(inv_freq: torch.Tensor, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors, the long ones for a context past the pretrained one
    (`long_context`, set by `Rope.set_context` as llama.cpp chooses them for its context size; transformers picks
    them per forward by the sequence length), and sqrt(1 + ln(factor) / ln(original)) on cos and sin."""
    orig = float(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or float(rope.get("max_position_embeddings", orig)) / orig)
    attn = rope.get("attention_factor")
    if attn is None:
        attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    ext = rope["long_factor"] if rope.get("long_context") else rope["short_factor"]
    return inv_freq / torch.tensor(ext, dtype=torch.float32), float(attn)


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig = float(rope.get("original_max_position_embeddings") or rope["max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else float(rope["max_position_embeddings"]) / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


class Rope:
    """Precomputed cos/sin tables; `apply` rotates the first `rot_dim` dims of q/k at given positions."""

    def __init__(self, rope: dict[str, Any], head_dim: int, max_positions: int, dtype: torch.dtype):
        self.rope = rope
        inv_freq, scale = inv_freq_and_scale(rope, head_dim)
        self.rot_dim = inv_freq.numel() * 2
        self.head_dim = head_dim
        self.dtype = dtype
        self.inv_freq = inv_freq
        self.scale = scale
        self._build(max_positions)

    def set_context(self, ctx: int) -> None:
        """The frequencies for a context of `ctx` positions: LongRoPE's long ones past its pretrained context (as
        llama.cpp chooses them), else nothing changes."""
        if self.rope.get("rope_type") != "longrope":
            return
        long = ctx > int(self.rope["original_max_position_embeddings"])
        if bool(self.rope.get("long_context")) != long:
            self.rope = {**self.rope, "long_context": long}
            self.inv_freq, self.scale = inv_freq_and_scale(self.rope, self.head_dim)
            self.inv_freq = self.inv_freq.to(self.cos.device)
            self._build(self.cos.shape[0])

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)  # (decode may grow the tables)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scale).to(self.dtype)
        sin = emb.sin() * self.scale
        half = sin.shape[-1] // 2
        # sign folded in so that rotate_half(x) * sin == roll(x, half) * sin_signed
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.dtype)

    def tables_for(self, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows for an AttentionPlan's positions (slices when they are consecutive)."""
        if plan.first is not None:
            end = plan.first + plan.n
            if end > self.cos.shape[0]:
                self._build(max(end, 2 * self.cos.shape[0]))
            return self.cos[plan.first:end], self.sin[plan.first:end]
        return self.tables(plan.positions)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        if positions.numel() == 1:  # a decode step: views instead of a gather (~20 us each on CPU)
            p = need - 1
            return self.cos[p:p + 1], self.sin[p:p + 1]
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., N, heads, D] or [heads, N, D] matching cos/sin's broadcast; cos/sin_signed: [N, (1,) rot_dim].

    Rotate-half convention: x*cos + rotate_half(x)*sin, computed as x*cos + roll(x, half)*sin_signed
    (three ops instead of seven). Only the first rot_dim dims rotate (partial rotary)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rot // 2, -1), sin)
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((torch.addcmul(xr * cos, xr.roll(rot // 2, -1), sin), xp), dim=-1)
