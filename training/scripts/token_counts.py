"""Token counts of the shipped held-out texts under two tokenizers (docs/bundled-model.md, "Session 12").

    python -m training.scripts.token_counts models/turbospec-tiny models/turbospec-tiny-hybrid   # ~5 s

Per kind (code, prose, retrieval prompts): total tokens with each tokenizer and their ratio; per retrieval length:
mean and max prompt tokens with the first tokenizer (the cases were cut to length with the merged-digit one).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

from training.evaldata import default_eval_dir, load_jsonl
from training.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", help="tokenizer (model directory) to measure")
    ap.add_argument("old", help="tokenizer to compare with")
    a = ap.parse_args()
    new, old = load_tokenizer(a.new), load_tokenizer(a.old)
    lengths = defaultdict(list)
    for kind in ("code", "prose", "retrieval"):
        n_new = n_old = 0
        for r in load_jsonl(os.path.join(default_eval_dir(), f"{kind}.jsonl")):
            text = r.get("text") or r["prompt"]
            k = len(new.encode(text).ids)
            n_new, n_old = n_new + k, n_old + len(old.encode(text).ids)
            if kind == "retrieval":
                lengths[r["target_tokens"]].append(k)
        print(f"{kind}: {n_new} tokens vs {n_old} ({n_new / n_old - 1:+.1%})")
    for target, ks in sorted(lengths.items()):
        print(f"retrieval {target}: prompt tokens mean {sum(ks) / len(ks):.0f}, max {max(ks)} ({len(ks)} cases)")


if __name__ == "__main__":
    main()
