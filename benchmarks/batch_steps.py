"""Decode throughput of the continuous-batching scheduler itself (no HTTP, no prefill in the timing): S sequences
decode together, tokens per second once every prompt is computed, against one sequence through `Engine` (the
one-at-a-time path) on the same model, in interleaved rounds.

    python benchmarks/batch_steps.py --model models/demo-qwen3 --dtype bfloat16 --json docs/results/batch_steps.json

`--model` also takes a GGUF file (packed weights stay packed: e.g. the Q4_K_M file `engine_speed.py --weights q4_k_m`
writes beside the model), and hybrid models (Qwen3.5: a recurrent-state slot per sequence, no prefix cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turbospec.config import EngineConfig  # noqa: E402
from turbospec.engine.engine import Engine  # noqa: E402
from turbospec.engine.scheduler import Scheduler  # noqa: E402
from turbospec.kv.paged import pool_for  # noqa: E402
from turbospec.model.hybrid import HybridModel  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402
from turbospec.sampling import SamplingParams  # noqa: E402


def batched(model, s: int, prompt: int, gen: int, vocab: int, seed: int) -> float:
    hybrid = isinstance(model, HybridModel)  # a recurrent-state slot per sequence, KV for its attention layers only
    states = model.new_state_pool(s, 0, per_owner=0) if hybrid else None
    pool = pool_for(model, s * (prompt + gen + 256), None, None,
                    layers=model.num_attn_layers if hybrid else model.cfg.num_layers)
    sch = Scheduler(model, pool, max_seqs=s, max_step_tokens=4096, ctx=prompt + gen + 256, prefix_cache=not hybrid,
                    states=states)
    rnd = random.Random(seed)
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    for _ in range(s):
        sch.add([rnd.randrange(3, vocab) for _ in range(prompt)], params)
    while sch.waiting or any(q.todo > 1 for q in sch.running):
        sch.step()
    t, tokens = time.perf_counter(), 0
    while sch.has_work:
        tokens += sum(len(o.chunk.tokens) for o in sch.step() if o.chunk)
    return tokens / (time.perf_counter() - t)


def alone(engine, prompt: int, gen: int, vocab: int, seed: int) -> float:
    rnd = random.Random(seed)
    list(engine.stream([rnd.randrange(3, vocab) for _ in range(prompt)],
                       SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)))
    st = engine.last_stats
    return (st.gen_tokens - 1) / st.decode_s


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The load both batching benchmarks put on the engine: stream counts, prompt and output lengths, rounds."""
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--dtype", default="bfloat16")
    add_load_args(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = Path(a.model)
    if path.suffix != ".gguf" and not (path / "config.json").exists():
        from turbospec.demo import make_demo_model

        make_demo_model(path)
    model = load_model(str(path), a.dtype)
    vocab = model.cfg.vocab_size
    engine = Engine(model, None, EngineConfig(ctx=a.prompt + a.gen + 16, dtype=a.dtype))
    res: dict[str, list[float]] = {}
    alone(engine, 16, 8, vocab, 0)  # warm-up
    batched(model, 2, 16, 8, vocab, 0)
    for r in range(a.rounds):
        res.setdefault("alone", []).append(alone(engine, a.prompt, a.gen, vocab, r))
        for s in a.streams:
            res.setdefault(str(s), []).append(batched(model, s, a.prompt, a.gen, vocab, r))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in res.items()), flush=True)
    base = statistics.median(res["alone"])
    rows = []
    for k, v in res.items():
        paired = [x / a for x, a in zip(v, res["alone"])]  # each round against that round's lone sequence
        rows.append({"streams": k, "decode_tps": statistics.median(v), "runs": [round(x, 1) for x in v],
                     "vs_alone": statistics.median(v) / base, "vs_alone_paired": statistics.median(paired),
                     "vs_alone_paired_range": [round(min(paired), 2), round(max(paired), 2)]})
    print(f"\n{'streams':>8s} {'decode t/s':>11s} {'x alone':>8s} {'paired':>8s}")
    for row in rows:
        print(f"{row['streams']:>8s} {row['decode_tps']:11.0f} {row['vs_alone']:8.2f} {row['vs_alone_paired']:8.2f}")
    if a.json:
        out = {"command": " ".join(["python", "benchmarks/batch_steps.py", *sys.argv[1:]]), "model": a.model,
               "dtype": a.dtype, "prompt_tokens": a.prompt, "gen_tokens": a.gen, "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
