"""Decode speed of each KV format against the default f16 cache through the engine, paired: after a prompt of DEPTH
random tokens, 48 greedy tokens per run, the formats interleaved over 5 rounds, the median of the per-round ratios
to f16. The benchmark shape (`models/demo-qwen3`: hidden 512, 8 layers, 8/2 heads x 64) in float16.

    python benchmarks/kv_decode.py 600,4096 docs/results/kv_decode_vs_f16.json
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from turbospec.config import EngineConfig
from turbospec.engine import Engine
from turbospec.model import load_model
from turbospec.sampling import SamplingParams

TYPES = ["f16", "q8_0", "q4_0", "tbq4_0", "turbo3"]


def main() -> None:
    torch.set_num_threads(2)
    model = load_model("models/demo-qwen3", "float16")
    out = {}
    for depth in [int(x) for x in sys.argv[1].split(",")]:
        ids = torch.randint(3, 30000, (depth,), generator=torch.Generator().manual_seed(0)).tolist()
        engines = {t: Engine(model, None, EngineConfig(ctx=depth + 100, cache_type_k=None if t == "f16" else t,
                                                         cache_type_v=None if t == "f16" else t)) for t in TYPES}
        sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        for e in engines.values():  # warm-up
            e.generate([ids], sp)
        tps: dict[str, list[float]] = {t: [] for t in TYPES}
        for _ in range(5):
            for t, e in engines.items():
                e.generate([ids], sp)
                tps[t].append(e.last_stats.decode_tps)
        ratios = {t: statistics.median(a / b for a, b in zip(tps[t], tps["f16"])) for t in TYPES}
        out[depth] = {"f16_tps": statistics.median(tps["f16"]), "ratio_vs_f16": ratios}
        print(depth, f"f16 {statistics.median(tps['f16']):.1f} t/s", {k: round(v, 3) for k, v in ratios.items()},
              flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
