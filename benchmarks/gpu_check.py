"""The GPU check's measurements (issue #28 item 3; benchmarks/gpu_check.sh runs the GPU tests first, then this).

A Qwen3.6-27B-shaped hybrid with random bf16 weights (or `--weights q4_k` etc.: random packed blocks, multiplied by the
Triton dequantizing product; `turbospec fit`'s preset: 64 layers, 16 gated attention +
48 Gated DeltaNet, hidden 5120, 24/4 heads of 256, vocabulary 248,320, one MTP layer; `--layers` fewer when memory
is short), built on the device from the bundled hybrid's tensor names (turbospec.model.placement.RandomSource: no
54 GB file). Measured through the engine (`Engine.generate`, greedy):

* decode t/s at context depth D (4K / 32K / 262K) for each KV format (f16 and tbq4_0), plain and with MTP drafts
  (draft-mtp, 3 per step): the attention layers' KV is filled with random values for the first D positions (a
  262K-token prefill is not what this measures), the engine resumes there (prefix reuse) and decodes `--gen`
  tokens; random weights: MTP drafts are rarely accepted, so the MTP rows show the cost of drafting and verifying,
  not a speed-up (their acceptance is reported);
* prefill t/s of a `--prompt`-token prompt from an empty cache, MTP off and on;
* memory: weights, the KV at each depth, the device's peak; the device's copy bandwidth (a 4 GiB copy) and the
  decode bound it sets (bytes one token reads: weights + KV at that depth).

    python benchmarks/gpu_check.py [--device cuda] [--layers 64] [--depths 4096,32768,262144] [--kv f16,tbq4_0]
        [--drafters draft-mtp[,suffix,...]] [--weights auto|q8_0|q4_0|q4_k] [--preset 27b|35b-a3b]
        [--streams 1,8,32] [--gen 32] [--prompt 4096] [--profile 4096:f16:mtp]
        [--out gpu_check.json] [--md gpu_check.md]
    python benchmarks/gpu_check.py --device cpu --tiny     # the script's own check on a small shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turbospec import device, env  # noqa: E402
from turbospec.config import EngineConfig, SpecConfig  # noqa: E402
from turbospec.engine import Engine  # noqa: E402
from turbospec.kv.fill import fill_random  # noqa: E402
from turbospec.lab.fit.arch import PRESETS  # noqa: E402
from turbospec.model.config import ModelConfig  # noqa: E402
from turbospec.model.loader import WeightSource  # noqa: E402
from turbospec.model.placement import RandomSource, layer_names  # noqa: E402
from turbospec.model.registry import build_model  # noqa: E402
from turbospec.sampling import SamplingParams  # noqa: E402
from turbospec.speculative import make_drafter  # noqa: E402
from turbospec.weights import PACKED, WEIGHT_CHOICES  # noqa: E402

TEMPLATE = ROOT / "models" / "turbospec-tiny-hybrid"
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "vocab_size": 4096}


# Qwen3.5/3.6-35B-A3B as benchmarks/moe_real_size.py reads the released configs (40 layers, 256 experts of 512,
# 8 routed + a shared expert per token)
MOE_35B = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
           "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "mtp_num_hidden_layers": 1}
TINY_MOE = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64}
PRESET_NAMES = {"27b": "Qwen3.6-27B-shaped hybrid", "35b-a3b": "Qwen3.6-35B-A3B-shaped MoE hybrid"}


def config(layers: int, tiny: bool, max_pos: int, preset: str = "27b") -> ModelConfig:
    if preset == "35b-a3b":
        d = {**MOE_35B, **(TINY_MOE if tiny else {})}
    else:
        d = {k: v for k, v in PRESETS["qwen3.6-27b"].items() if not k.startswith("_")}
        d.update(TINY if tiny else {})
    d.update(num_hidden_layers=layers, max_position_embeddings=max_pos,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    return ModelConfig.from_dict(d)


def moe_names(names: list[str], cfg: ModelConfig) -> list[str]:
    """`names` with every MLP (`*.mlp.{gate,up,down}_proj.weight`, the MTP layer's too) replaced by a MoE's tensors:
    router, one tensor per expert matrix, the shared expert and its gate."""
    m = cfg.moe()
    out: list[str] = []
    for n in names:
        prefix, dot, tail = n.rpartition(".mlp.")
        if not dot:
            out.append(n)
        elif tail == "gate_proj.weight":
            p = f"{prefix}.mlp"
            out += [f"{p}.gate.weight", f"{p}.shared_expert_gate.weight"]
            out += [f"{p}.experts.{e}.{x}_proj.weight" for e in range(m["experts"]) for x in ("gate", "up", "down")]
            out += [f"{p}.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
    return out


def random_model(cfg: ModelConfig, dtype: torch.dtype, weights: str = "auto"):
    """`weights`: auto (float matrices in `dtype`) or a packed format (random blocks, as `--weights` would give)."""
    tmpl = json.loads((TEMPLATE / "config.json").read_text())
    names = [n for n in WeightSource(TEMPLATE).names() if not n.startswith("medusa")]
    names = layer_names(names, cfg, tmpl["layer_types"])
    if cfg.moe()["experts"]:
        names = moe_names(names, cfg)
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    shapes = {n: (1, cfg.hidden_size) for n in names if n.endswith("shared_expert_gate.weight")}
    src = RandomSource(names, seed=0, shapes=shapes)
    src.pack = PACKED.get(weights)
    return build_model(cfg, src, dtype)


def sync() -> None:
    device.synchronize()


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy of 4 GiB (bytes read + written), the best of 10."""
    if not device.on_gpu():
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.float32)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        sync()
        t = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * 4 * (1 << 30) / best / 1e9


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def decode_run(model, depth: int, kv: str, drafter_type: str, gen: int, reps: int) -> dict:
    """Decode `gen` tokens after `depth` random-filled positions; `drafter_type` "" for plain decoding."""
    new = 16
    sc = SpecConfig.parse(drafter_type, n_max=3)
    ctx = depth + new + 2 * gen + 64
    drafter = make_drafter(sc, model, ctx + sc.depth + 1) if drafter_type else None
    eng = Engine(model, None, EngineConfig(ctx=ctx, ubatch=2048, cache_type_k=kv, cache_type_v=kv, spec=sc),
                 drafter=drafter)
    cache = eng.cache
    fill_random(cache, depth)
    sync()
    g = torch.Generator().manual_seed(depth)
    context = torch.randint(3, model.cfg.vocab_size, (depth + new,), generator=g, device="cpu").tolist()
    eng.cached_tokens = context[:depth]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    eng.generate([context], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    tps, steps = [], []
    for _ in range(reps):
        sync()
        out = eng.generate([context], params)[0]
        st = out["stats"]
        assert st.cached_tokens >= depth, (st.cached_tokens, depth)
        tps.append(st.decode_tps)
        if st.spec is not None:
            steps.append(st.spec.to_dict())
    kv_bytes = cache.kv.nbytes if hasattr(cache, "kv") else cache.nbytes
    row = {"depth": depth, "kv": kv, "drafter": drafter_type, "mtp": drafter_type == "draft-mtp",
           "decode_tps": statistics.median(tps), "decode_tps_runs": tps, "kv_gib_allocated": gib(kv_bytes),
           "kv_gib_at_depth": gib(kv_bytes * depth / ctx)}
    if steps:
        row["spec"] = steps[-1]
    del eng, cache, drafter
    return row


def prefill_run(model, kv: str, mtp: bool, n: int, reps: int) -> dict:
    sc = SpecConfig.parse("draft-mtp" if mtp else "", n_max=3)
    ctx = n + 16
    drafter = make_drafter(sc, model, ctx + sc.depth + 1) if mtp else None
    eng = Engine(model, None, EngineConfig(ctx=ctx, ubatch=2048, cache_type_k=kv, cache_type_v=kv, spec=sc,
                                           prefix_cache=False), drafter=drafter)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.generate([torch.randint(3, model.cfg.vocab_size, (min(n, 512),), generator=g, device="cpu").tolist()], params)  # warm-up
    tps = []
    for _ in range(reps):
        prompt = torch.randint(3, model.cfg.vocab_size, (n,), generator=g, device="cpu").tolist()
        sync()
        eng.generate([prompt], params)
        tps.append(eng.last_stats.prefill_tps)
    del eng, drafter
    return {"prompt": n, "kv": kv, "mtp": mtp, "prefill_tps": statistics.median(tps), "prefill_tps_runs": tps}


def streams_run(model, kv: str, streams: int, gen: int, prompt: int = 128) -> dict:
    """Continuous batching (`serve -np`'s scheduler): `streams` sequences of `prompt` random tokens decode `gen`
    tokens each together; aggregate decode t/s once every prompt is in (prefill not timed)."""
    eng = Engine(model, None, EngineConfig(ctx=streams * (prompt + gen + 64), ubatch=2048, cache_type_k=kv,
                                           cache_type_v=kv))
    g = torch.Generator().manual_seed(streams)
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    sch = eng.new_scheduler(streams)
    for _ in range(streams):
        sch.add(torch.randint(3, model.cfg.vocab_size, (prompt,), generator=g, device="cpu").tolist(), params)
    while sch.waiting or any(q.todo > 1 for q in sch.running):
        sch.step()
    sync()
    t, tokens = time.perf_counter(), 0
    while sch.has_work:
        tokens += sum(len(o.chunk.tokens) for o in sch.step() if o.chunk)
    sync()
    secs = time.perf_counter() - t
    del sch, eng
    return {"streams": streams, "kv": kv, "gen": gen, "aggregate_tps": tokens / secs, "per_stream_tps": tokens / secs /
            streams}


def profile_run(model, depth: int, kv: str, mtp: bool = False, steps: int = 4) -> None:
    """torch.profiler over `steps` decode steps at `depth` (plain, or with MTP drafts): the top operators by device
    time and by host time (where a step's time goes: kernels, or launching them)."""
    from torch.profiler import ProfilerActivity, profile

    sc = SpecConfig.parse("draft-mtp" if mtp else "", n_max=3)
    drafter = make_drafter(sc, model, depth + 64 + sc.depth + 1) if mtp else None
    eng = Engine(model, None, EngineConfig(ctx=depth + 64, ubatch=2048, cache_type_k=kv, cache_type_v=kv, spec=sc),
                 drafter=drafter)
    fill_random(eng.cache, depth)
    sync()
    context = torch.randint(3, model.cfg.vocab_size, (depth + 4,), device="cpu").tolist()
    eng.cached_tokens = context[:depth]
    eng.generate([context], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.on_gpu() else [])
    with profile(activities=acts) as prof:
        eng.generate([context], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    print(f"profile: depth {depth}, KV {kv}, MTP {mtp}, {steps} tokens (decode t/s {eng.last_stats.decode_tps:.1f})")
    ka = prof.key_averages()
    if device.on_gpu():
        print(ka.table(sort_by="self_cuda_time_total", row_limit=25))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25))


def guarded(results: list, fn, *args) -> None:
    """Run one measurement; a failure is recorded (and printed) and the check goes on."""
    t = time.perf_counter()
    try:
        row = fn(*args)
    except Exception as e:  # noqa: BLE001 -- one failed cell must not lose the others
        traceback.print_exc()
        row = {"args": [str(a) for a in args[1:]], "error": f"{type(e).__name__}: {e}"[:500]}
    row["seconds"] = round(time.perf_counter() - t, 1)
    if device.on_gpu():
        row["peak_gib"] = gib(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    results.append(row)


def drafter_of(row: dict) -> str:
    """A decode row's drafter ("-" for plain decoding; rows of older runs have only `mtp`)."""
    return row.get("drafter", "draft-mtp" if row.get("mtp") else "") or "-"


def markdown(report: dict) -> str:
    w = report["weights_gib"]
    bw = report["copy_gbps"]
    lines = [f"# GPU check: {report['gpu']}", "",
             f"Model: {report['model']}; weights {w} GiB ({report['dtype']}), load {report['load_s']} s. "
             f"Device copy bandwidth {bw:.0f} GB/s.", "",
             "| depth | KV | drafter | decode t/s | bound t/s | accepted/step | KV GiB | peak GiB |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in report["decode"]:
        if "error" in r:
            lines.append(f"| {' / '.join(r['args'])} | error: {r['error'][:80]} | | | | | | |")
            continue
        bound = bw * 1e9 / (report["weights_bytes"] + r["kv_gib_at_depth"] * 2**30)
        spec = r.get("spec") or {}
        acc = spec.get("mean_acceptance_length", "")
        lines.append(f"| {r['depth']} | {r['kv']} | {drafter_of(r)} | {r['decode_tps']:.1f} | "
                     f"{bound:.0f} | {acc if acc == '' else f'{acc:.2f}'} | {r['kv_gib_at_depth']} | "
                     f"{r.get('peak_gib', '')} |")
    lines += ["", "| prompt | KV | MTP | prefill t/s |", "|---:|---|---|---:|"]
    for r in report["prefill"]:
        if "error" in r:
            lines.append(f"| {' / '.join(r['args'])} | error: {r['error'][:80]} | | |")
        else:
            lines.append(f"| {r['prompt']} | {r['kv']} | {'on' if r['mtp'] else 'off'} | {r['prefill_tps']:.0f} |")
    if report.get("streams"):
        lines += ["", "| streams | KV | aggregate decode t/s | per stream |", "|---:|---|---:|---:|"]
        for r in report["streams"]:
            lines.append(f"| {' / '.join(r['args'])} | error: {r['error'][:80]} | | |" if "error" in r else
                         f"| {r['streams']} | {r['kv']} | {r['aggregate_tps']:.1f} | {r['per_stream_tps']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's (64 for 27b, 40 for 35b-a3b)")
    ap.add_argument("--depths", default="4096,32768,262144")
    ap.add_argument("--kv", default="f16,tbq4_0")
    ap.add_argument("--drafters", default="draft-mtp",
                    help="drafters measured beside plain decoding (comma list of --spec-type names; random weights: "
                         "n-gram and suffix drafts hit where greedy decoding repeats itself, MTP drafts do not)")
    ap.add_argument("--preset", default="27b", choices=list(PRESET_NAMES),
                    help="27b: the dense-MLP hybrid (64 layers); 35b-a3b: the MoE hybrid (40 layers)")
    ap.add_argument("--streams", default="", help="N[,N...]: continuous batching of N sequences at once (aggregate "
                    "decode t/s through the scheduler, each KV format)")
    ap.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                    help="auto: bf16 matrices; q8_0 / q4_0 / q4_k: random packed blocks (Triton's dequantizing product)")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--tiny", action="store_true", help="a small shape (the script's own check on a CPU)")
    ap.add_argument("--profile", default="", help="DEPTH:KV[:mtp][,...]: after the measurements, profile decode there (plain, or with MTP)")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--md", default="gpu_check.md")
    a = ap.parse_args()
    dev = device.use(a.device)
    depths = [int(x) for x in a.depths.split(",") if x]  # none: only the prefill rows (and any profiles)
    kvs = [x for x in a.kv.split(",") if x]
    layers = a.layers or (40 if a.preset == "35b-a3b" else 64)
    cfg = config(layers, a.tiny, max(depths, default=0) + a.prompt + 4096, a.preset)
    t = time.perf_counter()
    model = random_model(cfg, torch.bfloat16, a.weights)
    sync()
    load_s = time.perf_counter() - t
    report = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "model": f"{PRESET_NAMES[a.preset]}, random weights, {cfg.num_layers} layers" + (" (tiny)" if a.tiny else ""),
              "dtype": "bfloat16" if a.weights == "auto" else f"{a.weights} blocks, bfloat16 activations",
              "weights_bytes": model.weight_bytes, "weights_gib": gib(model.weight_bytes),
              "load_s": round(load_s, 1), "copy_gbps": copy_bandwidth(), "gen": a.gen, "reps": a.reps,
              "switches": env.all_set(),
              "decode": [], "prefill": [], "streams": []}
    print(json.dumps({k: v for k, v in report.items() if k not in ("decode", "prefill", "streams")}), flush=True)
    for depth in depths:
        for kv in kvs:
            for drafter_type in ["", *filter(None, a.drafters.split(","))]:
                guarded(report["decode"], decode_run, model, depth, kv, drafter_type, a.gen, a.reps)
                Path(a.out).write_text(json.dumps(report, indent=1))
    for kv in kvs:
        for mtp in (False, True):
            guarded(report["prefill"], prefill_run, model, kv, mtp, a.prompt, a.reps)
            Path(a.out).write_text(json.dumps(report, indent=1))
    for kv in kvs:
        for n in (int(x) for x in a.streams.split(",") if x):
            guarded(report["streams"], streams_run, model, kv, n, a.gen)
            Path(a.out).write_text(json.dumps(report, indent=1))
    Path(a.out).write_text(json.dumps(report, indent=1))
    Path(a.md).write_text(markdown(report))
    print(markdown(report))
    for item in filter(None, a.profile.split(",")):
        d, kv, *mtp = item.split(":")
        try:
            profile_run(model, int(d), kv, mtp == ["mtp"])
        except Exception:  # noqa: BLE001 -- a profile is a diagnostic: the report is written already
            traceback.print_exc()


if __name__ == "__main__":
    main()
