"""The attention kernel alone per KV format on a cache-resident cache: one layer, 2 KV heads x 4 query rows, head
size 64, random K/V encoded to DEPTH positions; the median over 7 interleaved rounds of 20 calls of
`kernels.attention.partial`, 2 threads. Shows the kernels' arithmetic cost without the memory traffic of a whole model.

    python benchmarks/kv_kernel.py --depth 32768 --out docs/results/kv_kernel_32k.json

`--types` takes K/V pairs too (`turbo4/f16 f16/turbo4`): the key and value sides' costs apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from turbospec.kernels import attention as fused
from turbospec.kv import kernel_args
from turbospec.kv.quant_cache import QuantKVCache

TYPES = ["f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--types", nargs="*", default=TYPES, help="KV types, or K/V pairs (turbo4/f16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if fused.load() is None:
        raise SystemExit("the attention kernel is not available here")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g) * 0.125
    calls = {}
    for t in a.types:
        kt, vt = t.split("/") if "/" in t else (t, t)
        c = QuantKVCache(1, 2, 64, a.depth, kt, vt)
        for s in range(0, a.depth, 4096):
            n = min(4096, a.depth - s)
            c.length = s
            c.store(0, torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g) * 0.05)
        c.length = a.depth
        qq = kernel_args.rotate_fast(q, mod=c._encoder) if c.k_fmt.rotated else q
        kw, vw = c.k_fmt.padded_dim(64), c.v_fmt.padded_dim(64)
        qq = torch.nn.functional.pad(qq, (0, kw - qq.shape[-1])).contiguous()
        ks, vs = c._kernel_specs
        kf, vf = c._kernel_fields[0]
        calls[t] = (qq, ks, kf, vs, vf, vw)
    ms: dict[str, list[float]] = {t: [] for t in a.types}
    for _ in range(a.rounds):
        for t, (qq, ks, kf, vs, vf, vw) in calls.items():
            t0 = time.perf_counter()
            for _ in range(20):
                fused.partial(qq, ks, kf, vs, vf, vw, 0, a.depth)
            ms[t].append((time.perf_counter() - t0) / 20 * 1e3)
    rows = [{"type": t, "ms": statistics.median(v), "runs": v} for t, v in ms.items()]
    for r in rows:
        print(f"{r['type']:>8} {r['ms']:.3f} ms per call ({a.depth} positions)")
    if a.out:
        meta = {"command": " ".join(["python", "benchmarks/kv_kernel.py", *sys.argv[1:]]), "depth": a.depth,
                "threads": a.threads, "rounds": a.rounds}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
