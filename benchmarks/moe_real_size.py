"""A real-size mixture-of-experts check (issue #27 item 5): a random-weight model shaped like Qwen3.5/3.6-35B-A3B
(40 layers: 30 Gated DeltaNet + 10 gated attention, hidden 2048, 256 experts of intermediate 512, 8 routed + a
shared expert per token, 16 / 2 attention heads of 256, 16 / 32 linear-attention heads of 128, vocabulary 248,320,
one MTP layer with its own experts; about 35.6B parameters; the shape is our reading of the released configs, not
checked against them here) written as a Q4_K GGUF file of about 20 GB, then run by turbospec and by llama.cpp's
`llama-bench` on that same file on this 24 GB machine, every run in its own process: load time, peak RSS, decode
t/s at depth 0 (and `--depth`), with and without MTP, with every expert in memory and with the expert budget
(`--moe-cache-mem`) at 8 and 16 GiB.

The file is generated directly as random Q4_K blocks (scales chosen so the weights have a standard deviation of
about 0.025): quantizing 35B random values with the reference Q4_K quantizer would take about 30 minutes here.
Its norms are 1, so both engines compute the same function of the same bytes.

    python benchmarks/moe_real_size.py make [--file /tmp/moe35/q4k.gguf] [--layers 40]
    python benchmarks/moe_real_size.py run [--file ...] [--gen 32] [--depth 8192] [--llama-bench PATH]
        [--out docs/results/moe_real_size.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e7,
         "partial_rotary_factor": 0.25, "max_position_embeddings": 262144, "tie_word_embeddings": False}
Q4K = (256, 144)  # values, bytes per block


def tensors(cfg, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape in rows-last order, kind) of every tensor: kind 'q' (Q4_K blocks), 'one' (norms), 'a'
    (ssm_a, negative), 'small' (F32 random, std 0.02)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    lin, m = cfg.linear_dims(), cfg.moe()
    nk, nv, dk, dv = lin["num_k_heads"], lin["num_v_heads"], lin["k_head_dim"], lin["v_head_dim"]
    conv = 2 * nk * dk + nv * dv
    e, inter, si = m["experts"], m["inter"], m["shared_inter"]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = [("token_embd.weight", (v, h), "q"), ("output_norm.weight", (h,), "one"), ("output.weight", (v, h), "q")]

    def attention(b: int) -> list:
        return [(f"blk.{b}.attn_q.weight", (2 * q, h), "q"), (f"blk.{b}.attn_k.weight", (kv, h), "q"),
                (f"blk.{b}.attn_v.weight", (kv, h), "q"), (f"blk.{b}.attn_output.weight", (h, q), "q"),
                (f"blk.{b}.attn_q_norm.weight", (cfg.head_dim,), "one"),
                (f"blk.{b}.attn_k_norm.weight", (cfg.head_dim,), "one")]

    def moe(b: int) -> list:
        return [(f"blk.{b}.ffn_gate_inp.weight", (e, h), "small"), (f"blk.{b}.ffn_gate_exps.weight", (e, inter, h), "q"),
                (f"blk.{b}.ffn_up_exps.weight", (e, inter, h), "q"), (f"blk.{b}.ffn_down_exps.weight", (e, h, inter), "q"),
                (f"blk.{b}.ffn_gate_shexp.weight", (si, h), "q"), (f"blk.{b}.ffn_up_shexp.weight", (si, h), "q"),
                (f"blk.{b}.ffn_down_shexp.weight", (h, si), "q"), (f"blk.{b}.ffn_gate_inp_shexp.weight", (1, h), "small"),
                (f"blk.{b}.attn_norm.weight", (h,), "one"), (f"blk.{b}.post_attention_norm.weight", (h,), "one")]

    for b, kind in enumerate(cfg.layer_types()[:layers]):
        if kind == "full_attention":
            out += attention(b)
        else:
            out += [(f"blk.{b}.attn_qkv.weight", (conv, h), "q"), (f"blk.{b}.attn_gate.weight", (nv * dv, h), "q"),
                    (f"blk.{b}.ssm_beta.weight", (nv, h), "q"), (f"blk.{b}.ssm_alpha.weight", (nv, h), "q"),
                    (f"blk.{b}.ssm_conv1d.weight", (conv, lin["conv_kernel"]), "small"),
                    (f"blk.{b}.ssm_a", (nv,), "a"), (f"blk.{b}.ssm_dt.bias", (nv,), "small"),
                    (f"blk.{b}.ssm_norm.weight", (dv,), "one"), (f"blk.{b}.ssm_out.weight", (h, nv * dv), "q")]
        out += moe(b)
    n = layers  # the MTP block
    out += [(f"blk.{n}.nextn.eh_proj.weight", (h, 2 * h), "q"), (f"blk.{n}.nextn.enorm.weight", (h,), "one"),
            (f"blk.{n}.nextn.hnorm.weight", (h,), "one"), (f"blk.{n}.nextn.shared_head_norm.weight", (h,), "one")]
    return out + attention(n) + moe(n)


def q4k_pool(blocks: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks: random nibbles and 6-bit scales / mins, d = 1e-4 and dmin = 7.5e-4 (x U(0.8, 1.2)):
    weights of mean about 0 and standard deviation about 0.025."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    scale = rng.uniform(0.8, 1.2, size=blocks).astype(np.float32)
    pool[:, 0:2] = (scale * 1e-4).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    pool[:, 2:4] = (scale * 7.5e-4).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return pool.reshape(-1)


def make(path: Path, layers: int, seed: int = 0) -> None:
    import gguf

    from turbospec.model.config import ModelConfig
    from turbospec.model.gguf_export import write_metadata

    cfg = ModelConfig.from_dict({**SHAPE, "num_hidden_layers": layers})
    path.parent.mkdir(parents=True, exist_ok=True)
    table = tensors(cfg, layers)
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_name("random-qwen3.5-35b-a3b-shape")
    write_metadata(w, cfg, "qwen35moe", "q4_k", True, list(range(layers + 1)), ROOT / "models" / "turbospec-tiny-hybrid")
    qt_q, qt_f = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.F32
    for name, shape, kind in table:
        nbytes = int(np.prod(shape[:-1])) * (shape[-1] // Q4K[0]) * Q4K[1] if kind == "q" else int(np.prod(shape)) * 4
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, qt_q if kind == "q" else qt_f)
    pool = q4k_pool(1 << 21, seed)  # 288 MiB of blocks, read from shifting offsets
    rng = np.random.default_rng(seed + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0, done = time.time(), 0
    for name, shape, kind in table:
        if kind == "q":
            n = int(np.prod(shape[:-1])) * (shape[-1] // Q4K[0]) * Q4K[1]
            start = int(rng.integers(0, pool.size // 144)) * 144
            piece = 144 << 17  # whole blocks (18 MiB) from wrapping offsets
            idx = (start + np.arange(0, n, piece)) % pool.size
            parts, left = [], n
            for a in idx:
                k = min(left, piece, pool.size - int(a))
                parts.append(pool[int(a):int(a) + k])
                left -= k
            while left:  # (pieces cut short by the pool's end)
                k = min(left, pool.size)
                parts.append(pool[:k])
                left -= k
            data = np.concatenate(parts)
        elif kind == "one":
            data = np.ones(shape, dtype=np.float32)
        elif kind == "a":
            data = -rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
        else:
            data = (rng.standard_normal(size=shape) * 0.02).astype(np.float32)
        w.write_tensor_data(data)
        done += data.nbytes
        if name.endswith("down_exps.weight"):
            print(f"  {name}: {done / 2**30:.1f} GiB written, {time.time() - t0:.0f} s", file=sys.stderr)
    w.close()
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.time() - t0:.0f} s", file=sys.stderr)


# ---- measurement (each run in its own process) ----

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
import torch
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import build_engine
from turbospec.sampling import SamplingParams
torch.set_num_threads({threads})
spec = SpecConfig.parse("draft-mtp", n_max=3) if {mtp} else SpecConfig()
eng = build_engine(EngineConfig(model={file!r}, dtype="bfloat16", ctx={ctx}, moe_cache_mem={budget}, spec=spec))
load_s = time.perf_counter() - t0
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
out = {{"load_s": load_s, "rss_after_load": hwm(), "runs": []}}
import random
for depth in {depths}:
    p = SamplingParams(temperature=0, max_tokens={gen}, ignore_eos=True)
    for rep in range({reps} if depth == 0 else {depth_reps}):
        rnd = random.Random(1000 * rep + depth)  # a prompt per repetition: other tokens, other experts
        prompt = [rnd.randrange(3, 240000) for _ in range(depth + {prompt})]
        eng.cached_tokens = []  # no prefix reuse between repetitions
        eng.generate([prompt], p)
        st = eng.last_stats
        out["runs"].append({{"depth": depth, "rep": rep, "decode_tps": st.decode_tps, "prefill_tps": st.prefill_tps,
                            "gen": st.gen_tokens,
                            "experts": st.experts.to_dict() if st.experts else None,
                            "acceptance": st.spec.acceptance_rate if st.spec else None}})
        print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
out["peak_rss"] = hwm()
print("RESULT " + json.dumps(out))
"""


def run_turbospec(file: Path, budget_gib: float | None, mtp: bool, depths: list[int], gen: int, prompt: int,
                  reps: int, depth_reps: int, threads: int, timeout: int) -> dict:
    budget = None if budget_gib is None else int(budget_gib * 1024)
    code = CHILD.format(threads=threads, mtp=mtp, file=str(file), ctx=max(depths) + prompt + gen + 64, budget=budget,
                        depths=depths, prompt=prompt, gen=gen, reps=reps, depth_reps=depth_reps)
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout} s", "stderr": (e.stderr or b"")[-2000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else str(e.stderr)[-2000:]}
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        return {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}
    out = json.loads(line[7:])
    out["wall_s"] = time.time() - t
    return out


def run_llama_bench(bench: Path, file: Path, depths: list[int], gen: int, reps: int, threads: int, timeout: int,
                    extra: list[str] | None = None) -> dict:
    """llama-bench decode (tg) at each depth (`-d`), in its own process under /usr/bin/time (peak RSS)."""
    cmd = [str(bench), "-m", str(file), "-p", "0", "-n", str(gen), "-r", str(reps), "-t", str(threads), "-o", "json",
           "-d", ",".join(map(str, depths))] + (extra or [])
    t = time.time()
    try:
        p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "cmd": " ".join(cmd)}
    if p.returncode:
        return {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:], "cmd": " ".join(cmd)}
    rss = next((int(x.split()[-1]) * 1024 for x in p.stderr.splitlines() if "Maximum resident set size" in x), None)
    rows = json.loads(p.stdout)
    return {"cmd": " ".join(cmd), "wall_s": time.time() - t, "peak_rss": rss,
            "runs": [{"depth": r.get("n_depth", 0), "decode_tps": r["avg_ts"], "sd": r.get("stddev_ts"),
                      "samples": r.get("samples_ts")} for r in rows]}


def llama_load_time(bench: Path, file: Path, threads: int) -> float:
    """Wall time of `llama-bench -p 0 -n 1 -r 1`: loading plus a warm-up and one token (llama-bench does not report
    its load time apart)."""
    t = time.time()
    subprocess.run([str(bench), "-m", str(file), "-p", "0", "-n", "1", "-r", "1", "-t", str(threads)],
                   capture_output=True, text=True, timeout=1800)
    return time.time() - t


def run_llama_server(server_bin: Path, file: Path, mtp: bool, gen: int, prompt: int, reps: int, threads: int,
                     depths: list[int] | None = None, depth_reps: int = 1) -> dict:
    """llama-server on the file (plain, or `--spec-type draft-mtp --spec-draft-n-max 3`): one non-streamed greedy
    completion per repetition with the prompts turbospec's runs use (at each depth: that many random tokens before
    the prompt, as turbospec's runs); its own timings (decode t/s, drafts)."""
    import random

    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_speed import free_port, server

    depths = depths or [0]
    port = free_port()
    cmd = [str(server_bin), "-m", str(file), "--port", str(port), "-c", str(max(1024, max(depths) + prompt + gen + 64)),
           "-np", "1", "-t", str(threads), "--no-webui"] + (["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
                                                            if mtp else [])
    runs = []
    t = time.time()
    with server(cmd, port) as url:
        load_s = time.time() - t
        for depth in depths:
            for rep in range(reps if depth == 0 else depth_reps):
                rnd = random.Random(1000 * rep + depth)
                ids = [rnd.randrange(3, 240000) for _ in range(depth + prompt)]
                r = httpx.post(url + "/completion", timeout=7200, json={
                    "prompt": ids, "n_predict": gen, "temperature": 0, "ignore_eos": True, "cache_prompt": False}).json()
                tm = r.get("timings", {})
                runs.append({"depth": depth, "rep": rep, "decode_tps": tm.get("predicted_per_second"),
                             "prefill_tps": tm.get("prompt_per_second"), "drafts": tm.get("draft_n"),
                             "accepted": tm.get("draft_n_accepted")})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return {"cmd": " ".join(cmd), "load_s": load_s, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("make", "run"))
    ap.add_argument("--file", type=Path, default=Path("/tmp/moe35/q4k.gguf"))
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--depth", type=int, default=0, help="also measure at this depth (0: depth 0 only)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--configs", default="all,budget8,budget16,mtp,llama",
                    help="comma list of: all (every expert), budget8, budget16, mtp, mtp_budget8, llama (llama-bench), "
                         "llama_server, llama_server_mtp")
    ap.add_argument("--depth-reps", type=int, default=1, help="repetitions at --depth (default 1)")
    ap.add_argument("--depth-configs", default="all,llama", help="the configurations also run at --depth")
    ap.add_argument("--llama-bench", type=Path, default=None)
    ap.add_argument("--llama-server", type=Path, default=None, help="for the llama_server / llama_server_mtp rows")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "moe_real_size.json")
    a = ap.parse_args()
    if a.what == "make":
        make(a.file, a.layers)
        return
    deep = set(a.depth_configs.split(","))
    report: dict = {"file": str(a.file), "file_bytes": a.file.stat().st_size, "shape": {**SHAPE, "layers": a.layers},
                    "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
                    "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                    "results": {}}
    plan = {"all": (None, False), "budget8": (8, False), "budget16": (16, False), "mtp": (None, True),
            "mtp_budget8": (8, True)}
    for name in a.configs.split(","):
        print(f"== {name}", file=sys.stderr, flush=True)
        depths = [0] + ([a.depth] if a.depth and name in deep else [])
        if name in ("llama_server", "llama_server_mtp"):
            if a.llama_server is None:
                continue
            res = run_llama_server(a.llama_server, a.file, name.endswith("mtp"), a.gen, a.prompt, a.reps, a.threads,
                                   depths, a.depth_reps)
        elif name == "llama":
            if a.llama_bench is None:
                continue
            res = run_llama_bench(a.llama_bench, a.file, [0], a.gen, a.reps, a.threads, a.timeout)
            res["load_s"] = llama_load_time(a.llama_bench, a.file, a.threads)
            if len(depths) > 1:
                deep_res = run_llama_bench(a.llama_bench, a.file, depths[1:], a.gen, a.depth_reps, a.threads,
                                           a.timeout)
                res["runs"] = res.get("runs", []) + deep_res.get("runs", [])
                res["deep"] = {k: v for k, v in deep_res.items() if k != "runs"}
            # (llama-bench's -d fills the context first, as turbospec's runs do with a depth + prompt)
        else:
            budget, mtp = plan[name]
            res = run_turbospec(a.file, budget, mtp, depths, a.gen, a.prompt, a.reps, a.depth_reps, a.threads,
                                a.timeout)
        report["results"][name] = res
        summary = {d: statistics.median([r["decode_tps"] for r in res.get("runs", []) if r["depth"] == d] or [0])
                   for d in depths}
        print(f"   {name}: decode t/s by depth {summary}, load {res.get('load_s')}, peak RSS "
              f"{(res.get('peak_rss') or 0) / 2**30:.2f} GiB, error {res.get('error')}", file=sys.stderr, flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
