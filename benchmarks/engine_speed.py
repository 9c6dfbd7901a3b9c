"""Engine-core speed, side by side in one run: turbospec vs transformers generate(), per dtype.

Model: the random-weight Qwen3 benchmark shape (hidden 512, 8 layers, 8 heads, 2 KV heads, head_dim 64,
vocab 32000, tied; 40.5M parameters), built locally by turbospec.demo. Greedy, 512-token prompt, 128 generated
tokens, one warm-up round discarded, median of 5. Decode is measured at two depths, the same for every
engine: after the 512-token prompt ("decode", positions 512-639: llama-bench's `tg128 @ d512`) and from a one-token
prompt ("decode_d0", positions 1-128: llama-bench's plain `tg128`, which starts from an empty cache).
Interleaved: every round runs each engine at each dtype once (this machine's speed drifts by 30% within
minutes, so engines measured minutes apart are not comparable), after measuring the machine's copy bandwidth
(numpy, 256 MB); the weight bandwidth each engine achieves (weight bytes read per token x decode t/s) is divided
by the copy bandwidth of its own round, median over rounds. The ratio to
llama.cpp is given both as the ratio of the medians and paired: each round's ratio (the two engines back to back),
median over rounds.
With `--llama-bench PATH` (a llama.cpp `llama-bench` binary) the same weights are written as GGUF
(benchmarks/to_gguf.py; f32 for float32, f16 for float16) and llama.cpp's pp512 / tg128 are measured in the same run
(`-p 512 -n 128 -d 0,512`, `-t` threads; llama.cpp has no bf16 row here).
Packed weight types (`--weights q8_0 q4_0 q4_k`): with `--llama-quantize PATH` the f32 GGUF is quantized by
llama.cpp (`llama-quantize --pure`, every matrix in the type) and both engines run *that file* (turbospec keeps its
blocks packed, activations in --weights-dtype); without it, turbospec quantizes the checkpoint at load (`--weights`).
`q5_k` / `q6_k` (pure) and `q4_k_m` / `q5_k_m` (llama.cpp's mixes: Q4_K or Q5_K, with Q6_K for the LM head and some
attn_v / ffn_down, the files users download most) need `--llama-quantize`.

    python benchmarks/engine_speed.py [--reps 5] [--dtypes float32 bfloat16 float16] [--llama-bench PATH]
        [--weights q8_0 q4_0 q4_k] [--llama-quantize PATH] [--out docs/results/engine_speed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from turbospec import env
from turbospec.config import EngineConfig
from turbospec.demo import make_demo_model
from turbospec.dtypes import parse_dtype
from turbospec.engine import Engine
from turbospec.model import load_model
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


class TurbospecRunner:
    def __init__(self, path: Path, dtype: str, ids: list[int], weights: str = "auto"):
        model = load_model(path, dtype, weights)
        self.eng = Engine(model, None, EngineConfig(ctx=PROMPT + GEN + 8, ubatch=512, prefix_cache=False))
        self.ids = ids
        self.params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)

    def once(self) -> dict[str, float]:
        self.eng.generate([self.ids], self.params)
        res = {"prefill": self.eng.last_stats.prefill_tps, "decode": self.eng.last_stats.decode_tps}
        self.eng.generate([self.ids[:1]], self.params)
        return {**res, "decode_d0": self.eng.last_stats.decode_tps}


class TransformersRunner:
    def __init__(self, path: Path, dtype: str, ids: list[int]):
        from transformers import AutoModelForCausalLM

        dt = parse_dtype(dtype)
        self.m = AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
        self.x = torch.tensor([ids])

    def once(self) -> dict[str, float]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.m.generate(self.x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            self.m.generate(self.x, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False)
            t2 = time.perf_counter()
        prefill = t1 - t0
        return {"prefill": PROMPT / prefill, "decode": (GEN - 1) / ((t2 - t1) - prefill)}


class LlamaCppRunner:
    """llama-bench pp512 and tg128 at depths 0 and 512 (one repetition per call) on a GGUF of the same weights."""

    def __init__(self, binary: str, path: Path, dtype: str, threads: int, gguf: Path | None = None):
        self.gguf = gguf or float_gguf(path, {"float32": "f32", "float16": "f16"}[dtype])
        self.cmd = [binary, "-m", str(self.gguf), "-p", str(PROMPT), "-n", str(GEN), "-d", f"0,{PROMPT}", "-t",
                    str(threads), "-r", "1", "-o", "json"]

    def once(self) -> dict[str, float]:
        import subprocess

        speed = llama_bench_speeds(subprocess.run(self.cmd, check=True, capture_output=True, text=True).stdout)
        return {"prefill": speed["pp", 0], "decode": speed["tg", PROMPT], "decode_d0": speed["tg", 0]}


def llama_bench_speeds(stdout: str) -> dict[tuple[str, int], float]:
    """`llama-bench -o json` output as {("pp" or "tg", depth): t/s} (also used by real_size.py)."""
    return {("pp" if r.get("n_prompt") else "tg", r.get("n_depth", 0)): r["avg_ts"] for r in json.loads(stdout)}


def float_gguf(path: Path, wtype: str) -> Path:
    """The checkpoint as an f32 / f16 GGUF file beside it (written once)."""
    import subprocess
    import sys

    out = path / f"bench-{wtype}.gguf"
    if not out.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("to_gguf.py")), "--model", str(path),
                        "--type", wtype, "--out", str(out)], check=True)
    return out


LLAMA_ONLY = ("q4_k_m", "q5_k_m", "q5_k", "q6_k")  # types only llama.cpp quantizes to (turbospec has no quantizer for them)


def quantized_gguf(path: Path, wtype: str, quantize: str) -> Path:
    """The checkpoint quantized by llama.cpp to `wtype`, written once: every matrix in that type (--pure), or, for a
    mix such as q4_k_m, llama.cpp's choice per tensor (Q6_K for the LM head and some attn_v / ffn_down)."""
    import subprocess

    out = path / f"bench-{wtype}.gguf"
    if not out.exists():
        pure = [] if wtype.endswith("_m") else ["--pure"]
        subprocess.run([quantize, *pure, str(float_gguf(path, "f32")), str(out), wtype.upper()], check=True,
                       capture_output=True)
    return out


def _summary(samples: list[dict[str, float]]) -> dict:
    """Per measure (prefill, decode, decode_d0): the median over rounds as `<measure>_tps` and every round's value
    as `<measure>_all`."""
    res: dict = {}
    for k in samples[0]:
        res[f"{k}_tps"] = statistics.median(s[k] for s in samples)
        res[f"{k}_all"] = [s[k] for s in samples]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--llama-bench", default=None, help="path of a llama.cpp llama-bench binary")
    ap.add_argument("--weights", nargs="*", default=[],
                    help="packed weight types: q8_0 q4_0 q4_k, and with --llama-quantize q5_k q6_k q4_k_m q5_k_m")
    ap.add_argument("--weights-dtype", default="bfloat16", help="activations / KV of the packed rows")
    ap.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize (packed rows)")
    ap.add_argument("--out", default="docs/results/engine_speed.json")
    a = ap.parse_args()
    if not a.llama_quantize and set(a.weights) & set(LLAMA_ONLY):
        ap.error(f"{', '.join(sorted(set(a.weights) & set(LLAMA_ONLY)))}: needs --llama-quantize (llama.cpp quantizes it)")
    torch.set_num_threads(a.threads)
    path = Path(a.model)
    if not (path / "config.json").exists():
        make_demo_model(path)
    ids = torch.randint(3, 32000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    runners: dict[tuple[str, str], object] = {}
    for dtype in a.dtypes:
        runners[("turbospec", dtype)] = TurbospecRunner(path, dtype, ids)
        if not a.no_transformers:
            runners[("transformers", dtype)] = TransformersRunner(path, dtype, ids)
        if a.llama_bench and dtype in ("float32", "float16"):
            runners[("llama_cpp", dtype)] = LlamaCppRunner(a.llama_bench, path, dtype, a.threads)
    for wtype in a.weights:  # one GGUF file per type for both engines, or turbospec's own quantization
        gguf = quantized_gguf(path, wtype, a.llama_quantize) if a.llama_quantize else None
        runners[("turbospec", wtype)] = (TurbospecRunner(gguf, a.weights_dtype, ids) if gguf
                                         else TurbospecRunner(path, a.weights_dtype, ids, wtype))
        if a.llama_bench and gguf:
            runners[("llama_cpp", wtype)] = LlamaCppRunner(a.llama_bench, path, wtype, a.threads, gguf)
    samples: dict[tuple[str, str], list] = {k: [] for k in runners}
    bws: list[float] = []
    for r in range(a.reps + 1):  # round 0 is the warm-up; every round runs every engine and dtype once
        bw = copy_bandwidth_gbs()
        for key, runner in runners.items():
            res = runner.once()
            if r:
                samples[key].append(res)
        if r:
            bws.append(bw)
        print(f"round {r}/{a.reps} done (copy bandwidth {bw:.1f} GB/s)", flush=True)
    bw = statistics.median(bws)
    rows = []
    for dtype in [*a.dtypes, *a.weights]:
        ts = _summary(samples[("turbospec", dtype)])
        ts["weight_bytes_per_token"] = wb = runners[("turbospec", dtype)].eng.model.weight_bytes
        hf = _summary(samples[("transformers", dtype)]) if ("transformers", dtype) in samples else None
        lc = _summary(samples[("llama_cpp", dtype)]) if ("llama_cpp", dtype) in samples else None
        # share of the copy bandwidth measured in the same round, median over rounds
        share = statistics.median(wb * d / 1e9 / b for d, b in zip(ts["decode_all"], bws))
        row = {"dtype": dtype, "gguf": str(getattr(runners.get(("llama_cpp", dtype)), "gguf", "")) or None,
               "turbospec": ts, "transformers": hf, "llama_cpp": lc,
               "weight_GBps": wb * ts["decode_tps"] / 1e9, "bound_tps_at_copy_bw": bw * 1e9 / wb,
               "share_of_copy_bw": share}
        if lc:
            lc["share_of_copy_bw"] = statistics.median(wb * d / 1e9 / b for d, b in zip(lc["decode_all"], bws))
            # each round's ratio (the two engines ran back to back), median over rounds: this machine's speed
            # changes by up to 4x between phases, which a ratio of medians mixes
            for k in ("decode", "decode_d0", "prefill"):
                row[f"{k}_ratio_per_round"] = [t / ll for t, ll in zip(ts[f"{k}_all"], lc[f"{k}_all"])]
                row[f"{k}_ratio_paired"] = statistics.median(row[f"{k}_ratio_per_round"])
        rows.append(row)
        line = (f"{dtype:9s} turbospec decode {ts['decode_tps']:6.1f} t/s (depth 0: {ts['decode_d0_tps']:6.1f})"
                f"  prefill {ts['prefill_tps']:7.1f} t/s  weights {row['weight_GBps']:5.1f} GB/s ({share:4.0%} of copy bw)")
        if hf:
            line += (f" | transformers decode {hf['decode_tps']:6.1f}  prefill {hf['prefill_tps']:7.1f}"
                     f" | ratio decode {ts['decode_tps'] / hf['decode_tps']:4.2f}x"
                     f" prefill {ts['prefill_tps'] / hf['prefill_tps']:4.2f}x")
        if lc:
            line += (f" | llama.cpp decode {lc['decode_tps']:6.1f} (depth 0: {lc['decode_d0_tps']:6.1f})"
                     f"  prefill {lc['prefill_tps']:7.1f}"
                     f" | turbospec/llama.cpp decode {ts['decode_tps'] / lc['decode_tps']:4.2f}x"
                     f" prefill {ts['prefill_tps'] / lc['prefill_tps']:4.2f}x"
                     f" (paired per round: decode {row['decode_ratio_paired']:4.2f}x"
                     f" depth 0 {row['decode_d0_ratio_paired']:4.2f}x"
                     f" prefill {row['prefill_ratio_paired']:4.2f}x)")
        print(line, flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpu_count": torch.get_num_threads(),
            "torch": torch.__version__, "copy_bandwidth_GBps": bw, "copy_bandwidth_all": bws, "prompt": PROMPT,
            "gen": GEN, "reps": a.reps, "interleaved": True, "weights_dtype": a.weights_dtype,
            "command": " ".join(["python", "benchmarks/engine_speed.py", *sys.argv[1:]]),
            "env": env.all_set()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"copy bandwidth {bw:.1f} GB/s (median of the rounds); wrote {a.out}")


if __name__ == "__main__":
    main()
