"""Build the shipped evaluation texts (turbospec/data/eval/) from the held-out split.

    python -m training.evaldata --tokenizer models/turbospec-tiny --out turbospec/data/eval

Files (JSON lines):
* code.jsonl      -- {"path", "text"}: held-out standard-library modules (each cut at a line boundary)
* prose.jsonl     -- {"path", "text"}: held-out documentation pages
* retrieval.jsonl -- {"id", "target_tokens", "n_prompt_tokens", "family", "prompt", "answer", "value"}:
  long-range retrieval cases whose filler comes only from held-out files; the answer is correct iff the
  greedy continuation of ``prompt`` contains ``value``.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from .corpus import load_corpus, make_retrieval_example
from .tokenizer import load_tokenizer

RETRIEVAL_COUNTS = {1024: 40, 2048: 40, 4096: 24, 8192: 10}


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut if cut > 0 else max_chars]


def select_texts(docs, budget_chars: int, per_file: int) -> list[dict]:
    out, total = [], 0
    for d in sorted(docs, key=lambda d: d.path):
        if total >= budget_chars:
            break
        t = _cut(d.text, min(per_file, budget_chars - total))
        if len(t) < 500:
            continue
        out.append({"path": d.path, "text": t})
        total += len(t)
    return out


def build(out_dir: str, tokenizer, seed: int = 20261130, code_budget: int = 300_000, prose_budget: int = 150_000,
          counts: dict | None = None, corpus=None) -> dict:
    corpus = corpus or load_corpus()
    os.makedirs(out_dir, exist_ok=True)
    code = select_texts([d for d in corpus.heldout if d.kind == "code"], code_budget, 12_000)
    prose = select_texts([d for d in corpus.heldout if d.kind == "prose"], prose_budget, 10_000)
    rng = random.Random(seed)
    filler = [d.text for d in corpus.heldout]
    cases = []
    for n, k in (counts or RETRIEVAL_COUNTS).items():
        for i in range(k):
            ex = make_retrieval_example(tokenizer, filler, rng, n)
            cases.append({"id": f"r{n}-{i}", "target_tokens": n, **ex})
    for name, rows in (("code", code), ("prose", prose), ("retrieval", cases)):
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return {"code_files": len(code), "prose_files": len(prose), "retrieval_cases": len(cases)}


def load_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def default_eval_dir() -> str:
    import turbospec

    return os.path.join(os.path.dirname(os.path.abspath(turbospec.__file__)), "data", "eval")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default=default_eval_dir())
    ap.add_argument("--seed", type=int, default=20261130)
    a = ap.parse_args(argv)
    print(build(a.out, load_tokenizer(a.tokenizer), seed=a.seed))


if __name__ == "__main__":
    main()
