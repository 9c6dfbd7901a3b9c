"""Cost of streaming detokenization as the output grows: seconds for N pushes of `StreamDecoder` beside decoding
the whole output at every push (what it did before), on the bundled tokenizer and a long greedy-like text.

    python benchmarks/detokenize.py --sizes 1000 2000 4000 8000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from turbospec.tokenizer import StreamDecoder, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def whole_each_push(tok: Tokenizer, ids: list[int]) -> None:
    emitted = 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if not text.endswith("\ufffd"):
            emitted = len(text)
    assert emitted


def incremental(tok: Tokenizer, ids: list[int]) -> None:
    dec = StreamDecoder(tok)
    for t in ids:
        dec.push(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(ROOT / "models" / "turbospec-tiny"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    a = ap.parse_args()
    tok = Tokenizer(a.model)
    text = "".join(json.loads(line)["text"] for line in (ROOT / "turbospec/data/eval/code.jsonl").open())
    all_ids = tok.encode(text, add_special=False)
    print("| pushes | decode everything each push (s) | StreamDecoder (s) | per token (us) |")
    print("|---|---|---|---|")
    for n in a.sizes:
        ids = all_ids[:n]
        t = time.perf_counter()
        whole_each_push(tok, ids)
        whole = time.perf_counter() - t
        t = time.perf_counter()
        incremental(tok, ids)
        inc = time.perf_counter() - t
        print(f"| {len(ids)} | {whole:.3f} | {inc:.3f} | {inc / len(ids) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
