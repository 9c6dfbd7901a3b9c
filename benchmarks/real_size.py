"""A real-size check of packed weights (issue #23 item 6): a random-weight Qwen3.5-shaped hybrid of about 2B
parameters with real hidden sizes (hidden 2048, intermediate 6144, 16 + 16 linear-attention heads of 128, 8 / 2
attention heads of 256, vocabulary 248,320, tied embeddings, one MTP layer; `--layers` of them, 24 by default),
exported as a Q4_K GGUF file (`turbospec export-gguf --type q4_k`, byte-identical to `llama-quantize --pure
Q4_K`), then run by turbospec and by llama.cpp's `llama-bench` on that same file, in interleaved rounds, each
run in its own process: load time, peak RSS, decode (and prefill) t/s. Decode at the same depth in both engines:
after the prompt (llama-bench `-d 0,PROMPT`: its tg at depth PROMPT, its pp at depth 0). Memory rows: the bf16
checkpoint loaded as bf16 and quantized at load (`--weights q8_0 / q4_k`): peak RSS of loading against the weight
bytes.

    python benchmarks/real_size.py [--dir /tmp/real2b] [--layers 24] [--rounds 3] [--prompt 128] [--gen 32]
        [--llama-bench PATH] [--out docs/results/real_size_q4k.json]

`--type q4_k_m --llama-quantize PATH`: the speed rounds run llama.cpp's Q4_K_M mix of the same checkpoint instead
(its f16 export quantized by `llama-quantize`: Q4_K, with Q6_K for the 248,320-row LM head and some attn_v /
ffn_down, Q8_0 / Q5_0 where rows are not whole 256-value blocks), the file users download; `--type q5_k_m` /
`q6_k` / `q8_0` the same way, llama.cpp's Q5_K_M / Q6_K / Q8_0 files.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from engine_speed import llama_bench_speeds  # (this folder is on sys.path when run as a script)

from turbospec import env as turbospec_env

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "vocab_size": 248320}


def build(out: Path, layers: int, seed: int = 0) -> None:
    """The random checkpoint (bf16 safetensors, one shard per 4 layers) with the bundled hybrid's tokenizer (the
    GGUF export pads its vocabulary to 248,320 tokens)."""
    from safetensors.torch import save_file

    src = ROOT / "models" / "turbospec-tiny-hybrid"
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(SHAPE, num_hidden_layers=layers,
               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    out.mkdir(parents=True, exist_ok=True)
    h, inter, hd = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    nk, nv, dk, dv = (SHAPE[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim"))
    conv = 2 * nk * dk + nv * dv
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def attn_block(p: str) -> dict:
        nh, kv = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
        return {f"{p}.self_attn.q_proj.weight": rnd(2 * nh * hd, h), f"{p}.self_attn.k_proj.weight": rnd(kv * hd, h),
                f"{p}.self_attn.v_proj.weight": rnd(kv * hd, h), f"{p}.self_attn.o_proj.weight": rnd(h, nh * hd),
                f"{p}.self_attn.q_norm.weight": rnd(hd), f"{p}.self_attn.k_norm.weight": rnd(hd)}

    def mlp_norms(p: str) -> dict:
        return {f"{p}.mlp.gate_proj.weight": rnd(inter, h), f"{p}.mlp.up_proj.weight": rnd(inter, h),
                f"{p}.mlp.down_proj.weight": rnd(h, inter), f"{p}.input_layernorm.weight": rnd(h),
                f"{p}.post_attention_layernorm.weight": rnd(h)}

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(SHAPE["vocab_size"], h),
                                      "model.norm.weight": rnd(h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        if cfg["layer_types"][i] == "full_attention":
            shard.update(attn_block(p))
        else:
            q = f"{p}.linear_attn"
            shard.update({f"{q}.in_proj_qkv.weight": rnd(conv, h), f"{q}.in_proj_z.weight": rnd(nv * dv, h),
                          f"{q}.in_proj_b.weight": rnd(nv, h), f"{q}.in_proj_a.weight": rnd(nv, h),
                          f"{q}.conv1d.weight": rnd(conv, 1, 4, std=0.2), f"{q}.A_log": rnd(nv, std=0.5),
                          f"{q}.dt_bias": rnd(nv, std=0.5), f"{q}.norm.weight": rnd(dv, std=0.1) + 1,
                          f"{q}.out_proj.weight": rnd(h, nv * dv)})
        shard.update(mlp_norms(p))
        if i % 4 == 3 or i == layers - 1:
            if i == layers - 1:  # the MTP block
                shard.update({"mtp.fc.weight": rnd(h, 2 * h), "mtp.norm.weight": rnd(h),
                              "mtp.pre_fc_norm_embedding.weight": rnd(h), "mtp.pre_fc_norm_hidden.weight": rnd(h),
                              **attn_block("mtp.layers.0"), **mlp_norms("mtp.layers.0")})
            name = f"model-{i // 4:05d}.safetensors"
            save_file(shard, str(out / name))
            weight_map.update(dict.fromkeys(shard, name))
            shard = {}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)


CHILD = r"""
import json, sys, time
import torch
from turbospec.config import EngineConfig
from turbospec.engine import Engine
from turbospec.kernels.gemv import load_kernel
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
torch.set_num_threads(2)
load_kernel()
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
def rss():
    return status("VmRSS")
def peak():  # VmHWM starts afresh at exec (ru_maxrss would carry the parent's peak over)
    return status("VmHWM")
path, dtype, weights, prompt, gen = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
base = rss()
t = time.perf_counter()
m = load_model(path, dtype, weights)
load_s = time.perf_counter() - t
load_peak = peak() - base
out = {"load_s": load_s, "weight_bytes": m.weight_bytes, "load_peak_rss": load_peak, "base_rss": base}
if gen:
    e = Engine(m, None, EngineConfig(ctx=prompt + gen + 8, prefix_cache=False))
    ids = torch.randint(3, 8000, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    e.generate([ids], SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    s = e.last_stats
    out.update(prefill_tps=s.prefill_tps, decode_tps=s.decode_tps, cache_bytes=e.cache.nbytes,
               peak_rss=peak() - base)
print(json.dumps(out))
"""


def turbospec(path: Path, dtype: str, weights: str, prompt: int, gen: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype, weights, str(prompt), str(gen)],
                       check=True, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, gguf: Path, prompt: int, gen: int) -> dict:
    t = time.perf_counter()
    # decode at turbospec's depth (after the prompt: tg @ d<prompt>), prefill from an empty cache (pp @ d0)
    r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", binary, "-m", str(gguf), "-p", str(prompt), "-n",
                        str(gen), "-d", f"0,{prompt}", "-t", "2", "-r", "1", "-o", "json"], check=True,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    speed = llama_bench_speeds(r.stdout)
    rss = next(int(line.split()[1]) * 1024 for line in r.stderr.splitlines() if line.startswith("MAXRSS"))
    return {"prefill_tps": speed["pp", 0], "decode_tps": speed["tg", prompt], "peak_rss": rss, "wall_s": wall}


def fit_load_peak(path: Path, dtype: str, weights: str) -> int:
    """`turbospec fit`'s prediction of the load peak above the import baseline (weights, MTP block, transient)."""
    from turbospec.lab.fit import Setup, estimate, load_arch

    e = estimate(load_arch(path), Setup(dtype=dtype, weights=weights, import_overhead=0), 64, "bf16", "bf16", "mtp")
    return e.load_peak or e.weights + e.mtp_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/real2b")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory rows (speed rounds only)")
    ap.add_argument("--type", default="q4_k", choices=("q4_k", "q4_k_m", "q5_k_m", "q6_k", "q8_0"),
                    help="the GGUF file of the speed rounds")
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize (every --type but q4_k)")
    ap.add_argument("--out", default="docs/results/real_size_q4k.json")
    a = ap.parse_args()
    if a.type != "q4_k" and not a.llama_quantize:
        ap.error(f"--type {a.type} needs --llama-quantize (llama.cpp makes the file)")
    d = Path(a.dir)
    ckpt, gguf = d / "checkpoint", d / "q4_k.gguf"
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        build(ckpt, a.layers)
        print(f"built the checkpoint in {time.perf_counter() - t:.0f} s", flush=True)
    from turbospec.model.gguf_export import export_gguf

    if not gguf.exists():
        t = time.perf_counter()
        export_gguf(ckpt, gguf, "q4_k")
        print(f"exported {gguf} ({gguf.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    run_file = gguf
    if a.type != "q4_k":
        run_file = d / f"{a.type}.gguf"
        if not run_file.exists():
            t = time.perf_counter()
            f16 = d / "f16.gguf"
            export_gguf(ckpt, f16, "f16")
            subprocess.run([a.llama_quantize, str(f16), str(run_file), a.type.upper()], check=True, capture_output=True)
            f16.unlink()
            print(f"quantized {run_file} ({run_file.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
                  flush=True)
    ours, theirs = f"turbospec_{a.type}_gguf", f"llama_cpp_{a.type}_gguf"
    rows: dict[str, list[dict]] = {ours: [], theirs: []}
    for r in range(a.rounds):
        rows[ours].append(turbospec(run_file, "bfloat16", "auto", a.prompt, a.gen))
        if a.llama_bench:
            rows[theirs].append(llama_bench(a.llama_bench, run_file, a.prompt, a.gen))
        print(f"round {r + 1}/{a.rounds}: turbospec {rows[ours][-1]}"
              + (f"; llama.cpp {rows[theirs][-1]}" if a.llama_bench else ""), flush=True)
    memory = {}
    rows_mem = {"bf16 checkpoint": (ckpt, "bfloat16", "auto"), "--dtype float16": (ckpt, "float16", "auto"),
                "--dtype float32": (ckpt, "float32", "auto"), "--weights q8_0": (ckpt, "bfloat16", "q8_0"),
                "--weights q4_0": (ckpt, "bfloat16", "q4_0"), "--weights q4_k": (ckpt, "bfloat16", "q4_k"),
                "q4_k GGUF": (gguf, "bfloat16", "auto")}
    for name, (path, dtype, weights) in ({} if a.no_memory else rows_mem).items():
        memory[name] = m = turbospec(path, dtype, weights, a.prompt, 0)
        m["fit_load_peak"] = fit_load_peak(path, dtype, weights)
        print(f"memory {name}: weights {m['weight_bytes'] / 1e9:.3f} GB, load peak RSS {m['load_peak_rss'] / 1e9:.3f} GB"
              f" ({m['load_peak_rss'] / m['weight_bytes']:.3f}x; fit predicts {m['fit_load_peak'] / 1e9:.3f} GB), "
              f"load {m['load_s']:.1f} s", flush=True)

    def med(key: str, name: str):
        vals = [r[key] for r in rows[name] if key in r]
        return statistics.median(vals) if vals else None

    summary = {name: {k: med(k, name) for k in ("decode_tps", "prefill_tps", "peak_rss", "load_s", "wall_s",
                                                "weight_bytes", "cache_bytes")} for name in rows}
    from safetensors import safe_open

    params = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            params += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())  # noqa: SIM118
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"shape": {**SHAPE, "layers": a.layers}, "parameters": params,
                                       "type": a.type, "gguf_bytes": run_file.stat().st_size,
                                       "command": " ".join(["python", "benchmarks/real_size.py", *sys.argv[1:]]),
                                       "env": turbospec_env.all_set(),
                                       "prompt": a.prompt, "gen": a.gen,
                                       "summary": summary, "rounds": rows, "memory": memory}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
