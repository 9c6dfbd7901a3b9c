"""Where a decode step's time goes (the instrumented numbers quoted in docs/speed.md and docs/speculative.md).

    python benchmarks/step_profile.py dense --dtype float32     # benchmark-shape dense model: linear share
    python benchmarks/step_profile.py spec                      # bundled model, MTP n_max 3: verify / draft split
    python benchmarks/step_profile.py cold                      # a 8192x256 matrix-vector product, hot vs cold
    python benchmarks/step_profile.py store                     # QuantKVCache.store: C++ encoder vs torch encoders

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

from turbospec.kv.plan import AttentionPlan
from turbospec.layers import linear
from turbospec.models import load_model


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


def spec() -> None:
    from turbospec.engine import Engine
    from turbospec.sampling import SamplingParams
    from turbospec.spec import SpecConfig, make_drafter
    from turbospec.tokenizer import Tokenizer

    path = "models/turbospec-tiny"
    model, tok = load_model(path, "float32"), Tokenizer(path)
    prompt = json.loads(Path("turbospec/data/prompts.json").read_text())["prompts"]["code"]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    plain = Engine(model, tok, ctx=4096)
    list(plain.stream(prompt, params))
    d = make_drafter(SpecConfig(types=("draft-mtp",), n_max=3), model, 4096, path)
    eng = Engine(model, tok, ctx=4096, drafter=d, n_max=3)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["dense", "spec", "cold", "store"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    {"dense": lambda: dense(a.dtype), "spec": spec, "cold": cold, "store": store}[a.what]()


if __name__ == "__main__":
    main()
