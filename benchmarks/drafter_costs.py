"""What the model-free drafters cost at long context, outside the model: starting on a prompt of N random tokens
(cold), a draft where nothing matches (the worst case: prompt lookup once scanned the whole context for it), and
starting on the next request -- the same prompt again after a 128-token answer, or the next turn of the
conversation (prompt + answer + 3 tokens). Medians of --reps, in milliseconds; and the memory a drafter's tables
hold after a start on a new prompt (Python objects, traced by tracemalloc in a run of its own).

    python benchmarks/drafter_costs.py --tokens 65536 262144 --json docs/results/drafter_costs.json

`--revision DIR` runs the same against another checkout's turbospec (a `git worktree` of an older commit).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path


def costs(drafter_cls, n: int, reps: int) -> dict[str, float]:
    rnd = random.Random(n)
    runs: dict[str, list[float]] = {"begin": [], "propose": [], "same_prompt": [], "next_turn": []}
    for _ in range(reps):
        prompt = [rnd.randrange(3, 150000) for _ in range(n)]  # (a vocabulary this large: nothing repeats)
        d = drafter_cls()
        t = time.perf_counter()
        d.begin(prompt, None)
        runs["begin"].append(time.perf_counter() - t)
        ctx = prompt + [1]
        t = time.perf_counter()
        d.propose(ctx, 3)
        runs["propose"].append(time.perf_counter() - t)
        ctx += [rnd.randrange(3, 150000) for _ in range(127)]
        d.propose(ctx, 3)
        t = time.perf_counter()
        d.begin(prompt, None)
        runs["same_prompt"].append(time.perf_counter() - t)
        t = time.perf_counter()
        d.begin(ctx + [5, 6, 7], None)
        runs["next_turn"].append(time.perf_counter() - t)
    out = {k: round(statistics.median(v) * 1e3, 3) for k, v in runs.items()}
    tracemalloc.start()
    d = drafter_cls()
    d.begin(prompt, None)
    out["held_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
    tracemalloc.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--revision", default=None, help="a checkout whose turbospec to measure (default: this one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.revision).resolve() if a.revision else Path(__file__).resolve().parents[1]))
    from turbospec.speculative.ngram import NgramMod, PromptLookup
    from turbospec.speculative.suffix import SuffixDrafter

    rows = []
    for n in a.tokens:
        for name, cls in (("ngram", PromptLookup), ("ngram-mod", NgramMod), ("suffix", SuffixDrafter)):
            row = {"drafter": name, "tokens": n, **costs(cls, n, a.reps)}
            rows.append(row)
            print(f"{name:10s} {n:7d} tokens: begin {row['begin']:8.1f} ms, draft {row['propose']:7.2f} ms, "
                  f"same prompt again {row['same_prompt']:7.1f} ms, next turn {row['next_turn']:7.1f} ms, "
                  f"tables {row['held_mib']:6.1f} MiB", flush=True)
    if a.json:
        out = {"command": " ".join(["python", "benchmarks/drafter_costs.py", *sys.argv[1:]]), "reps": a.reps,
               "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
