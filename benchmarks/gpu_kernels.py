"""The Triton kernels alone (issue #28): attention over a KV cache at depth for each format, the KV encoder, the
Gated DeltaNet step and the packed weights' dequantizing product (1 and 4 rows over the MLP's matrices), timed with CUDA events (median of `--reps` after warm-up), with the bytes each call reads
and the GB/s that makes against the device's copy bandwidth. Shapes: Qwen3.6-27B's attention layer (4 KV heads of
256, 6 query rows per KV head in decode) and Gated DeltaNet layer (48 value heads, 16 key heads, 128 x 128 states).

    python benchmarks/gpu_kernels.py [--depths 4096,32768,262144] [--formats f16,q8_0,q4_0,tbq4_0,turbo3,turbo4]
        [--reps 20] [--out gpu_kernels.json]
    python benchmarks/gpu_kernels.py --device cpu --depths 512 --reps 1   # the script's own check (interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of fn() over `reps` calls after two warm-ups."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--depths", default="4096,32768,262144")
    ap.add_argument("--formats", default="f16,q8_0,q4_0,tbq4_0,turbo3,turbo4")
    ap.add_argument("--weights", default="bf16,q8_0,q4_0,q4_k,q5_k,q6_k", help="the packed product's formats (bf16: torch)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="gpu_kernels.json")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton loads
    from turbospec.kernels import gpu
    from turbospec.kernels import triton_attention as ta
    from turbospec.kernels import triton_deltanet as td
    from turbospec.kernels import triton_encode as te
    from turbospec.kv import kernel_args
    from turbospec.kv.formats import get_format
    from turbospec.kv.hadamard import rotation_matrix

    gpu.ON_CPU = not cuda
    dev = torch.device(a.device)
    kvh, rows, d = 4, 6, 256
    bw = float("nan")
    if cuda:
        x = torch.empty(1 << 30, device=dev)
        y = torch.empty_like(x)
        bw = 2 * x.numel() * 4 / timed(lambda: y.copy_(x), 10, True) / 1e9
        del x, y
    report: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter)", "copy_gbps": bw,
                    "attention": [], "encode": [], "deltanet": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name in filter(None, a.formats.split(",")):
        fmt = get_format(name)
        spec = kernel_args.attention_spec(fmt, d)
        spec = (*spec[:3], spec[3].to(dev))  # (the centroid table on the device)
        w = fmt.padded_dim(d)
        for depth in (int(x) for x in a.depths.split(",") if x):
            bufs = fmt.allocate(d, (kvh, depth), device=dev)
            for s in range(0, depth, 16384):
                e = min(depth, s + 16384)
                for f, t in fmt.encode(torch.randn(kvh, e - s, d, generator=g, device=dev)).items():
                    bufs[f][:, s:e] = t
            q = torch.randn(kvh, rows, w, generator=g, device=dev) * 0.05
            fields = [bufs[f] for f in spec[2]]
            secs = timed(lambda q=q, fields=fields, spec=spec, w=w, depth=depth:
                         ta.partial(q, spec, fields, spec, fields, w, 0, depth), a.reps, cuda)
            nbytes = 2 * sum(t.numel() * t.element_size() for t in bufs.values())  # K and V
            row = {"format": name, "depth": depth, "us": secs * 1e6, "gbps": nbytes / secs / 1e9}
            report["attention"].append(row)
            print(json.dumps(row), flush=True)
            del bufs
        es = kernel_args.encode_spec(fmt, d)
        if es is not None and te.supports(es.kind, es.width, d):
            bufs = fmt.allocate(d, (kvh, 64), device=dev)
            xv = torch.randn(kvh, 1, d, generator=g, device=dev)
            turbo = None
            if fmt.rotated:
                turbo = (rotation_matrix(dev, torch.float32, fmt.for_dim(d).block_size), es.bounds.to(dev),
                         es.cent.to(dev), es.bits, es.norm_mode)
            fields = [bufs[f] for f in es.fields]
            secs = timed(lambda xv=xv, es=es, fields=fields, turbo=turbo: te.encode_into(xv, es.kind, fields, 3, turbo),
                         a.reps, cuda)
            row = {"format": name, "us": secs * 1e6}
            report["encode"].append(row)
            print(json.dumps(row), flush=True)
    nk, nv, dk, dv, k = 16, 48, 128, 128, 4
    c = 2 * nk * dk + nv * dv
    for n in (1, 4):
        proj = torch.randn(n, c + nv * dv + 2 * nv, generator=g, device=dev).to(torch.bfloat16)
        qkv, z, b, a_ = proj.split([c, nv * dv, nv, nv], dim=-1)
        window = torch.cat([torch.zeros(k - 1, c, device=dev, dtype=torch.bfloat16), qkv])
        conv_t = torch.randn(k, c, generator=g, device=dev).to(torch.bfloat16)
        state = torch.randn(nv, dk, dv, generator=g, device=dev) * 0.1
        neg_a, dt_bias = -torch.rand(nv, generator=g, device=dev), torch.zeros(nv, device=dev)
        norm_w = torch.ones(dv, device=dev, dtype=torch.bfloat16)
        args = (window, conv_t, z, b, a_, neg_a, dt_bias, norm_w, state, None, nk, nv, dk, dv, 1e-6)
        secs = timed(lambda args=args: td.step(*args), a.reps, cuda)
        nbytes = state.numel() * 4 * (1 + n)  # the state read, every token's state written
        row = {"tokens": n, "us": secs * 1e6, "gbps": nbytes / secs / 1e9}
        report["deltanet"].append(row)
        print(json.dumps(row), flush=True)
    # packed weights: the MLP's matrices of Qwen3.6-27B (gate+up [34816, 5120], down [5120, 17408]) in each packed
    # format through the fused product, beside torch's bf16 product of the same shape
    from turbospec.kernels import triton_packed as tpk
    from turbospec.weights import PACKED, Q5_K, Q6_K, random_blocks

    by_name = {**PACKED, "q5_k": Q5_K, "q6_k": Q6_K}

    report["packed"] = []
    shapes = [(34816, 5120), (5120, 17408)] if cuda else [(512, 256)]
    for out_f, in_f in shapes:
        for name in a.weights.split(","):
            for rows in (1, 4):
                x = torch.randn(rows, in_f, generator=g, device=dev).to(torch.bfloat16)
                if name == "bf16":
                    w = (torch.randn(out_f, in_f, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                else:
                    with torch.device(dev):
                        w = random_blocks(by_name[name], (out_f, in_f), generator=g)
                secs = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w) if w.dtype != torch.uint8
                             else tpk.matmul(x, w, None), a.reps, cuda)
                nbytes = w.numel() * w.element_size()
                row = {"weights": name, "shape": [out_f, in_f], "rows": rows, "us": secs * 1e6,
                       "gbps": nbytes / secs / 1e9}
                report["packed"].append(row)
                print(json.dumps(row), flush=True)
                del w
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
