"""A hybrid model's batched decode with its Gated DeltaNet layers in one C++ call for every sequence of a step
(`gdn_steps`) against one call per sequence from Python (`gdn.mix`, the path a step takes when a sequence's rows need
the chunked form), in the same process and alternating: S sequences decode together after 128-token prompts, tokens
per second once the prompts are in, beside one sequence through `Engine`.

    python benchmarks/gdn_batch.py --model models/turbospec-tiny-hybrid --json docs/results/gdn_batch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from batch_steps import alone, batched  # noqa: E402

from turbospec.config import EngineConfig  # noqa: E402
from turbospec.engine.engine import Engine  # noqa: E402
from turbospec.model import hybrid  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/turbospec-tiny-hybrid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, a.dtype)
    if not isinstance(model, hybrid.HybridModel):
        raise SystemExit("--model must be a hybrid (Qwen3.5 / Qwen3-Next) checkpoint")
    engine = Engine(model, None, EngineConfig(ctx=a.prompt + a.gen + 16, dtype=a.dtype))
    vocab = model.cfg.vocab_size
    one_call = hybrid.load_gdn_kernel
    arms = {"one call": one_call, "per sequence": lambda: None}  # (None: `_gdn_batch` loops over the sequences)
    alone(engine, 16, 8, vocab, 0)  # warm-up
    batched(model, 2, 16, 8, vocab, 0)
    res: dict[str, list[float]] = {}
    try:
        for r in range(a.rounds):
            res.setdefault("alone", []).append(alone(engine, a.prompt, a.gen, vocab, r))
            for s in a.streams:
                for name, loader in arms.items():
                    hybrid.load_gdn_kernel = loader
                    res.setdefault(f"{s} {name}", []).append(batched(model, s, a.prompt, a.gen, vocab, r))
                hybrid.load_gdn_kernel = one_call
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in res.items()), flush=True)
    finally:
        hybrid.load_gdn_kernel = one_call
    rows = []
    for s in a.streams:
        new, old = res[f"{s} one call"], res[f"{s} per sequence"]
        rows.append({"streams": s, "one_call_tps": statistics.median(new), "per_sequence_tps": statistics.median(old),
                     "one_call_vs_per_sequence_paired": statistics.median(x / y for x, y in zip(new, old)),
                     "one_call_vs_alone_paired": statistics.median(x / y for x, y in zip(new, res["alone"])),
                     "runs": {"one call": [round(x, 1) for x in new], "per sequence": [round(x, 1) for x in old]}})
        print(f"{s} streams: one call {rows[-1]['one_call_tps']:.0f} t/s, per sequence {rows[-1]['per_sequence_tps']:.0f}"
              f" t/s ({rows[-1]['one_call_vs_per_sequence_paired']:.2f}x); alone {statistics.median(res['alone']):.0f}")
    if a.json:
        out = {"command": " ".join(["python", "benchmarks/gdn_batch.py", *sys.argv[1:]]), "model": a.model,
               "dtype": a.dtype, "alone_tps": statistics.median(res["alone"]),
               "alone_runs": [round(x, 1) for x in res["alone"]], "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
