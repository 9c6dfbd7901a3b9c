"""Prompt reading at depth, two checkouts side by side, through `turbospec bench` as a user runs it.

Per case one `turbospec bench` process per checkout and repetition, the two checkouts back to back in alternating
order; the median of each side's prefill t/s and of the paired after/before ratios. Cases (float16 weights, random
tokens): a long prompt read from an empty cache (`-p L`: the time to the first token of an L-token prompt) and a
512-token prompt read after L positions of context (`-d L -p 512`), on the bundled hybrid (L = 32768) and on the
engine-core shape (`models/demo-qwen3`, made if missing; L = 16384). `--kv T` reads into a T cache (`-ctk T -ctv
T`; default the model's f16 cache), `--cases` picks cases by name.

    python benchmarks/prefill_depth.py --before ../old-checkout --after . --reps 3 \
        --out docs/results/prefill_depth_before_after.json

Each checkout runs with its own directory first on sys.path and its own torch extension cache (built by a
warm-up run of each before the measured ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_revisions import revision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HYBRID, DENSE = ROOT / "models" / "turbospec-tiny-hybrid", ROOT / "models" / "demo-qwen3"
CASES = {
    "hybrid pp32768": (HYBRID, ["-p", "32768", "--warmup", "0"]),
    "hybrid pp512 @ d32768": (HYBRID, ["-p", "512", "-d", "32768"]),
    "engine-core pp16384": (DENSE, ["-p", "16384", "--warmup", "0"]),
    "engine-core pp512 @ d16384": (DENSE, ["-p", "512", "-d", "16384"]),
}


def prefill_tps(checkout: Path, ext_dir: Path, model: Path, flags: list[str], kv: str | None = None) -> float:
    """The prefill t/s of one `turbospec bench` run (one measured repetition, 8 generated tokens)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "turbospec.cli", "bench", "-m", str(model), "--dtype", "float16", "-n", "8",
               "-r", "1", "-q", "--out", out, *flags, *(["-ctk", kv, "-ctv", kv] if kv else [])]
        env = dict(os.environ, PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(ext_dir))
        r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{checkout}: {' '.join(cmd[2:])} failed: {r.stderr.strip()[-500:]}")
        return json.loads((Path(out) / "report.json").read_text())["rows"][0]["prefill_tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier checkout (repository root)")
    ap.add_argument("--after", required=True, help="the later checkout (repository root)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv", default=None, help="K and V cache type (default: the model's f16 cache)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE",
                    help="cases to run, by name (default all)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    cases = {c: CASES[c] for c in a.cases}
    if not (DENSE / "config.json").exists():
        from turbospec.demo import make_demo_model

        make_demo_model(DENSE)
    sides = {"before": Path(a.before).resolve(), "after": Path(a.after).resolve()}
    ext = {k: Path(tempfile.gettempdir()) / f"turbospec_ext_{k}" for k in sides}
    for side, path in sides.items():  # warm-up: kernel builds, page cache
        for model in dict.fromkeys(m for m, _ in cases.values()):
            prefill_tps(path, ext[side], model, ["-p", "64"], a.kv)
    runs: dict[str, dict[str, list[float]]] = {c: {s: [] for s in sides} for c in cases}
    for rep in range(a.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name, (model, flags) in cases.items():
            for side in order:
                runs[name][side].append(prefill_tps(sides[side], ext[side], model, flags, a.kv))
            print(f"rep {rep + 1} {name}: " + ", ".join(f"{s} {runs[name][s][-1]:.0f} t/s" for s in sides),
                  file=sys.stderr, flush=True)
    report = {**{s: revision(p) for s, p in sides.items()}, "reps": a.reps, "kv": a.kv,
              "command": " ".join(["python", "benchmarks/prefill_depth.py", *sys.argv[1:]]), "cases": {}}
    print("| case | prefill t/s before | after | after/before (paired) |\n|---|---|---|---|")
    for name, by in runs.items():
        med = {s: statistics.median(by[s]) for s in sides}
        ratio = statistics.median(x / y for x, y in zip(by["after"], by["before"]))
        report["cases"][name] = {"prefill_tps": med, "paired_ratio": ratio, "runs": by}
        print(f"| {name} | {med['before']:.0f} | {med['after']:.0f} | {ratio:.2f}x |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
