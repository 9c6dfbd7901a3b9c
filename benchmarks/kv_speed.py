"""Decode speed at depth per KV-cache format, on the engine-core benchmark shape.

Model: the random-weight Qwen3 benchmark shape from `turbospec.demo` (hidden 512, 8 layers, 8 heads, 2 KV heads,
head_dim 64, vocab 32000). The cache is filled to the depth with random K/V (encoded once per format and copied
into every layer) instead of prefilling 32K tokens; then `--steps` single-token decode steps are timed and the
median step time is reported as t/s. `dense` is the default dense `KVCache` in the model dtype (SDPA);
every other row is a `QuantKVCache` (block-wise attention, `--block` positions per block). The types' steps are
interleaved round-robin at each depth, so that the machine's noisy phases hit every type alike.

    python benchmarks/kv_speed.py [--depths 1024 8192 32768] [--types dense f16 q8_0 q4_0 tbq4_0 turbo3 turbo4]
        [--dtype float32] [--steps 8] [--threads 2] [--out docs/results/kv_speed.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from turbospec.demo import make_demo_model
from turbospec.kv.cache import KVCache
from turbospec.kv.fill import fill_random
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.quant_cache import QuantKVCache
from turbospec.model import load_model


def make_cache(model, kind: str, depth: int, steps: int, block: int):
    c = model.cfg
    n = depth + steps + 2
    if kind == "dense":
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, n, model.dtype)
    else:
        cache = QuantKVCache(c.num_layers, c.num_kv_heads, c.head_dim, n, kind, kind, block=block)
    fill_random(cache, depth)
    return cache


def bench(model, kinds: list[str], depth: int, steps: int, block: int) -> list[dict]:
    """Decode steps at `depth` for every type, interleaved round-robin (step i of every type, then step i + 1),
    so that the machine's slow phases hit all types alike; median step time per type."""
    caches = {kind: make_cache(model, kind, depth, steps, block) for kind in kinds}
    tok = torch.tensor([5], dtype=torch.int64)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(steps + 1):
        for kind, cache in caches.items():
            t = time.perf_counter()
            h = model.forward(tok, AttentionPlan.causal(cache.length, 1), cache)
            model.logits(h)
            cache.commit()
            if i:  # first step is a warm-up
                times[kind].append(time.perf_counter() - t)
    rows = []
    for kind in kinds:
        med = statistics.median(times[kind])
        rows.append({"type": kind, "depth": depth, "tps": 1.0 / med, "step_ms": med * 1e3,
                     "cache_mib": caches[kind].nbytes / 2**20, "steps_ms": [x * 1e3 for x in times[kind]]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build the benchmark shape)")
    ap.add_argument("--depths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--types", nargs="+", default=["dense", "f16", "q8_0", "q4_0", "tbq4_0", "turbo3", "turbo4"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_demo_model(Path(tmp) / "bench")
        model = load_model(path, a.dtype)
    rows = []
    print(f"{'type':>8} {'depth':>6} {'t/s':>8} {'ms/step':>8} {'cache MiB':>10}")
    for depth in a.depths:
        for r in bench(model, a.types, depth, a.steps, a.block):
            rows.append(r)
            print(f"{r['type']:>8} {depth:>6} {r['tps']:8.2f} {r['step_ms']:8.1f} {r['cache_mib']:10.1f}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"dtype": a.dtype, "threads": torch.get_num_threads(), "steps": a.steps, "block": a.block}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
