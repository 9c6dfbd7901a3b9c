"""Engine-core speed, side by side in one run: turbospec vs transformers generate(), per dtype.

Model: the random-weight Qwen3 benchmark shape (hidden 512, 8 layers, 8 heads, 2 KV heads, head_dim 64,
vocab 32000, tied; 40.5M parameters), built locally by turbospec.demo. Greedy, 512-token prompt, 128 generated
tokens, one warm-up discarded, median of 5. Also measures the machine's copy bandwidth (numpy, 256 MB) and the
weight bandwidth each engine achieves (weight bytes read per token x decode t/s).
With `--llama-bench PATH` (a llama.cpp `llama-bench` binary) the same weights are written as GGUF
(benchmarks/to_gguf.py; f32 for float32, f16 for float16) and llama.cpp's pp512 / tg128 are measured in the same run
(`-t` threads, `-r` reps; llama.cpp has no bf16 row here).

    python benchmarks/engine_speed.py [--reps 5] [--dtypes float32 bfloat16 float16] [--llama-bench PATH]
        [--out docs/results/engine_speed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from turbospec.demo import make_demo_model
from turbospec.engine import Engine
from turbospec.models import load_model
from turbospec.sampling import SamplingParams

PROMPT, GEN = 512, 128


def copy_bandwidth_gbs(reps: int = 5) -> float:
    a = np.ones(256 * 2**20 // 8)
    b = np.empty_like(a)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return 2 * a.nbytes / min(ts) / 1e9


def bench_turbospec(path: Path, dtype: str, ids: list[int], reps: int) -> dict:
    eng = Engine(load_model(path, dtype), None, ctx=PROMPT + GEN + 8, ubatch=512, prefix_cache=False)
    p = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    pre, dec = [], []
    for r in range(reps + 1):
        eng.generate([ids], p)
        if r:
            pre.append(eng.last_stats.prefill_tps)
            dec.append(eng.last_stats.decode_tps)
    return {"prefill_tps": statistics.median(pre), "decode_tps": statistics.median(dec),
            "decode_all": dec, "prefill_all": pre, "weight_bytes_per_token": eng.model.weight_bytes}


def bench_transformers(path: Path, dtype: str, ids: list[int], reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
    x = torch.tensor([ids])
    pre, dec = [], []
    for r in range(reps + 1):
        with torch.inference_mode():
            t0 = time.perf_counter()
            m.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            m.generate(x, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False)
            t2 = time.perf_counter()
        if r:
            prefill = t1 - t0
            pre.append(PROMPT / prefill)
            dec.append((GEN - 1) / ((t2 - t1) - prefill))
    return {"prefill_tps": statistics.median(pre), "decode_tps": statistics.median(dec),
            "decode_all": dec, "prefill_all": pre}


def bench_llama_cpp(binary: str, path: Path, dtype: str, reps: int, threads: int) -> dict | None:
    """llama-bench pp512 / tg128 on a GGUF of the same weights (f32 or f16), or None for other dtypes."""
    import subprocess
    import sys

    wtype = {"float32": "f32", "float16": "f16"}.get(dtype)
    if wtype is None:
        return None
    gguf_path = path / f"bench-{wtype}.gguf"
    if not gguf_path.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("to_gguf.py")), "--model", str(path), "--type",
                        wtype, "--out", str(gguf_path)], check=True)
    out = subprocess.run([binary, "-m", str(gguf_path), "-p", str(PROMPT), "-n", str(GEN), "-t", str(threads),
                          "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True).stdout
    res = {"gguf": str(gguf_path)}
    for r in json.loads(out):
        key = "prefill_tps" if r.get("n_prompt") else "decode_tps"
        res[key] = r["avg_ts"]
        res[key.replace("tps", "all")] = r.get("samples_ts")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--llama-bench", default=None, help="path of a llama.cpp llama-bench binary")
    ap.add_argument("--out", default="docs/results/engine_speed.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = Path(a.model)
    if not (path / "config.json").exists():
        make_demo_model(path)
    ids = torch.randint(3, 32000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    bw = copy_bandwidth_gbs()
    rows = []
    for dtype in a.dtypes:
        ts = bench_turbospec(path, dtype, ids, a.reps)
        hf = None if a.no_transformers else bench_transformers(path, dtype, ids, a.reps)
        lc = bench_llama_cpp(a.llama_bench, path, dtype, a.reps, a.threads) if a.llama_bench else None
        wb = ts["weight_bytes_per_token"]
        row = {"dtype": dtype, "turbospec": ts, "transformers": hf, "llama_cpp": lc,
               "weight_GBps": wb * ts["decode_tps"] / 1e9, "bound_tps_at_copy_bw": bw * 1e9 / wb}
        rows.append(row)
        line = (f"{dtype:9s} turbospec decode {ts['decode_tps']:6.1f} t/s  prefill {ts['prefill_tps']:7.1f} t/s"
                f"  weights {row['weight_GBps']:5.1f} GB/s ({row['weight_GBps'] / bw:4.0%} of copy bw)")
        if hf:
            line += (f" | transformers decode {hf['decode_tps']:6.1f}  prefill {hf['prefill_tps']:7.1f}"
                     f" | ratio decode {ts['decode_tps'] / hf['decode_tps']:4.2f}x"
                     f" prefill {ts['prefill_tps'] / hf['prefill_tps']:4.2f}x")
        if lc:
            line += (f" | llama.cpp decode {lc['decode_tps']:6.1f}  prefill {lc['prefill_tps']:7.1f}"
                     f" | turbospec/llama.cpp decode {ts['decode_tps'] / lc['decode_tps']:4.2f}x")
        print(line, flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpu_count": torch.get_num_threads(),
            "torch": torch.__version__, "copy_bandwidth_GBps": bw, "prompt": PROMPT, "gen": GEN, "reps": a.reps}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"copy bandwidth {bw:.1f} GB/s; wrote {a.out}")


if __name__ == "__main__":
    main()
