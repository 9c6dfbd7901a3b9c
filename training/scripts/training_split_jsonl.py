"""Write a sample of the bundled model's *training* split (code + prose, never the held-out files) as jsonl, for
`python -m training.heads --text` (the MTP self-distillation stage of models/turbospec-tiny used the defaults).

    python -m training.scripts.training_split_jsonl --out runs/mtp_distill/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random

from training.corpus import load_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-chars", type=int, default=8_000_000, help="stop after this many characters")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed of the training files")
    a = ap.parse_args()
    docs = list(load_corpus().train)
    random.Random(a.seed).shuffle(docs)
    lines, n = [], 0
    for d in docs:
        if n > a.max_chars:
            break
        lines.append(json.dumps({"kind": d.kind, "text": d.text}))
        n += len(d.text)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"{len(lines)} training files, {n} chars -> {a.out}")


if __name__ == "__main__":
    main()
