"""A conversation's turns through one engine with a drafter: turn 1 is a prompt of N random tokens, every later turn
re-sends the conversation (the last prompt, its answer and 4 new tokens), as chat clients do. The engine resumes its
own cache at the shared prefix; this measures what the drafter adds to each turn's time to the first token.

    python benchmarks/draft_turns.py --tokens 8192 --specs draft-model ngram suffix --json docs/results/draft_turns.json

`--draft-model` defaults to the target itself (the bundled model drafting for itself). `--revision DIR` runs the
same against another checkout's turbospec (a `git worktree` of an older commit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="models/turbospec-tiny")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--specs", nargs="+", default=["draft-model", "ngram", "suffix"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--revision", default=None, help="a checkout whose turbospec to measure (default: this one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.revision).resolve() if a.revision else Path(__file__).resolve().parents[1]))
    import torch

    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import Engine
    from turbospec.engine.build import load_parts
    from turbospec.sampling import SamplingParams
    from turbospec.speculative import make_drafter

    path, model, tok = load_parts(EngineConfig(model=a.model, dtype="float32", threads=2))
    ctx_len = a.tokens + a.turns * (a.gen + 8) + 64
    sp = SamplingParams(temperature=0, max_tokens=a.gen, ignore_eos=True)
    rows = []
    for spec in ["plain", *a.specs]:
        if spec == "plain":
            eng = Engine(model, tok, EngineConfig(ctx=ctx_len))
        else:
            sc = SpecConfig.parse(spec, n_max=3, draft_model=a.draft_model or a.model)
            eng = Engine(model, tok, EngineConfig(ctx=ctx_len, spec=SpecConfig(n_max=3)),
                         drafter=make_drafter(sc, model, ctx_len))
        conv = torch.randint(3, model.cfg.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        ttft = []
        for turn in range(a.turns):
            out = [t for c in eng.stream(conv, sp) for t in c.tokens]
            st = eng.last_stats
            ttft.append(st.ttft_s * 1e3)
            print(f"{spec:12s} turn {turn + 1}: prompt {st.prompt_tokens} ({st.cached_tokens} cached), "
                  f"TTFT {st.ttft_s * 1e3:7.0f} ms, decode {st.decode_tps:5.0f} t/s", flush=True)
            conv = conv + out + [11, 12, 13, 14]
        rows.append({"spec": spec, "ttft_ms": [round(x, 1) for x in ttft],
                     "ttft_ms_median_later_turns": round(statistics.median(ttft[1:]), 1)})
    if a.json:
        out = {"command": " ".join(["python", "benchmarks/draft_turns.py", *sys.argv[1:]]), "model": a.model,
               "tokens": a.tokens, "gen": a.gen, "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
