"""Speculation inside continuous batching: decode throughput of S sequences decoding together through the
scheduler, with each sequence drafting (--spec-type; with --adaptive as `--spec-adaptive` drafts, where the batch
drafts only while drafting steps emit tokens faster) against the same sequences without drafts, in alternating
rounds. Prompts are consecutive stretches of the shipped prose evaluation text (one per sequence), so drafts can hit;
decode t/s counts the tokens generated once every prompt is computed.

    python benchmarks/batch_spec.py --model models/demo-qwen3 --dtype bfloat16 --spec-type ngram --streams 4 8 \\
        --json docs/results/batch_spec.json

`--mtp-topk K` drafts MTP trees (K candidates per depth). `--arms A ..` adds drafting runs per round with parts of
the scheduler switched to their simpler form: `alone` (the MTP drafters of the batch drafting one sequence at a time:
one MTP forward and draft-head product per sequence and depth), `fresh` (a hybrid's verification writes its per-row
recurrent states into new tensors every step instead of the last step's), `alone+fresh` (both). `--revision DIR` runs the same against another checkout's turbospec (a `git worktree` of an older commit), in a
subprocess per round, alternating with this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(a, streams: int, spec: str | None) -> dict:
    """One run: S sequences, plain or drafting (a spec "T/ARM": drafting with `--arms` ARM); decode t/s and the
    drafts' acceptance."""
    import torch

    if spec and "/" in spec:
        spec, arm = spec.split("/")
        if "alone" in arm.split("+"):
            from turbospec.speculative.mtp import MTPDrafter

            MTPDrafter.batch_key = lambda self: None  # type: ignore[method-assign]
        if "fresh" in arm.split("+"):
            from turbospec.kv.state_pool import _NONE, StatePool

            StatePool.buffer = lambda self, rows: _NONE  # type: ignore[method-assign]

    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine.engine import Engine
    from turbospec.engine.scheduler import Scheduler
    from turbospec.model.registry import load_model
    from turbospec.sampling import SamplingParams
    from turbospec.tokenizer import Tokenizer

    torch.set_num_threads(a.threads)
    model = load_model(a.model, a.dtype)
    tok = Tokenizer(a.model)
    lines = (ROOT / "turbospec" / "data" / "eval" / "prose.jsonl").read_text().splitlines()
    ids = tok.encode(" ".join(json.loads(x)["text"] for x in lines if x.strip()))
    cfg = EngineConfig(ctx=streams * (a.prompt + a.gen + 512), dtype=a.dtype,
                       spec=SpecConfig(types=spec, adaptive=a.adaptive, mtp_topk=a.mtp_topk, draft_vocab=a.draft_vocab)
                       if spec else SpecConfig())
    sch = Scheduler.for_engine(Engine(model, tok, cfg), streams)
    params = SamplingParams(max_tokens=a.gen, temperature=0, ignore_eos=True)
    seqs = [sch.add(ids[i * 997:i * 997 + a.prompt], params) for i in range(streams)]
    while sch.waiting or any(q.todo > 1 for q in sch.running):
        sch.step()
    t, n = time.perf_counter(), 0
    while sch.has_work:
        n += sum(len(o.chunk.tokens) for o in sch.step() if o.chunk)
    tps = n / (time.perf_counter() - t)
    drafted = sum(s.stats.spec.draft_tokens for s in seqs if s.stats.spec) if spec else 0
    accepted = sum(s.stats.spec.accepted for s in seqs if s.stats.spec) if spec else 0
    return {"decode_tps": tps, "drafted": drafted, "accepted": accepted}  # draft tokens, accepted ones


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--spec-type", default="ngram")
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adaptive", action="store_true", help="draft with --spec-adaptive (the batch's draft gate)")
    ap.add_argument("--mtp-topk", type=int, default=1, help="MTP trees: candidates per depth (--spec-mtp-topk)")
    ap.add_argument("--draft-vocab", type=int, default=-1, help="MTP drafts over N tokens (--spec-draft-vocab)")
    ap.add_argument("--arms", nargs="*", default=[], choices=("alone", "fresh", "alone+fresh"),
                    help="also drafting with these parts as before: see above")
    ap.add_argument("--revision", default=None, help="a checkout whose turbospec to measure too (a 'before')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "S,spec": one measurement, printed as JSON
    a = ap.parse_args()
    if a.one:
        s, spec = a.one.split(",", 1)
        print(json.dumps(measure(a, int(s), spec or None)))
        return 0
    if a.revision and a.arms:
        ap.error("--arms switches parts of this checkout; it does not combine with --revision")
    trees = {"this": str(ROOT)} | ({"before": str(Path(a.revision).resolve())} if a.revision else {})

    def one(tree: str, s: int, spec: str) -> dict:
        env = dict(os.environ, PYTHONPATH=tree)
        if tree != str(ROOT):
            env["TORCH_EXTENSIONS_DIR"] = env.get("TORCH_EXTENSIONS_DIR", "/tmp/torch_ext") + "_before"
        args = [sys.executable, __file__, "--one", f"{s},{spec}", "--model", a.model, "--dtype", a.dtype,
                "--prompt", str(a.prompt), "--gen", str(a.gen), "--threads", str(a.threads)] + \
            (["--adaptive"] if a.adaptive else []) + ["--mtp-topk", str(a.mtp_topk), "--draft-vocab", str(a.draft_vocab)]
        r = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])

    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(a.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            for s in a.streams:
                for spec in ("", a.spec_type, *(f"{a.spec_type}/{arm}" for arm in a.arms)):
                    runs.setdefault((name, s, spec), []).append(one(tree, s, spec))
        print(f"round {r}: " + ", ".join(f"{n} S={s} {sp or 'plain'} {v[-1]['decode_tps']:.0f}"
                                         for (n, s, sp), v in runs.items()), flush=True)
    rows = []
    for (name, s, spec), v in runs.items():
        if not spec:
            continue
        plain = runs[(name, s, "")]
        ratios = [x["decode_tps"] / p["decode_tps"] for x, p in zip(v, plain)]  # paired: the same round
        rows.append({"checkout": name, "streams": s, "spec_type": spec,
                     "plain_tps": statistics.median(p["decode_tps"] for p in plain),
                     "spec_tps": statistics.median(x["decode_tps"] for x in v),
                     "ratio_paired": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                     "acceptance": sum(x["accepted"] for x in v) / max(1, sum(x["drafted"] for x in v))})
    print(f"\n{'checkout':8s} {'S':>3s} {'drafter':>22s} {'plain t/s':>10s} {'drafting t/s':>13s} {'x plain':>8s} "
          f"{'accepted':>9s}")
    for row in rows:
        print(f"{row['checkout']:8s} {row['streams']:3d} {row['spec_type']:>22s} {row['plain_tps']:10.0f} "
              f"{row['spec_tps']:13.0f} {row['ratio_paired']:8.2f} {100 * row['acceptance']:8.0f}%")
    if a.json:
        Path(a.json).write_text(json.dumps({"command": " ".join(["python", "benchmarks/batch_spec.py", *sys.argv[1:]]),
                                            "model": a.model, "dtype": a.dtype, "adaptive": a.adaptive,
                                            "draft_vocab": a.draft_vocab, "prompt_tokens": a.prompt,
                                            "gen_tokens": a.gen, "rounds": a.rounds, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
