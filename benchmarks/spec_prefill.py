"""Prefill with MTP drafting on vs off, side by side (issue: "prefill must not pay for drafting").

With MTP on, prefill also runs the MTP module over the prompt (its own KV cache, so that drafting can attend
to the context); `--spec-mtp-prompt-window W` feeds only the last W prompt positions to it. This script times
prefill (time to the first token, which includes the MTP's prompt pass) for each configuration, interleaved
(off, on, on-window, off, ...), median of `--reps` after a warm-up, and the decode speed and acceptance of a
short greedy generation so the window's cost, if any, is visible too.

    python benchmarks/spec_prefill.py [--lengths 512 2048] [--windows 0 -1 256] [--reps 5] [--gen 64] \\
        [--out docs/results/spec_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.lab.quality import read_text
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter
from turbospec.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint with mtp.* weights (default: the bundled model)")
    ap.add_argument("--text", default="turbospec/data/eval/code.jsonl")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, -1],
                    help="MTP prompt windows (0 = all, -1 = auto: a quarter of the prompt, 64..256)")
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from turbospec.engine import model_path

    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_path(a.model)
    model = load_model(path, "float32")
    tok = Tokenizer(path)
    ids = tok.encode(read_text(a.text)[: max(a.lengths) * 8], add_special=False)
    ctx = max(a.lengths) + a.gen + 16
    engines = {"off": Engine(model, tok, EngineConfig(ctx=ctx, prefix_cache=False))}
    for w in a.windows:
        cfg = SpecConfig.parse("draft-mtp", n_max=a.n_max, mtp_prompt_window=w)
        engines[f"mtp window {w or 'all' if w >= 0 else 'auto'}"] = Engine(model, tok, EngineConfig(ctx=ctx, prefix_cache=False, spec=cfg),
                                                                           drafter=make_drafter(cfg, model, ctx))
    params = SamplingParams(temperature=0, max_tokens=a.gen, ignore_eos=True)
    rows = []
    for n in a.lengths:
        prompt = ids[:n]
        res: dict[str, dict[str, list]] = {k: {"prefill": [], "decode": [], "accept": []} for k in engines}
        for r in range(a.reps + 1):
            for name, eng in engines.items():
                eng.generate([prompt], params)
                st = eng.last_stats
                if r:
                    res[name]["prefill"].append(st.prefill_tps)
                    res[name]["decode"].append(st.decode_tps)
                    spec = st.spec
                    res[name]["accept"].append(spec.acceptance_rate if spec is not None else float("nan"))
        base = statistics.median(res["off"]["prefill"])
        for name, v in res.items():
            pre = statistics.median(v["prefill"])
            rows.append({"prompt_tokens": n, "config": name, "prefill_tps": pre, "prefill_vs_off": pre / base,
                         "decode_tps": statistics.median(v["decode"]),
                         "acceptance": statistics.median(v["accept"]), "prefill_all": v["prefill"]})
    print(f"model {path}, float32, {torch.get_num_threads()} threads, median of {a.reps}, greedy, {a.gen} generated")
    print("| prompt | config | prefill t/s | vs off | decode t/s | acceptance |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['config']} | {r['prefill_tps']:.0f} | {r['prefill_vs_off']:.2f}x "
              f"| {r['decode_tps']:.1f} | {r['acceptance']:.2f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"model": str(path), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
