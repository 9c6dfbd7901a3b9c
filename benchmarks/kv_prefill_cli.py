"""Reading a long prompt into each KV cache type, through `turbospec bench` as a user runs it.

One `turbospec bench -p L -n 8 -r 1 --warmup 0 -ctk T -ctv T` process per type and round (float16 weights, random
tokens), the types in alternating order each round; the median prefill t/s of each type and the median of its
per-round ratio to the first type (the time to the first token of an L-token prompt, relative to that type).

    python benchmarks/kv_prefill_cli.py --model models/demo-qwen3 --prompt 16384 --types f16 q8_0 q4_0 tbq4_0 turbo3 \\
        --rounds 3 --out docs/results/kv_prefill_cli_dense.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prefill_tps(model: str, prompt: int, kv: str, dtype: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "turbospec.cli", "bench", "-m", model, "--dtype", dtype, "-p", str(prompt),
               "-n", "8", "-r", "1", "--warmup", "0", "-q", "--out", out, "-ctk", kv, "-ctv", kv]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd[2:])} failed: {r.stderr.strip()[-500:]}")
        return json.loads((Path(out) / "report.json").read_text())["rows"][0]["prefill_tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=16384, help="prompt tokens (default 16384)")
    ap.add_argument("--types", nargs="+", default=["f16", "tbq4_0"], help="K and V cache types; the first is the "
                                                                           "baseline of the ratios")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    prefill_tps(a.model, 64, a.types[0], a.dtype)  # warm-up: kernel builds, page cache
    runs: dict[str, list[float]] = {t: [] for t in a.types}
    for rnd in range(a.rounds):
        for t in a.types if rnd % 2 == 0 else list(reversed(a.types)):
            runs[t].append(prefill_tps(a.model, a.prompt, t, a.dtype))
        print(f"round {rnd + 1}: " + ", ".join(f"{t} {v[-1]:.0f}" for t, v in runs.items()), file=sys.stderr,
              flush=True)
    base = a.types[0]
    report = {"command": " ".join(["python", "benchmarks/kv_prefill_cli.py", *sys.argv[1:]]), "model": a.model,
              "prompt": a.prompt, "dtype": a.dtype, "rounds": a.rounds, "types": {}}
    print(f"| KV type | prefill t/s | x {base} (paired, range) |\n|---|---|---|")
    for t, v in runs.items():
        ratios = [x / y for x, y in zip(v, runs[base])]
        report["types"][t] = {"prefill_tps": statistics.median(v), "ratio": statistics.median(ratios),
                              "ratio_min": min(ratios), "ratio_max": max(ratios), "runs": v}
        print(f"| {t} | {statistics.median(v):.0f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
