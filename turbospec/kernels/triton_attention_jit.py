"""The Triton programs of turbospec/kernels/triton_attention.py (imported on first use: Triton reads
TRITON_INTERPRET when these are defined)."""

import triton
import triton.language as tl


@triton.jit
def tile(f0, f1, f2, cent, st0, st1, st2, pos, pmask, dims,
         KIND: tl.constexpr, BS: tl.constexpr, W: tl.constexpr, QH: tl.constexpr):
    """Decoded float32 values [BLOCK_N, D] of positions `pos` (masked rows read as 0) of one KV head (the field
    pointers point at that head; offsets within a head fit 32 bits)."""
    p2 = pos[:, None]
    m2 = pmask[:, None]
    d2 = dims[None, :]
    if KIND <= 2:  # plain f32 / f16 / bf16
        x = tl.load(f0 + p2 * st0 + d2, mask=m2, other=0.0).to(tl.float32)
    elif KIND == 3:  # q8_0: int8 codes in value order, an fp16 scale per 32 values
        code = tl.load(f1 + p2 * st1 + d2, mask=m2, other=0).to(tl.float32)
        s = tl.load(f0 + p2 * st0 + d2 // 32, mask=m2, other=0.0).to(tl.float32)
        x = code * s
    else:  # codes of W bits, 8 / W per byte: byte j of a block holds codes j, j + PER, ... (kv/bitpack.py)
        PER: tl.constexpr = BS * W // 8
        b = d2 // BS
        j = d2 % BS
        byte = tl.load(f1 + p2 * st1 + b * PER + j % PER, mask=m2, other=0).to(tl.int32)
        idx = (byte >> ((j // PER) * W)) & ((1 << W) - 1)
        s = tl.load(f0 + p2 * st0 + b, mask=m2, other=0.0).to(tl.float32)
        if KIND == 4 or KIND == 5:  # q4_0 / tbq4_0: code - 8 times the scale
            x = (idx - 8).to(tl.float32) * s
        else:  # turbo*: centroid[index] times the block's norm (rotated domain)
            if QH:  # 3-bit indices: the high bit in a 1-bit plane
                PH: tl.constexpr = BS // 8
                hb = tl.load(f2 + p2 * st2 + b * PH + j % PH, mask=m2, other=0).to(tl.int32)
                idx = idx | (((hb >> (j // PH)) & 1) << 2)
            x = tl.load(cent + idx) * s
    return x

@triton.jit
def attend(q, m_out, l_out, acc_out,
           k0, k1, k2, kc, ksh0, kst0, ksh1, kst1, ksh2, kst2,
           v0, v1, v2, vc, vsh0, vst0, vsh1, vst1, vsh2, vst2,
           start, end, chunk, R, sq_h, sq_r, tables, lens, tw,
           TILES: tl.constexpr, RP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
           KKIND: tl.constexpr, KBS: tl.constexpr, KW: tl.constexpr, KQH: tl.constexpr,
           VKIND: tl.constexpr, VBS: tl.constexpr, VW: tl.constexpr, VQH: tl.constexpr, PREC: tl.constexpr,
           PAGED: tl.constexpr, KVH: tl.constexpr, PB: tl.constexpr):
    """Program (h, sp): query rows of KV head h (PAGED: of sequence h // KVH, KV head h % KVH, whose positions
    [0, lens[seq]) sit in blocks of PB positions listed by its row of `tables`, tw entries a row) against span sp
    of positions [start, end)."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    if PAGED:
        seq = h // KVH
        hh = (h % KVH).to(tl.int64)
        stop = tl.load(lens + seq).to(tl.int32)
        tab = tables + seq.to(tl.int64) * tw
    else:
        hh = h.to(tl.int64)
        stop = end
    k0, k1, k2 = k0 + hh * ksh0, k1 + hh * ksh1, k2 + hh * ksh2
    v0, v1, v2 = v0 + hh * vsh0, v1 + hh * vsh1, v2 + hh * vsh2
    splits = tl.num_programs(1)
    rows = tl.arange(0, RP)
    rmask = rows < R
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    qt = tl.load(q + h * sq_h + rows[:, None] * sq_r + dk[None, :], mask=rmask[:, None], other=0.0)
    s0 = start + sp * chunk
    s1 = tl.minimum(s0 + chunk, stop)
    m = tl.full([RP], float("-inf"), tl.float32)
    lsum = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DV], tl.float32)
    for t in range(0, TILES):
        if s0 + t * BLOCK_N < s1:  # (tiles past the span's end skipped: a paged sequence shorter than the longest)
            pos = s0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
            pm = pos < s1
            if PAGED:  # a position's slot: its block's id times PB plus its offset there (64-bit: a pool is large)
                pos = tl.load(tab + pos // PB, mask=pm, other=0).to(tl.int64) * PB + pos % PB
            kt = tile(k0, k1, k2, kc, kst0, kst1, kst2, pos, pm, dk, KKIND, KBS, KW, KQH)
            sc = tl.dot(qt, tl.trans(kt), input_precision=PREC)
            sc = tl.where(pm[None, :], sc, float("-inf"))
            mn = tl.maximum(m, tl.max(sc, 1))
            safe = tl.where(mn == float("-inf"), 0.0, mn)  # a tile past the end: nothing added
            p = tl.exp(sc - safe[:, None])
            corr = tl.exp(m - safe)
            lsum = lsum * corr + tl.sum(p, 1)
            vt = tile(v0, v1, v2, vc, vst0, vst1, vst2, pos, pm, dv, VKIND, VBS, VW, VQH)
            acc = acc * corr[:, None] + tl.dot(p, vt, input_precision=PREC)
            m = mn
    o = (h * splits + sp) * RP + rows
    tl.store(m_out + o, m)
    tl.store(l_out + o, lsum)
    tl.store(acc_out + o[:, None] * DV + dv[None, :], acc)
