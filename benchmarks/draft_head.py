"""The MTP drafter's reduced-vocabulary head at a real vocabulary: what each drafting sequence holds and what a draft
costs, with the head's rows read where they lie (`Linear.take` -> `LinearRows`, one matrix for every sequence)
against a copy of them per sequence (the arm `copy`: `Linear.take` gathering the rows, as before session 47).

A random-weight Qwen3.5-shaped hybrid with real_size.py's shapes (vocabulary 248,320, hidden 2048, bf16, one MTP
layer; `--layers` trunk layers, 2 by default: only the MTP block and the head matter here), `--seqs` MTP drafters
(`--spec-draft-vocab 1024`, as a model shipping draft_vocab.json gets by default), each begun on a context of C
distinct random tokens (the reduced vocabulary: the 1,024 base ids plus the context's), then `--drafts` drafts of
3 tokens each, each new draft's first token joining the vocabulary (a generated token the set had not seen). Per
arm and context: bytes of head rows each drafter holds, process RSS growth over the drafters' lifetime, the first
draft's time (the head taken) and the median draft time after a new token (the head taken again) -- arms
interleaved, `--rounds` times, medians.

    python benchmarks/draft_head.py [--dir /tmp/real_l2] [--seqs 4] [--context 512 4096 32768] [--rounds 3]
        [--json docs/results/draft_head.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from real_size import SHAPE, build  # (this folder is on sys.path when run as a script)

from turbospec.config import SpecConfig
from turbospec.layers.linear import Linear
from turbospec.model import load_model
from turbospec.speculative import make_drafter


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def copy_take(self: Linear, rows: torch.Tensor) -> Linear:
    """`Linear.take` as it was: a copy of the rows."""
    return Linear(self.weight[rows], None if self.bias is None else self.bias[rows], hugepages=False)


def run_arm(model, arm: str, seqs: int, context: int, drafts: int, seed: int) -> dict:
    original = Linear.take
    if arm == "copy":
        Linear.take = copy_take  # type: ignore[method-assign]
    try:
        g = torch.Generator().manual_seed(seed)
        vocab, hidden = SHAPE["vocab_size"], SHAPE["hidden_size"]
        gc.collect()
        before = rss()
        drafters, first, again = [], [], []
        for _ in range(seqs):
            d = make_drafter(SpecConfig.parse("draft-mtp", n_max=3, draft_vocab=1024), model, context + 4 * drafts + 8)
            tokens = (torch.randperm(vocab - 1024, generator=g)[:context] + 1024).tolist()
            rows = d.prompt_rows(len(tokens)) or len(tokens)
            d.begin(tokens, (torch.randn(rows, hidden, generator=g) * 0.5).to(torch.bfloat16))
            t = time.perf_counter()
            tree = d.propose(tokens, 3)
            first.append(time.perf_counter() - t)
            for _ in range(drafts):  # the draft's first token accepted, then a token the set has not seen
                new = int(torch.randint(1024, vocab, (1,), generator=g))
                d.accept([tokens[-1], tree.tokens[0]], torch.randn(2, hidden, generator=g).to(torch.bfloat16), new)
                tokens += [tree.tokens[0], new]
                t = time.perf_counter()
                tree = d.propose(tokens, 3)
                again.append(time.perf_counter() - t)
            drafters.append(d)
        grown = rss() - before
        held = statistics.median(x._reduced_head.nbytes for x in drafters)  # type: ignore[attr-defined]
        return {"head_rows": len(drafters[0].head_ids or []), "held_bytes_per_seq": int(held),
                "rss_growth_bytes": grown, "first_draft_ms": statistics.median(first) * 1e3,
                "draft_after_new_token_ms": statistics.median(again) * 1e3}
    finally:
        Linear.take = original  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/real_l2"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--context", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if not (a.dir / "config.json").exists():
        print(f"writing the random checkpoint to {a.dir} ...", file=sys.stderr)
        build(a.dir, a.layers)
    model = load_model(a.dir, "bfloat16")
    results: dict[str, dict[int, list[dict]]] = {"in_place": {}, "copy": {}}
    for r in range(a.rounds):
        for c in a.context:
            for arm in (("in_place", "copy") if r % 2 == 0 else ("copy", "in_place")):
                out = run_arm(model, arm, a.seqs, c, a.drafts, seed=1000 * r + c)
                results[arm].setdefault(c, []).append(out)
                print(f"round {r + 1} context {c} {arm}: {out}", file=sys.stderr)
    table = []
    for c in a.context:
        row: dict = {"context": c}
        for arm in ("in_place", "copy"):
            runs = results[arm][c]
            row[arm] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        table.append(row)
    print(f"| context | head rows | held per sequence (in place / copy) | RSS growth, {a.seqs} drafters | "
          "first draft ms | draft after a new token ms |")
    print("|---|---|---|---|---|---|")
    for row in table:
        i, cp = row["in_place"], row["copy"]
        print(f"| {row['context']} | {i['head_rows']} | {i['held_bytes_per_seq'] / 2**20:.2f} / "
              f"{cp['held_bytes_per_seq'] / 2**20:.1f} MiB | {i['rss_growth_bytes'] / 2**20:.0f} / "
              f"{cp['rss_growth_bytes'] / 2**20:.0f} MiB | {i['first_draft_ms']:.2f} / {cp['first_draft_ms']:.2f} | "
              f"{i['draft_after_new_token_ms']:.2f} / {cp['draft_after_new_token_ms']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "seqs": a.seqs, "rounds": a.rounds,
                                      "drafts": a.drafts, "shape": SHAPE, "layers": a.layers, "results": table},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
