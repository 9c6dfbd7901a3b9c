"""KV formats against f16 through the real path: `turbospec bench` (prefill to the depth, then decode), one process
per run, the types interleaved within each round, the median of each round's ratio to f16 (issue #26 item 5's
measurement). The benchmark shape (`models/demo-qwen3`, made if missing) in float16 by default. `--spec T` also
runs every type with `--spec-type T` (rows `type+T`, their ratios still to plain f16), and with `--spec-adaptive`
also with adaptive speculation (rows `type+T+adaptive`). Every row also keeps the prefill t/s of the `--prompt`
tokens read at that depth (so MTP on against off at the same depth). `--llama-bench PATH --gguf FILE` runs
llama.cpp's `llama-bench` on a GGUF of the same weights in the same rounds, decode at the same depth
(`-d DEPTH+PROMPT -n GEN`, flash attention on, KV types `--llama-types`; rows `llama.cpp:type`, their ratios to
turbospec's f16), with its prefill of a prompt as long at that depth (`-d DEPTH -p PROMPT`; with `--categories`
the category prompt's length). At long depths, where every run fills its context itself, `--adaptive-only` drops the
always-on `--spec` runs and `--llama-decode-only` llama-bench's prompt-at-depth run.

    python benchmarks/kv_bench_cli.py --depths 512 8192 32768 --rounds 3 --out docs/results/kv_bench_cli.json
    python benchmarks/kv_bench_cli.py --model models/turbospec-tiny --spec draft-mtp --categories code \
        --types f16 q8_0 tbq4_0 turbo3 --depths 0 2048 8192 --gen 128 --out docs/results/kv_bench_cli_mtp.json
    python benchmarks/kv_bench_cli.py --types f16 q8_0 tbq4_0 turbo3 --depths 0 8192 32768 --prompt 512 \
        --llama-bench <llama.cpp>/build/bin/llama-bench --gguf models/demo-qwen3/bench-f16.gguf
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
TYPES = ["f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3"]


def bench(model: str, dtype: str, kv: str, depth: int, gen: int, reps: int, spec: str | None = None,
          categories: str | None = None, adaptive: bool = False,
          prompt: int = 16) -> tuple[float, float | None, float, int]:
    """(decode t/s, draft acceptance rate or None, prefill t/s of the prompt at the depth, prompt tokens) of one
    `turbospec bench` run (medians over `reps` repetitions; with `categories` the prompt is that category's)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "turbospec.cli", "bench", "-m", model, "--dtype", dtype, "-d", str(depth), "-p",
               str(prompt), "-n", str(gen), "-r", str(reps), "-c", str(depth + prompt + gen + 64), "-ctk", kv, "-ctv",
               kv, "-q", "--out", out, *(["--spec-type", spec] if spec else []),
               *(["--spec-adaptive"] if spec and adaptive else []), *(["--categories", categories] if categories else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        row = json.loads((Path(out) / "report.json").read_text())["rows"][0]
        return row["decode_tps"], row.get("acc_rate"), row["prefill_tps"], row["n_prompt"]


def llama_bench(binary: str, gguf: str, kv: str, depth: int, prompt: int, gen: int, reps: int,
                threads: int, decode_only: bool = False) -> tuple[float, float]:
    """(decode t/s, prefill t/s) as `turbospec bench -d DEPTH -p PROMPT` measures them: the prompt read at `depth`,
    decode after it (at depth + prompt), from two `llama-bench` runs (`reps` repetitions each; llama-bench's `-d`
    fills the cache before each test, and its generation test does not read the prompt first). `decode_only`: the
    second run only (prefill 0.0)."""
    res = [0.0] if decode_only else []
    for p, n, d in ((prompt, 0, depth), (0, gen, depth + prompt))[int(decode_only):]:
        cmd = [binary, "-m", gguf, "-p", str(p), "-n", str(n), "-d", str(d), "-ctk", kv, "-ctv", kv, "-fa", "on",
               "-t", str(threads), "-r", str(reps), "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        res.append(json.loads(r.stdout)[0]["avg_ts"])
    return res[1], res[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--depths", type=int, nargs="*", default=[512, 8192, 32768])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default=None, help="also run each type with this --spec-type")
    ap.add_argument("--spec-adaptive", action="store_true", help="also run each type with --spec and --spec-adaptive")
    ap.add_argument("--adaptive-only", action="store_true",
                    help="with --spec-adaptive: skip the always-on --spec runs (each run fills its context again)")
    ap.add_argument("--categories", default=None, help="bench prompt category (default: bench's)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens read at the depth (their prefill t/s)")
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench (with --gguf)")
    ap.add_argument("--gguf", default=None, help="GGUF file of the same weights for llama-bench")
    ap.add_argument("--llama-types", nargs="*", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2, help="llama-bench threads")
    ap.add_argument("--llama-decode-only", action="store_true",
                    help="skip llama-bench's prompt-at-depth run (it fills the cache again; prefill rows then 0)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if bool(a.llama_bench) != bool(a.gguf):
        ap.error("--llama-bench and --gguf go together")
    if a.adaptive_only and not a.spec_adaptive:
        ap.error("--adaptive-only goes with --spec-adaptive")
    if not (ROOT / a.model / "config.json").exists():
        from turbospec.demo import make_demo_model

        make_demo_model(ROOT / a.model)
    if "f16" not in a.types:
        a.types = ["f16", *a.types]
    meta = {"command": " ".join(["python", "benchmarks/kv_bench_cli.py", *sys.argv[1:]]), "model": a.model,
            "dtype": a.dtype, "gen": a.gen, "reps": a.reps, "rounds": a.rounds, "spec": a.spec,
            "spec_adaptive": a.spec_adaptive, "categories": a.categories, "prompt": a.prompt,
            "gguf": a.gguf, "llama_types": a.llama_types if a.llama_bench else None,
            "adaptive_only": a.adaptive_only, "llama_decode_only": a.llama_decode_only}
    rows = []
    for depth in a.depths:
        always = a.spec and not a.adaptive_only
        runs = [(t, None, False) for t in a.types] + ([(t, a.spec, False) for t in a.types] if always else [])
        runs += [(t, a.spec, True) for t in a.types] if a.spec and a.spec_adaptive else []
        names = [t if sp is None else f"{t}+{sp}" + ("+adaptive" if ad else "") for t, sp, ad in runs]
        llama = [f"llama.cpp:{t}" for t in a.llama_types] if a.llama_bench else []
        tps: dict[str, list[float]] = {n: [] for n in names + llama}
        acc: dict[str, list[float | None]] = {n: [] for n in names + llama}
        pre: dict[str, list[float]] = {n: [] for n in names + llama}
        for r in range(a.rounds):
            n_prompt = a.prompt
            for name, (t, sp, ad) in zip(names, runs):
                speed, rate, pp, n_prompt = bench(a.model, a.dtype, t, depth, a.gen, a.reps, sp, a.categories, ad,
                                                  a.prompt)
                tps[name].append(speed)
                acc[name].append(rate)
                pre[name].append(pp)
                print(f"depth {depth} round {r} {name}: {speed:.1f} t/s, prefill {pp:.0f} t/s, acceptance {rate}",
                      flush=True)  # (a long run stopped part-way keeps what it printed)
            for name, t in zip(llama, a.llama_types):
                speed, pp = llama_bench(a.llama_bench, a.gguf, t, depth, n_prompt, a.gen, a.reps, a.threads,
                                        a.llama_decode_only)
                tps[name].append(speed)
                acc[name].append(None)
                pre[name].append(pp)
            print(f"depth {depth} round {r}: " + ", ".join(f"{t} {v[-1]:.1f} (prefill {pre[t][-1]:.0f})"
                                                         for t, v in tps.items()), flush=True)
        for t in names + llama:
            ratios = [x / f for x, f in zip(tps[t], tps["f16"])]
            rows.append({"type": t, "depth": depth, "decode_tps": statistics.median(tps[t]), "runs": tps[t],
                         "ratio_vs_f16": statistics.median(ratios), "ratios": ratios, "acc_rate": acc[t],
                         "prefill_tps": statistics.median(pre[t]), "prefill_runs": pre[t]})
        if a.out:  # after every depth: a long run stopped part-way keeps the depths it finished
            Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\n{'type':>20} {'depth':>6} {'t/s':>8} {'x f16':>6} {'prefill':>8}")
    for row in rows:
        print(f"{row['type']:>20} {row['depth']:>6} {row['decode_tps']:8.1f} {row['ratio_vs_f16']:6.2f}"
              f" {row['prefill_tps']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
