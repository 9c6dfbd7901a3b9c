"""Gated DeltaNet (the linear-attention layer of Qwen3.5 / Qwen3-Next).

Per token t and value head h (key heads are shared by `num_v_heads // num_k_heads` value heads):

    x_t        = causal depthwise conv1d (kernel K, no bias) over the projected [q | k | v] rows, then SiLU
    q, k       = l2-normalised per head; q scaled by 1/sqrt(d_k)
    beta       = sigmoid(b_t),  g = -exp(A_log) * softplus(a_t + dt_bias)        (log decay, <= 0)
    S          = S * exp(g);  S = S + k (x) ((v - S^T k) * beta);  o = S^T q          (S: [d_k, d_v], float32)
    y          = out_proj( RMSNorm(o) * w * silu(z) )                              (norm per value head)

Two exact forms of the recurrence are provided, both keeping the state in float32:
- `recurrent_gated_delta`: one token at a time; returns the state after *every* position (used for decode and
  for speculative verification, so that any accepted prefix can be committed without re-decoding);
- `chunked_gated_delta`: the WY/UT chunked form for prefill (64-token chunks, triangular solves inside a
  chunk, a sequential scan across chunks); returns the final state only.

The conv state is the last K-1 projected input rows; the layer hands the cache the whole window
[K-1 previous rows + N new rows] so that the state after any prefix j is `window[j : j + K - 1]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbospec import env
from turbospec.kernels import gpu
from turbospec.kernels import triton_deltanet as gpu_deltanet
from turbospec.kernels.gemv import load_extension
from turbospec.layers.linear import Linear, SplitLinear

_CHAIN = torch.empty(0, dtype=torch.int64)  # "no parents": the step's tokens are a chain


def load_gdn_kernel():
    """The C++ decode/verification mixer (turbospec/kernels/deltanet.cpp), or None."""
    if env.on("TURBOSPEC_NO_GDN_KERNEL"):
        return None
    return load_extension("turbospec_gdn", "deltanet.cpp", "Gated DeltaNet")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (`parents`: token i continues from token parents[i]'s state, -1 = the
    input state; default: a chain).

    q, k: [H, N, Dk] (already normalised and scaled, float32); v: [H, N, Dv]; g, beta: [H, N];
    state: [H, Dk, Dv] float32 (not modified). Returns (out [H, N, Dv], states [N, H, Dk, Dv]).
    """
    h, n, _ = q.shape
    dv = v.shape[-1]
    out = torch.empty(h, n, dv, dtype=torch.float32, device=q.device)
    states = torch.empty((n,) + tuple(state.shape), dtype=torch.float32, device=q.device)
    decay = g.exp()
    s = state
    for t in range(n):
        if parents is not None:
            s = state if parents[t] < 0 else states[parents[t]]
        st = states[t]
        torch.mul(s, decay[:, t, None, None], out=st)  # decayed state, written in place of the t-th slot
        kt = k[:, t].unsqueeze(1)  # [H, 1, Dk]
        mem = torch.bmm(kt, st)  # S^T k: [H, 1, Dv]
        delta = (v[:, t].unsqueeze(1) - mem) * beta[:, t, None, None]
        st.baddbmm_(kt.transpose(1, 2), delta)  # S += k (x) delta
        out[:, t] = torch.bmm(q[:, t].unsqueeze(1), st).squeeze(1)
        s = st
    return out, states


def conv_rows(parents: list[int], kernel: int, device: torch.device | None = None) -> torch.Tensor:
    """Window rows [N, kernel] feeding each tree node's causal conv, oldest first: the node's ancestors along its
    root path (window row K-1+j for node j), then the committed conv state rows K-2, K-3, ... For a chain this
    is rows [t, t + kernel) for node t."""
    k1 = kernel - 1
    out = []
    for t in range(len(parents)):
        path = []
        u = t
        while u >= 0 and len(path) < kernel:
            path.append(k1 + u)
            u = parents[u]
        r = k1 - 1
        while len(path) < kernel:
            path.append(r)
            r -= 1
        out.append(path[::-1])
    return torch.tensor(out, dtype=torch.int64, device=device)


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (shapes as in `recurrent_gated_delta`); returns (out, final state).

    Inside a chunk with cumulative log decay G_t, the delta-rule updates are solved at once:
    (I + tril(beta_i k_i.k_j e^{G_i - G_j}, -1)) U = beta V  gives the per-token corrections U, and the
    state read by token t is e^{G_t} S_prev; across chunks the state is carried sequentially.
    """
    h, n, dk = q.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    m = (n + pad) // chunk
    q = q.reshape(h, m, chunk, dk)
    k = k.reshape(h, m, chunk, dk)
    v = v.reshape(h, m, chunk, dv)
    beta = beta.reshape(h, m, chunk, 1)
    cum = g.reshape(h, m, chunk).cumsum(-1)  # G_t within each chunk
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    rel = (
        (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    )  # e^{G_i - G_j}, j <= i
    kb = k * beta
    # unit lower-triangular system A = I + strictly-lower(beta_i k_i . k_j e^{G_i-G_j})
    a = (kb @ k.transpose(-1, -2)) * rel
    a = a.masked_fill(~torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1), 0.0)
    a = a + torch.eye(chunk, dtype=torch.float32, device=q.device)
    u = torch.linalg.solve_triangular(a, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * rel  # intra-chunk q.k with decay, causal (incl. diagonal)
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [H, M]
    out = torch.empty(h, m, chunk, dv, dtype=torch.float32, device=q.device)
    s = state
    for i in range(m):
        corr = u[:, i] - w[:, i] @ s  # corrections after subtracting what the carried state already predicts
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ corr
        s = s * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ corr
    return out.reshape(h, m * chunk, dv)[:, :n], s


class GatedDeltaNet:
    """One Gated DeltaNet token mixer. `proj` is the fused input projection with rows [q | k | v | z | b | a]
    (q, k, v head-major as in Qwen3.5's in_proj_qkv; Qwen3-Next's grouped in_proj_qkvz/ba are reordered at
    load).
    """

    def __init__(
        self,
        proj: Linear | SplitLinear,
        conv_weight: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        out_proj: Linear,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        eps: float,
    ):
        self.proj, self.out = proj, out_proj
        self.out_tiling = 1  # see out_order
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_weight = conv_weight.reshape(self.conv_dim, -1).contiguous()  # [C, K]
        self.kernel = self.conv_weight.shape[1]
        self.conv_t = self.conv_weight.t().contiguous()  # [K, C]
        self.neg_a = -a_log.float().exp()  # [Hv]
        self.dt_bias = dt_bias.float()
        self.norm_weight = norm_weight
        self.eps = eps
        if num_v_heads % num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    def linears(self) -> tuple:
        return self.proj, self.out

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.nv, self.dk, self.dv)

    def __call__(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, all_states: bool,
        parents: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden]; conv_state: [K-1, C]; ssm_state: [Hv, Dk, Dv] float32 (neither is modified).

        Returns (y [N, hidden], conv window [K-1+N, C], states): states is [N, Hv, Dk, Dv] (state after each
        position) when `all_states`, else [1, Hv, Dk, Dv] (the final state only).
        `parents` makes the N tokens a tree (parents[i]: the node before node i, -1: the committed context):
        every node's conv inputs and recurrent state follow its own root path (needs `all_states`).
        """
        o, window, states = self.mix(self.proj(x), conv_state, ssm_state, all_states, parents)
        return self.out(self.out_order(o)), window, states

    def out_order(self, o: torch.Tensor) -> torch.Tensor:
        """o [N, value heads x Dv] in the order `out` expects: the checkpoint's (grouped by key head), or
        llama.cpp's tiled order when the output projection was kept packed in a GGUF file's column order
        (`out_tiling` r > 1: value head g*r + j goes to position j*nk + g)."""
        r = self.out_tiling
        if r == 1:
            return o
        n = o.shape[0]
        return o.reshape(n, self.nk, r, self.dv).transpose(1, 2).reshape(n, self.value_dim)

    def mix(
        self, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, all_states: bool,
        parents: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`__call__` from the input projection's output [N, conv + value + 2 Hv] up to, not including, the output
        projection: returns (o [N, value_dim] in the model dtype, conv window, states)."""
        n = proj.shape[0]
        dtype = proj.dtype
        if parents is not None and not all_states:
            raise ValueError("tree steps need all_states")
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
        window = torch.cat([conv_state.to(qkv.dtype), qkv], dim=0)  # [K-1+N, C]
        kernel = load_gdn_kernel() if all_states else None
        if kernel is not None:  # decode / verification: the whole mixer in one C++ call
            par = _CHAIN if parents is None else torch.tensor(parents, dtype=torch.int64)
            o, states = kernel.gdn_step(window, self.conv_t, z, b, a, self.neg_a, self.dt_bias, self.norm_weight,
                                        ssm_state, par, self.nk, self.nv, self.dk, self.dv, self.eps, True)
            return o, window, states
        if (all_states and gpu.wanted(proj) and env.on("TURBOSPEC_TRITON_GDN") and gpu.enabled("deltanet")
                and gpu_deltanet.supports(n, self.dk, self.dv)):
            rows = conv_rows(parents, self.kernel, proj.device) if parents is not None else None
            try:  # GPU: one Triton call
                o, states = gpu_deltanet.step(window, self.conv_t, z, b, a, self.neg_a, self.dt_bias,
                                              self.norm_weight, ssm_state, parents, self.nk, self.nv, self.dk, self.dv,
                                              self.eps, rows)
                return o, window, states
            except Exception as e:  # noqa: BLE001 -- a Triton that cannot build it: the torch path below
                gpu.failed("deltanet", e)
        if parents is not None:  # conv rows along each node's root path (then the committed conv state)
            rows = conv_rows(parents, self.kernel, proj.device)
            conv = window[rows[:, 0]] * self.conv_t[0]
            for i in range(1, self.kernel):
                conv = conv + window[rows[:, i]] * self.conv_t[i]
        else:
            # depthwise causal conv as K shifted multiply-adds (torch's grouped conv1d costs ms per call on CPU)
            conv = window[0:n] * self.conv_t[0]
            for i in range(1, self.kernel):
                conv = conv + window[i:i + n] * self.conv_t[i]
        mixed = F.silu(conv)  # [N, C]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.nv // self.nk
        q = l2_normalize(q.reshape(n, self.nk, self.dk)) * self.dk**-0.5
        k = l2_normalize(k.reshape(n, self.nk, self.dk))
        if rep > 1:
            q = q.repeat_interleave(rep, dim=1)
            k = k.repeat_interleave(rep, dim=1)
        q, k = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()  # [Hv, N, Dk]
        v = v.reshape(n, self.nv, self.dv).transpose(0, 1).contiguous()
        beta = torch.sigmoid(b.float()).t().contiguous()  # [Hv, N]
        g = (self.neg_a * F.softplus(a.float() + self.dt_bias)).t().contiguous()
        if all_states:
            o, states = recurrent_gated_delta(q, k, v, g, beta, ssm_state, parents)
        else:
            o, final = chunked_gated_delta(q, k, v, g, beta, ssm_state)
            states = final.unsqueeze(0)
        o = o.transpose(0, 1)  # [N, Hv, Dv] float32
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm_weight * o.to(dtype)) * F.silu(z.reshape(n, self.nv, self.dv).float())
        return o.to(dtype).reshape(n, self.value_dim), window, states

    @property
    def nbytes(self) -> int:
        extra = sum(
            t.numel() * t.element_size()
            for t in (self.conv_weight, self.norm_weight, self.neg_a, self.dt_bias)
        )
        return self.proj.nbytes + self.out.nbytes + extra
