"""One MoE layer's routed experts, Q4_K, at the 35B-A3B shape (hidden 2048, experts of 512, 8 per token): the
`moe_experts` kernel (every expert of the step in two parallel passes) against expert-by-expert products, for 1
(decode) and 4 (verification) rows, float32 and bfloat16 activations; medians of interleaved calls.

    python benchmarks/moe_layer.py [--experts 32] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from turbospec.layers.moe import ExpertCache, MoE
from turbospec.weights import quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32, help="experts in the layer (more than fit the caches)")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    h, inter, top = 2048, 512, 8
    ws = [tuple(quantize(torch.randn(*s) * 0.02, "q4_k") for s in ((inter, h), (inter, h), (h, inter)))
          for _ in range(a.experts)]
    moe = MoE(torch.randn(a.experts, h) * 0.02, a.experts, lambda e: ws[e], top, True, None, None, ExpertCache(), 0)
    per_token = top * 3 * h * inter * 144 / 256
    print(f"routed expert bytes per row: {per_token / 1e6:.2f} MB")
    for dtype in (torch.float32, torch.bfloat16):
        moe.router.weight = moe.router.weight.to(dtype)
        for rows in (1, 4):
            x = torch.randn(rows, h).to(dtype)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(a.calls + 20):
                for fused in (True, False):
                    moe._fused = fused
                    t = time.perf_counter()
                    moe(x)
                    if i >= 20:
                        times[fused].append(time.perf_counter() - t)
            f, p = statistics.median(times[True]), statistics.median(times[False])
            print(f"{str(dtype)[6:]:9s} {rows} row(s): moe_experts {f * 1e6:7.0f} us ({per_token / f / 1e9:5.1f} GB/s "
                  f"per row's experts), expert by expert {p * 1e6:7.0f} us, ratio {p / f:.2f}x")


if __name__ == "__main__":
    main()
