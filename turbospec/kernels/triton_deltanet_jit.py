"""The Triton program of turbospec/kernels/triton_deltanet.py (imported on first use: Triton reads
TRITON_INTERPRET when it is defined)."""

import triton
import triton.language as tl


@triton.jit
def gdn_step(window, conv_t, z, b, a, neg_a, dt_bias, norm_w, state, parents, rows, out, states,
             C, sz, sb, sa, eps, q_scale, n,
             NP: tl.constexpr, K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, REP: tl.constexpr,
             KEY_DIM: tl.constexpr, TREE: tl.constexpr, NV: tl.constexpr):
    """One program per value head: the causal conv (window rows along each token's root path), SiLU, L2-normed q and
    k, the gated delta rule token after token (each token from its parent's state), the state after every token
    stored, and the gated RMS norm of the output."""
    DT: tl.constexpr = window.dtype.element_ty
    h = tl.program_id(0)
    kh = h // REP
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    qc = kh * DK + dk
    kc = KEY_DIM + kh * DK + dk
    vc = 2 * KEY_DIM + h * DV + dv
    sd = dk[:, None] * DV + dv[None, :]  # [DK, DV] offsets of one head's state
    s = tl.load(state + h * DK * DV + sd)
    na = tl.load(neg_a + h)
    dtb = tl.load(dt_bias + h)
    nw = tl.load(norm_w + dv).to(tl.float32)
    for t in tl.static_range(NP):  # NP: N rounded up to a power of two (few compiled variants)
        if t < n:
            if TREE:
                par = tl.load(parents + t)
                tl.debug_barrier()  # the parent's state was stored by this program's threads
                if par >= 0:
                    s = tl.load(states + (par * NV + h) * DK * DV + sd)
                else:
                    s = tl.load(state + h * DK * DV + sd)
            qa = tl.zeros([DK], tl.float32)
            ka = tl.zeros([DK], tl.float32)
            va = tl.zeros([DV], tl.float32)
            for i in tl.static_range(K):
                if TREE:  # noqa: SIM108 -- (a compile-time branch of Triton's)
                    r = tl.load(rows + t * K + i)
                else:
                    r = t + i
                # products and sums rounded to the window's dtype, as the torch path computes the conv in it
                # (written out: each call of a jit helper costs the CPU tests' interpreter a module scan)
                wr = window + r * C
                ct = conv_t + i * C
                pq = (tl.load(wr + qc).to(tl.float32) * tl.load(ct + qc).to(tl.float32)).to(DT).to(tl.float32)
                pk = (tl.load(wr + kc).to(tl.float32) * tl.load(ct + kc).to(tl.float32)).to(DT).to(tl.float32)
                pv = (tl.load(wr + vc).to(tl.float32) * tl.load(ct + vc).to(tl.float32)).to(DT).to(tl.float32)
                qa = (qa + pq).to(DT).to(tl.float32)
                ka = (ka + pk).to(DT).to(tl.float32)
                va = (va + pv).to(DT).to(tl.float32)
            qv = (qa / (1.0 + tl.exp(-qa))).to(DT).to(tl.float32)  # SiLU, rounded to DT
            kv = (ka / (1.0 + tl.exp(-ka))).to(DT).to(tl.float32)
            vv = (va / (1.0 + tl.exp(-va))).to(DT).to(tl.float32)
            qv = qv * tl.rsqrt(tl.sum(qv * qv, 0) + 1e-6) * q_scale
            kv = kv * tl.rsqrt(tl.sum(kv * kv, 0) + 1e-6)
            beta = tl.sigmoid(tl.load(b + t * sb + h).to(tl.float32))
            xa = tl.load(a + t * sa + h).to(tl.float32) + dtb
            sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))  # softplus
            s = s * tl.exp(na * sp)
            mem = tl.sum(kv[:, None] * s, 0)
            delta = (vv - mem) * beta
            s = s + kv[:, None] * delta[None, :]
            tl.store(states + (t * NV + h) * DK * DV + sd, s)
            o = tl.sum(qv[:, None] * s, 0)
            o = o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)
            zz = tl.load(z + t * sz + h * DV + dv).to(tl.float32)
            y = (nw * o.to(norm_w.dtype.element_ty).to(tl.float32)).to(norm_w.dtype.element_ty).to(tl.float32)
            y = y * (zz / (1.0 + tl.exp(-zz)))
            tl.store(out + t * NV * DV + h * DV + dv, y.to(out.dtype.element_ty))
