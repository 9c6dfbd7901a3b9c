"""Where a decode step's time goes (the instrumented numbers quoted in docs/speed.md and docs/speculative.md).

    python benchmarks/step_profile.py dense --dtype float32     # benchmark-shape dense model: linear share
    python benchmarks/step_profile.py spec                      # bundled model, MTP n_max 3: verify / draft split (--model: a GGUF)
    python benchmarks/step_profile.py cold                      # a 8192x256 matrix-vector product, hot vs cold
    python benchmarks/step_profile.py store                     # QuantKVCache.store: C++ encoder vs torch encoders
    python benchmarks/step_profile.py chain --dtype float16     # all products back to back (TURBOSPEC_NO_HUGEPAGES=1: 4 KB pages)
    python benchmarks/step_profile.py chain --model models/turbospec-tiny-hybrid --rows 4   # a verification step's products
    python benchmarks/step_profile.py dtypes                    # bf16 / f16 / fp32 decoding interleaved
    python benchmarks/step_profile.py kvpages                   # KV cache in 2 MB vs 4 KB pages at 32K, interleaved
    python benchmarks/step_profile.py kvtypes --dtype float16 --depth 512   # KV types vs f16 in one process
    python benchmarks/step_profile.py bf16held                  # bundled model: float32 matrices vs held in bf16
    python benchmarks/step_profile.py attention --dtype bfloat16 # the one-call layer's attention (fixed cost at 16)
    python benchmarks/step_profile.py prefill_rows              # prefill: every row vs the last row in the last layer
    python benchmarks/step_profile.py verify_tokens --depths 0 6144 16384   # a verification over 1-4 tokens at depth
    python benchmarks/step_profile.py gemm                      # prefill GEMM rates: bf16, oneDNN / MKL float32, float16
    perf record -F 1000 -- python benchmarks/step_profile.py loop --dtype bfloat16   # decode steps only, for perf

`dense`: median step time of single-token decoding (512-token context) and, in a second pass with every `Linear`
call timed, the share spent in the matrix products (with the fused decode layer only the lm_head is a `Linear`
call; `TURBOSPEC_NO_FUSED=1` gives the op-by-op split). `spec`: one greedy 128-token generation of the `code` prompt
with MTP n_max 3, per speculative step: verification, drafting, the MTP forwards and the draft-head products.
`cold`: the same product in a tight loop and after 2 ms of sleep (weights and clocks cold). `store`: median time
of storing one decode step's K and V (2 KV heads x 64) into one layer of a packed cache, per format, with the C++
encoder and with the torch reference encoders (TURBOSPEC_NO_ENCODE_KERNEL=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from turbospec.config import EngineConfig
from turbospec.kv.plan import AttentionPlan
from turbospec.layers import linear
from turbospec.model import load_model


def _median_ms(fn, n: int, pause: float = 0.0) -> float:
    ts = []
    for _ in range(n):
        if pause:
            time.sleep(pause)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def dense(dtype: str) -> None:
    from turbospec.demo import make_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        m = load_model(make_demo_model(Path(tmp) / "b"), dtype)
    cache = m.new_cache(1024)
    m.forward(torch.randint(0, 32000, (512,)), AttentionPlan.causal(0, 512), cache)
    cache.commit()

    def step():
        h = m.forward(torch.tensor([5]), AttentionPlan.causal(cache.length, 1), cache)
        m.logits(h)
        cache.commit()

    for _ in range(5):
        step()
    plain = _median_ms(step, 30)
    spent = [0.0]
    orig = linear.Linear.__call__

    def timed(self, x):
        t = time.perf_counter()
        out = orig(self, x)
        spent[0] += time.perf_counter() - t
        return out

    linear.Linear.__call__ = timed
    rows = []
    for _ in range(30):
        spent[0] = 0.0
        t = time.perf_counter()
        step()
        rows.append((time.perf_counter() - t, spent[0]))
    linear.Linear.__call__ = orig
    rows.sort()
    total, lin = rows[len(rows) // 2]
    print(f"{dtype}: decode step {plain:.2f} ms; timed pass {total * 1e3:.2f} ms, of which Linear {lin * 1e3:.2f} ms "
          f"({lin / total:.0%})")


def spec(path: str | None, dtype: str) -> None:
    from turbospec.config import SpecConfig
    from turbospec.engine import Engine
    from turbospec.model.gguf import GGUFFile, is_gguf
    from turbospec.sampling import SamplingParams
    from turbospec.speculative import make_drafter
    from turbospec.tokenizer import Tokenizer

    path = path or "models/turbospec-tiny-hybrid"
    model = load_model(path, dtype)
    tok = Tokenizer.from_gguf(GGUFFile(path).meta) if is_gguf(path) else Tokenizer(path)
    prompt = json.loads(Path("turbospec/data/prompts.json").read_text())["prompts"]["code"]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    plain = Engine(model, tok, EngineConfig(ctx=4096))
    list(plain.stream(prompt, params))
    sc = SpecConfig(types=("draft-mtp",), n_max=3)
    d = make_drafter(sc, model, 4096, path)
    eng = Engine(model, tok, EngineConfig(ctx=4096, spec=sc), drafter=d)
    list(eng.stream(prompt, params))  # warm-up
    acc: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)

    def wrap(obj, name, key=None):
        f = getattr(obj, name)

        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            acc[key or name] += time.perf_counter() - t
            cnt[key or name] += 1
            return r

        setattr(obj, name, g)

    wrap(eng, "verify_step")
    wrap(d, "propose")
    wrap(d.mtp, "forward", "mtp_forward")
    wrap(d, "head", "draft_head")
    list(eng.stream(prompt, params))
    steps = cnt["verify_step"]
    list(plain.stream(prompt, params))
    print(f"plain step {1e3 / plain.last_stats.decode_tps:.2f} ms; speculative: {steps} steps, "
          f"{eng.last_stats.gen_tokens / max(steps, 1):.2f} tokens per step")
    for k in ("verify_step", "propose", "mtp_forward", "draft_head"):
        print(f"  {k:12s} {acc[k] * 1e3 / max(steps, 1):6.2f} ms per step ({cnt[k]} calls, "
              f"{acc[k] * 1e3 / max(cnt[k], 1):.3f} ms each)")


def cold() -> None:
    w = torch.randn(8192, 256)
    x = torch.randn(1, 256)
    for dt in (torch.float32, torch.bfloat16):
        product = linear.Linear(w.to(dt))
        hot = _median_ms(lambda p=product: p(x), 300)
        slept = _median_ms(lambda p=product: p(x), 50, pause=0.002)
        print(f"8192x256 {str(dt)[6:]}: {hot * 1e3:.0f} us in a tight loop, {slept * 1e3:.0f} us after 2 ms of sleep")


def store() -> None:
    import os

    from turbospec.kv.quant_cache import QuantKVCache

    k, v = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    for kind in ("f16", "q8_0", "q4_0", "tbq4_0", "turbo3", "turbo4"):
        times = []
        for off in ("", "1"):
            os.environ["TURBOSPEC_NO_ENCODE_KERNEL"] = off
            cache = QuantKVCache(1, 2, 64, 8, kind, kind)
            times.append(_median_ms(lambda c=cache: c.store(0, k, v), 200) * 1e3)
        os.environ.pop("TURBOSPEC_NO_ENCODE_KERNEL")
        print(f"{kind:7s} store: {times[0]:6.0f} us with the C++ encoder, {times[1]:6.0f} us with the torch encoders")


def _bench_model(dtype: str):
    from turbospec.demo import make_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        return load_model(make_demo_model(Path(tmp) / "b"), dtype)


def chain(dtype: str, rows: int = 1, model: str | None = None) -> None:
    """All products of a model back to back (weights cold, as in a decode step), median of 30: the benchmark
    model's 33, or with --model a checkpoint's (e.g. the bundled hybrid). --rows 4: a verification step's shape."""
    m = _bench_model(dtype) if model is None else load_model(model, dtype)
    lins = []
    for layer in m.layers:
        mix = getattr(layer, "attn", None) or layer.mixer
        lins += [mix.qkv, mix.o] if hasattr(mix, "qkv") else [mix.proj, mix.out]
        lins += [layer.mlp.gate_up, layer.mlp.down]
    lins.append(m.lm_head)
    xs = {lin.in_features: torch.randn(rows, lin.in_features, dtype=m.dtype) for lin in lins}

    def run():
        for lin in lins:
            lin(xs[lin.in_features])

    for _ in range(5):
        run()
    ms = _median_ms(run, 30)
    nbytes = sum(lin.nbytes for lin in lins)
    print(f"{dtype}, {rows} row(s): chain of {len(lins)} products {ms:.2f} ms, {nbytes / ms / 1e6:.1f} GB/s "
          f"({nbytes / 1e6:.0f} MB)")


def _generations(engines: dict, prompt, n: int = 6) -> dict:
    """Median decode t/s per engine, generations interleaved round-robin (first round discarded)."""
    from turbospec.sampling import SamplingParams

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    res: dict = {k: [] for k in engines}
    for i in range(n):
        for k, e in engines.items():
            list(e.stream(prompt, params))
            if i:
                res[k].append(e.last_stats.decode_tps)
    return {k: round(statistics.median(v), 1) for k, v in res.items()}


def dtypes() -> None:
    """Benchmark model, 512-token prompt, 128 greedy tokens: bf16 / f16 / fp32 decoding interleaved in one process."""
    from turbospec.demo import make_demo_model
    from turbospec.engine import Engine
    from turbospec.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = make_demo_model(Path(tmp) / "b")
        tok = Tokenizer(path)
        engines = {dt: Engine(load_model(path, dt), tok, EngineConfig(ctx=1024)) for dt in ("bfloat16", "float16", "float32")}
    ids = torch.randint(3, 32000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    print("decode t/s:", _generations(engines, ids))


def kvtypes(dtype: str, depth: int) -> None:
    """Benchmark model, every KV type decoding 64 tokens after `depth` random tokens, in one process (one engine per
    type on one copy of the weights), the types in alternating order, 9 rounds: median ratio of each to f16."""
    from turbospec.engine import Engine
    from turbospec.sampling import SamplingParams

    types = ["f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3"]
    m = _bench_model(dtype)
    prompt = torch.randint(3, m.cfg.vocab_size, (depth + 16,), generator=torch.Generator().manual_seed(1)).tolist()
    engines = {t: Engine(m, None, EngineConfig(ctx=depth + 200, cache_type_k=t, cache_type_v=t)) for t in types}
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        list(e.stream(prompt, params))
    tps: dict = {t: [] for t in types}
    for i in range(9):
        for t in types if i % 2 == 0 else types[::-1]:
            list(engines[t].stream(prompt, params))
            tps[t].append(engines[t].last_stats.decode_tps)
    for t in types:
        ratios = [x / f for x, f in zip(tps[t], tps["f16"])]
        print(f"{t:7s} {statistics.median(tps[t]):6.1f} t/s, {statistics.median(ratios):.2f}x f16 "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


def kvpages() -> None:
    """Benchmark model (float32), decode steps at 32K depth with the KV cache in huge pages vs torch.zeros,
    interleaved; weights in huge pages in both."""
    import kv_speed

    from turbospec.kv import cache as kv_cache

    m = _bench_model("float32")
    caches, orig = {}, kv_cache.zeros
    for kind in ("dense", "f16", "q4_0"):
        caches[(kind, "2 MB pages")] = kv_speed.make_cache(m, kind, 32768, 12, 1024)
        kv_cache.zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
        caches[(kind, "4 KB pages")] = kv_speed.make_cache(m, kind, 32768, 12, 1024)
        kv_cache.zeros = orig
    times: dict = {k: [] for k in caches}
    for i in range(10):
        for key, c in caches.items():
            t = time.perf_counter()
            m.logits(m.forward(torch.tensor([5]), AttentionPlan.causal(c.length, 1), c))
            c.commit()
            if i:
                times[key].append(time.perf_counter() - t)
    for key, ts in times.items():
        print(f"{key[0]:6s} cache in {key[1]}: {1 / statistics.median(ts):.1f} t/s")


def bf16held() -> None:
    """Bundled model in float32, plain greedy decoding of the code prompt: matrices as loaded vs held in bf16 where
    that is exact (`exact_bf16`), interleaved; also checks the tokens are identical."""
    from turbospec.engine import Engine
    from turbospec.layers.linear import Linear, exact_bf16
    from turbospec.tokenizer import Tokenizer

    path = "models/turbospec-tiny-hybrid"
    tok = Tokenizer(path)
    a, b = load_model(path, "float32"), load_model(path, "float32")
    for layer in b.layers:
        for obj in (layer.mixer, layer.mlp):
            for k, v in list(vars(obj).items()):
                if isinstance(v, Linear):
                    setattr(obj, k, exact_bf16(v))
    b.lm_head = exact_bf16(b.lm_head)
    prompt = json.loads(Path("turbospec/data/prompts.json").read_text())["prompts"]["code"]
    engines = {"as loaded (float32)": Engine(a, tok, EngineConfig(ctx=2048)), "held in bf16": Engine(b, tok, EngineConfig(ctx=2048))}
    print("decode t/s:", _generations(engines, prompt))
    from turbospec.sampling import SamplingParams

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    same = [c.tokens for c in engines["as loaded (float32)"].stream(prompt, params)] == \
        [c.tokens for c in engines["held in bf16"].stream(prompt, params)]
    print("identical tokens:", same)


def attention(dtype: str) -> None:
    """A decode step's attention inside the one-call layer (benchmark model, layer 0, hot loop): layer_decode minus
    attn_in and out_mlp, at 16 / 512 / 2048 cached positions; at 16 it is the call's fixed cost."""
    import math

    from turbospec.kernels.gemv import load_kernel

    k = load_kernel()
    m = _bench_model(dtype)
    layer, x = m.layers[0], torch.randn(1, m.cfg.hidden_size).to(m.dtype)
    at, mlp = layer.attn, layer.mlp
    a_row = torch.randn(1, at.nh * at.hd).to(m.dtype)
    w = (at.o.weight, at.o.bias, layer.post_norm, mlp.gate_up.weight, mlp.gate_up.bias, mlp.down.weight,
         mlp.down.bias)

    def measure(ctx: int) -> tuple[float, float, float]:
        cache = m.new_cache(ctx + 8)
        m.forward(torch.randint(0, m.cfg.vocab_size, (ctx,)), AttentionPlan.causal(0, ctx), cache)
        cache.commit()
        cos, sin = m.rope.tables(torch.tensor([ctx]))
        cache.begin(1)
        full = _median_ms(lambda: k.layer_decode(
            x, layer.in_norm, layer.eps, layer.zc, at.qkv.matrices, at.qkv.bias, at.q_norm, at.k_norm, cos, sin, at.nh,
            at.nkv, at.hd, at.gated, cache.k[0], cache.v[0], ctx, 1 / math.sqrt(at.hd), *w, [], 0), 400)
        pre = _median_ms(lambda: k.attn_in(x, layer.in_norm, layer.eps, layer.zc, at.qkv.matrices, at.qkv.bias,
                                           at.q_norm, at.k_norm, cos, sin, at.nh, at.nkv, at.hd, at.gated), 400)
        post = _median_ms(lambda: k.out_mlp(x, a_row, None, w[0], w[1], w[2], layer.eps, layer.zc, *w[3:]), 400)
        return full, pre, post

    for ctx in (16, 512, 2048):
        full, pre, post = measure(ctx)
        print(f"{dtype} ctx {ctx:5d}: layer {full * 1e3:6.1f} us = attn_in {pre * 1e3:5.1f} + out_mlp "
              f"{post * 1e3:5.1f} + attention {(full - pre - post) * 1e3:5.1f} us")


def loop(dtype: str, steps: int) -> None:
    """`steps` greedy decode steps of the benchmark model at 512-640 cached positions, nothing else: a workload for
    `perf record -F 1000 -- python benchmarks/step_profile.py loop --dtype bfloat16` (setup is a few % of it)."""
    from turbospec.sampling import argmax

    m = _bench_model(dtype)
    cache = m.new_cache(1024)
    m.forward(torch.randint(0, m.cfg.vocab_size, (512,)), AttentionPlan.causal(0, 512), cache)
    cache.commit()
    t = time.perf_counter()
    for _ in range(steps):
        h = m.forward(torch.tensor([5]), AttentionPlan.causal(cache.length, 1), cache)
        argmax(m.logits(h)[0])
        cache.commit()
        if cache.length > 640:
            cache.length = 512
    print(f"{dtype}: {steps / (time.perf_counter() - t):.1f} steps/s")


def prefill_rows(dtype: str) -> None:
    """512-token prefill of the benchmark model with every row through the last layer vs only the row that feeds
    the logits (`forward(..., out_rows=1)`), interleaved, median of 10."""
    m = _bench_model(dtype)
    ids = torch.randint(3, m.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(0))
    cache = m.new_cache(520)
    times: dict = {None: [], 1: []}
    for i in range(12):
        for rows in (None, 1):
            cache.reset()
            t = time.perf_counter()
            m.logits(m.forward(ids, AttentionPlan.causal(0, 512), cache, out_rows=rows)[-1:])
            if i >= 2:
                times[rows].append(time.perf_counter() - t)
    full, last = (512 / statistics.median(times[r]) for r in (None, 1))
    print(f"{dtype} prefill 512: every row {full:.0f} t/s, last row only {last:.0f} t/s ({last / full:.2f}x)")


def verify_tokens(path: str | None, dtype: str, depths: list[int], kv: str | None, out: str | None) -> None:
    """A target step (forward and logits) over 1, 2, 3, 4 tokens after `depth` cached random positions -- a plain
    step and verifications of 1-3 draft tokens -- on the default model (or --model), interleaved, medians of 30: what
    each draft token adds to a step at depth (the attention scores query rows in groups of 4 per KV head)."""
    path = path or "models/turbospec-tiny"
    m = load_model(path, dtype)
    cache_kw = {"k_type": kv, "v_type": kv} if kv else {}
    results = {}
    for depth in depths:
        cache = m.new_cache(depth + 8, **cache_kw)
        ids = torch.randint(3, m.cfg.vocab_size, (depth + 8,), generator=torch.Generator().manual_seed(0))
        for s in range(0, depth, 1024):
            e = min(depth, s + 1024)
            m.forward(ids[s:e], AttentionPlan.causal(s, e - s), cache)
            cache.commit()
        runs: dict[int, list[float]] = {n: [] for n in (1, 2, 3, 4)}
        for rep in range(31):  # (the first round warms up)
            for n in runs:
                t = time.perf_counter()
                h = m.forward(ids[depth:depth + n], AttentionPlan.causal(depth, n), cache)
                m.logits(h)
                if rep:
                    runs[n].append(time.perf_counter() - t)
                cache.commit([])
        ms = {n: statistics.median(v) * 1e3 for n, v in runs.items()}
        results[depth] = ms
        print(f"{path} {dtype} KV {kv or 'default'} after {depth} positions: "
              + ", ".join(f"{n} token(s) {t:.2f} ms" for n, t in ms.items())
              + " | each token more: " + " ".join(f"+{ms[n] - ms[n - 1]:.2f}" for n in (2, 3, 4)))
    if out:
        Path(out).write_text(json.dumps({"model": path, "dtype": dtype, "kv": kv, "ms_by_depth_and_tokens": results},
                                        indent=1) + "\n")


def gemm() -> None:
    """GFLOP/s of a prefill-sized product (512 x 512 rows times a 3072 x 512 matrix) per GEMM turbospec could use:
    torch's bf16 (oneDNN), oneDNN float32 (`linear.prefill_product`'s), torch's default float32 (MKL) and float16."""
    x, w = torch.randn(512, 512), torch.randn(3072, 512)
    xb, wb, xh, wh = x.bfloat16(), w.bfloat16(), x.half(), w.half()
    runs = {"bf16 (torch, oneDNN)": lambda: xb @ wb.t(),
            "float32 (oneDNN)": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            "float32 (torch default)": lambda: x @ w.t(),
            "float16 (torch)": lambda: xh @ wh.t()}
    for name, f in runs.items():
        ms = _median_ms(f, 5 if "float16" in name else 30)
        print(f"{name:24s} {ms:7.2f} ms  {2 * 512 * 512 * 3072 / ms / 1e6:6.0f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["dense", "spec", "cold", "store", "chain", "dtypes", "kvpages", "kvtypes",
                                     "bf16held", "attention", "prefill_rows", "loop", "gemm", "verify_tokens"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="chain: input rows per product")
    ap.add_argument("--model", default=None, help="chain, spec: a checkpoint or GGUF file instead of the default model")
    ap.add_argument("--steps", type=int, default=6000, help="loop: decode steps")
    ap.add_argument("--depth", type=int, default=512, help="kvtypes: context before decoding")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 6144, 16384], help="verify_tokens: contexts")
    ap.add_argument("--kv", default=None, help="verify_tokens: KV type (default: the model's dtype)")
    ap.add_argument("--json", default=None, help="verify_tokens: write the medians here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    {"dense": lambda: dense(a.dtype), "spec": lambda: spec(a.model, a.dtype), "cold": cold, "store": store, "chain": lambda: chain(a.dtype, a.rows, a.model),
     "dtypes": dtypes, "kvpages": kvpages, "kvtypes": lambda: kvtypes(a.dtype, a.depth), "bf16held": bf16held, "attention": lambda: attention(a.dtype),
     "prefill_rows": lambda: prefill_rows(a.dtype), "loop": lambda: loop(a.dtype, a.steps), "gemm": gemm,
     "verify_tokens": lambda: verify_tokens(a.model, a.dtype, a.depths, a.kv, a.json)}[a.what]()


if __name__ == "__main__":
    main()
