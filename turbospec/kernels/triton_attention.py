"""Few-row attention over a KV cache in any plain or packed format, in Triton (the GPU's counterpart of
attention.cpp): each program decodes a span of one KV head's positions straight from the cache's fields (no
float copy of the cache), scores the query rows against it and keeps an online softmax; the spans' partial states
are merged at the end (split-K "flash decoding").

`partial(q, k_spec, k_fields, v_spec, v_fields, v_width, start, end)` has attention.py's `partial` contract: q
float32 [KVH, R, Dk] (scaled; rotated and zero-padded to K's decoded width; for integer keys already rounded by
`kv.query_rounding`), fields [KVH, T, ...] in the spec's order, and it returns the partial softmax state m [KVH, R],
l [KVH, R], acc [KVH, R, v_width] over positions [start, end). A spec is attention.py's (kind, index bits, field
names, centroid table: float32, on q's device for turbo* kinds). Products run as three TF32 products on the GPU's tensor cores (IEEE float32 in the
interpreter, or where a Triton refuses that), so results match the torch reference to about float32 rounding.
Where it runs: `turbospec.kernels.gpu.wanted`; the kernels compile on first use (on the CPU the tests run them in
Triton's interpreter).
"""

from __future__ import annotations

import math
import sys
from functools import cache

import torch

from turbospec.kernels.attention import BF16, F16, F32, PLAIN_SPECS, Q4_0, Q8_0, TBQ4_0, TURBO, TURBO64

# products on tensor cores as three TF32 products (about float32's accuracy); "ieee" where that is refused, and in
# the interpreter
_PRECISION = "tf32x3"
MAX_ROWS = 64  # query rows per KV head one program holds (decode and verification steps; prefill uses torch)
_BLOCK = {Q8_0: 32, Q4_0: 32, TBQ4_0: 64, TURBO: 128, TURBO64: 64}


def supports(spec, width: int) -> bool:
    """Whether the kernel reads a format of this spec at this decoded width (a power of two >= 16)."""
    return spec is not None and width >= 16 and width & (width - 1) == 0 and spec[0] in (
        F32, F16, BF16, Q8_0, Q4_0, TBQ4_0, TURBO, TURBO64)


def _side(spec, fields: list[torch.Tensor], device: torch.device):
    """(pointers f0..f2, centroid table, strides (head, position) x 3, constexprs KIND, BS, W, QH) of one side."""
    kind, bits = spec[0], spec[1]
    f = list(fields) + [fields[0]] * (3 - len(fields))
    strides = []
    for t in f:
        strides += [t.stride(0), t.stride(1)]
    cent = spec[3] if kind in (TURBO, TURBO64) else _dummy(device)
    w = 4 if kind in (Q4_0, TBQ4_0) else (2 if bits == 3 else bits)
    return f, cent, strides, (kind, _BLOCK.get(kind, 1), w, int(bits == 3))


@cache
def _dummy(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


@cache
def _programs(device: torch.device) -> int:
    """Programs that fill the device: about 4 per multiprocessor (8 in the interpreter)."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def splits_for(kvh: int, n: int, block_n: int, device: torch.device) -> int:
    """Spans per KV head: enough programs to fill the device, each at least 4 tiles."""
    return max(1, min(-(-n // (4 * block_n)), -(-_programs(device) // kvh)))


def partial(q: torch.Tensor, k_spec, k_fields: list[torch.Tensor], v_spec, v_fields: list[torch.Tensor],
            v_width: int, start: int, end: int, paged: tuple | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`paged` (for `paged` below): (tables, lens, KV heads, block); q's first dimension is then sequences x KV
    heads, and `end` the longest sequence's length."""
    kernel = _kernel()
    programs, r, dk = q.shape
    if paged is None:
        kvh, pb, paged_args = 1, 1, (None, None, 0)
    else:
        tables, lens, kvh, pb = paged
        paged_args = (tables, lens, tables.stride(0))
    if r > MAX_ROWS:
        raise ValueError(f"{r} query rows per KV head: the Triton attention takes at most {MAX_ROWS}")
    rp = max(16, 1 << (r - 1).bit_length())
    block_n = 64 if max(dk, v_width) <= 128 else 32
    n = end - start
    splits = splits_for(programs, n, block_n, q.device)
    # tiles per span: a power of two (a compile-time trip count, so few variants compile as the context grows)
    tiles = 1 << (-(-n // (splits * block_n)) - 1).bit_length()
    chunk = tiles * block_n
    splits = -(-n // chunk)
    m = torch.empty(programs, splits, rp, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(programs, splits, rp, v_width, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    kf, kc, ks, kk = _side(k_spec, k_fields, q.device)
    vf, vc, vs, vk = _side(v_spec, v_fields, q.device)
    args = (q, m, lsum, acc, *kf, kc, *ks, *vf, vc, *vs, start, end, chunk, r, q.stride(0), q.stride(1),
            *paged_args)
    meta = {"TILES": tiles, "RP": rp, "DK": dk, "DV": v_width, "BLOCK_N": block_n, "KKIND": kk[0], "KBS": kk[1],
            "KW": kk[2], "KQH": kk[3], "VKIND": vk[0], "VBS": vk[1], "VW": vk[2], "VQH": vk[3],
            "PAGED": paged is not None, "KVH": kvh, "PB": pb, "num_warps": 8 if max(dk, v_width) > 128 else 4}
    global _PRECISION
    if q.is_cuda and _PRECISION == "tf32x3":
        try:
            kernel[(programs, splits)](*args, PREC="tf32x3", **meta)
        except Exception as e:  # noqa: BLE001 -- a Triton without 3xTF32 products: IEEE float32 (slower)
            print(f"turbospec: Triton attention without tf32x3 ({' '.join(str(e).split())[:100]}); using ieee",
                  file=sys.stderr)
            _PRECISION = "ieee"
    if not q.is_cuda or _PRECISION == "ieee":
        kernel[(programs, splits)](*args, PREC="ieee", **meta)
    top = m.amax(1, keepdim=True)
    w = torch.exp(m - top)
    w = torch.where(torch.isfinite(m), w, torch.zeros_like(w))
    lsum = (w * lsum).sum(1)
    acc = (w.unsqueeze(-1) * acc).sum(1)
    return top.squeeze(1)[:, :r], lsum[:, :r], acc[:, :r]


def paged(q: torch.Tensor, k_spec, k_fields: list[torch.Tensor], v_spec, v_fields: list[torch.Tensor], v_width: int,
          tables: torch.Tensor, lens: torch.Tensor, block: int, longest: int) -> torch.Tensor:
    """kernels.attention.paged's contract on a GPU: q float32 [S, KVH, R, Dk] (scaled, rotated, padded; for integer
    keys rounded by `kv.query_rounding`) over a paged cache's fields [KVH, blocks * block, ...], tables int32 [S,
    max blocks], lens [S] (positions each sequence attends; `longest` their maximum, known on the host) -> the
    normalized output [S, KVH, R, v_width] float32. One launch for every sequence, KV head and span."""
    s, kvh, r, dk = q.shape
    _, lsum, acc = partial(q.reshape(s * kvh, r, dk), k_spec, k_fields, v_spec, v_fields, v_width, 0, longest,
                           (tables, lens, kvh, block))
    return (acc / lsum.unsqueeze(-1)).reshape(s, kvh, r, v_width)


def with_own_rows(m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, mask: torch.Tensor | None, g: int) -> torch.Tensor:
    """The attention output [KVH, G*N, Dv] of query rows q float32 [KVH, G*N, Dk] (G query heads x N tokens) from a
    partial softmax state over earlier positions (m, lsum [KVH, G*N], acc [KVH, G*N, Dv]: `partial`'s, or empty
    with m = -inf), extended in torch by the rows' own N positions (keys [KVH, N, Dk], values [KVH, N, Dv], float32),
    token i seeing the own positions mask[i] allows (None: causal)."""
    n = keys.shape[1]
    sc = torch.matmul(q, keys.transpose(1, 2))  # [KVH, G*N, N]
    allowed = mask if mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    sc.masked_fill_(~allowed.repeat(g, 1), -math.inf)
    top = torch.maximum(m, sc.amax(-1))  # every row sees its own token: finite
    p = torch.exp(sc - top.unsqueeze(-1))
    corr = torch.exp(m - top)
    lsum = lsum * corr + p.sum(-1)
    acc = acc * corr.unsqueeze(-1) + torch.matmul(p, values)
    return acc / lsum.unsqueeze(-1)


def decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per head, q [H, 1, D], over plain K/V views [KVH, L, D] (f32/f16/bf16): the output [H, 1, D]
    in q's dtype."""
    h, _, d = q.shape
    kvh = keys.shape[0]
    qg = q.reshape(kvh, h // kvh, d).to(torch.float32) * scale
    _, lsum, acc = partial(qg, PLAIN_SPECS[keys.dtype], [keys], PLAIN_SPECS[values.dtype], [values], d, 0,
                           keys.shape[1])
    return (acc / lsum.unsqueeze(-1)).to(q.dtype).reshape(h, 1, d)


@cache
def _kernel():
    from turbospec.kernels import triton_attention_jit

    return triton_attention_jit.attend
