"""KV-cache format quality (the `turbospec quality` command is the full tool; this script keeps the first
table's exact protocol): perplexity, KLD vs the f16 cache and same-top-1 %, per (K, V) format pair.

llama-perplexity style: the token stream is cut into chunks of `--ctx` tokens; each chunk is prefilled from an
empty cache in `--ubatch` pieces (so later pieces attend to quantized entries of earlier ones) and the second
half of every chunk is scored. For every scored position the KL divergence KL(p_f16 || p_pair) of the next-token
distribution against the f16/f16 cache is recorded; the table reports its mean and 99th percentile, the
share of positions whose argmax equals the f16 cache's argmax, and PPL.

    python benchmarks/kv_quality.py --model models/turbospec-tiny --text turbospec/data/eval/prose.jsonl \\
        --ctx 512 4096 --chunks 4 [--pairs f16/f16 q8_0/turbo3 ...] [--retrieval 20 --lengths 1024 2048 4096] \\
        [--out docs/results/kv_quality.json]

`--retrieval N` adds retrieval accuracy on the shipped long-context cases (turbospec/data/eval/retrieval.jsonl,
first N cases of each length): the prompt and the answer sentence are prefilled through the pair's cache
(in --ubatch pieces); a case counts when the argmax at every answer position is the answer token, i.e.
greedy decoding with that cache reproduces the answer sentence (which contains the value).

`--text` is a plain text file or a .jsonl file with a "text" field per line (joined with blank lines).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from turbospec.lab.quality import chunk_logprobs, prefill_hidden, read_text
from turbospec.model import load_model

PAIRS = ["f16/f16", "q8_0/q8_0", "q4_0/q4_0", "tbq4_0/tbq4_0", "turbo4/turbo4", "turbo3/turbo3",
         "turbo2/turbo2", "q8_0/turbo4", "q8_0/turbo3"]


def evaluate(model, tokens: list[int], ctx: int, chunks: int, pairs: list[str], ubatch: int) -> list[dict]:
    n_chunks = min(len(tokens) // ctx, chunks)
    if n_chunks < 1:
        raise SystemExit(f"text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    stats = {p: {"nll": 0.0, "n": 0, "kld": [], "same": 0, "s": 0.0} for p in pairs}
    base_pair = "f16/f16"
    for c in range(n_chunks):
        ids = torch.tensor(tokens[c * ctx:(c + 1) * ctx], dtype=torch.int64)
        targets = ids[ctx // 2 + 1:]
        base = None
        for p in [base_pair] + [q for q in pairs if q != base_pair]:
            kt, vt = p.split("/")
            t = time.perf_counter()
            lp = chunk_logprobs(model, ids, kt, vt, ubatch)
            if base is None:
                base = lp
            if p not in stats:
                continue
            st = stats[p]
            st["s"] += time.perf_counter() - t
            print(f"  ctx {ctx} chunk {c}: {p} {st['s']:.1f} s", file=sys.stderr, flush=True)
            st["nll"] += -lp.gather(1, targets[:, None]).sum().item()
            st["n"] += targets.numel()
            st["kld"].append((base.exp() * (base - lp)).sum(-1).clamp_min(0))
            st["same"] += int((base.argmax(-1) == lp.argmax(-1)).sum())
    rows = []
    for p in pairs:
        st = stats[p]
        kld = torch.cat(st["kld"]).double()
        rows.append({"pair": p, "ctx": ctx, "chunks": n_chunks, "tokens_scored": st["n"],
                     "ppl": math.exp(st["nll"] / st["n"]), "kld_mean": kld.mean().item(),
                     "kld_p99": torch.quantile(kld, 0.99).item(), "same_top1": 100.0 * st["same"] / st["n"],
                     "seconds": st["s"]})
    return rows


def retrieval_accuracy(model, tok, cases: list[dict], pair: str, ubatch: int) -> dict[str, float]:
    """Share of cases per length whose answer sentence greedy decoding reproduces (teacher-forced, one pass)."""
    kt, vt = pair.split("/")
    hits: dict[int, list[bool]] = {}
    for c in cases:
        p_ids = tok.encode(c["prompt"], add_special=False)
        a_ids = tok.encode(c["answer"], add_special=False)
        hidden = prefill_hidden(model, torch.tensor(p_ids + a_ids, dtype=torch.int64), kt, vt, ubatch)
        pred = model.logits(hidden[len(p_ids) - 1:-1]).argmax(-1).tolist()
        hits.setdefault(c["target_tokens"], []).append(pred == a_ids)
    return {str(n): 100.0 * sum(v) / len(v) for n, v in sorted(hits.items())}


def load_cases(path: str, lengths: list[int], per_length: int) -> list[dict]:
    cases, count = [], {}
    for line in Path(path).read_text().splitlines():
        c = json.loads(line)
        n = c["target_tokens"]
        if n in lengths and count.get(n, 0) < per_length:
            count[n] = count.get(n, 0) + 1
            cases.append(c)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    ap.add_argument("--text", default="turbospec/data/eval/prose.jsonl")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512])
    ap.add_argument("--chunks", type=int, default=4, help="max chunks per context size")
    ap.add_argument("--pairs", nargs="+", default=PAIRS)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--retrieval", type=int, default=0, help="retrieval cases per length (0 = skip)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--cases", default="turbospec/data/eval/retrieval.jsonl")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from turbospec.engine import model_path
    from turbospec.tokenizer import Tokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_path(a.model)
    model = load_model(path, a.dtype)
    text = read_text(a.text)[:max(a.ctx) * a.chunks * 8]  # tokenizing only what the chunks can use
    tokens = Tokenizer(path).encode(text, add_special=False)
    print(f"model {path}, {a.dtype}; text {a.text}: {len(tokens)} tokens")
    rows = []
    for ctx in a.ctx:
        rows += evaluate(model, tokens, ctx, a.chunks, a.pairs, a.ubatch)
    print("| K/V | ctx | PPL | mean KLD | p99 KLD | same top-1 % |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['ctx']} | {r['ppl']:.4f} | {r['kld_mean']:.6f} | {r['kld_p99']:.6f} "
              f"| {r['same_top1']:.2f} |")
    retrieval = {}
    if a.retrieval:
        tok = Tokenizer(path)
        cases = load_cases(a.cases, a.lengths, a.retrieval)
        for p in a.pairs:
            t = time.perf_counter()
            retrieval[p] = retrieval_accuracy(model, tok, cases, p, a.ubatch)
            print(f"  retrieval {p}: {retrieval[p]} ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
        lens = sorted({c["target_tokens"] for c in cases})
        print(f"\nretrieval accuracy % ({a.retrieval} cases per length)")
        print("| K/V | " + " | ".join(str(n) for n in lens) + " |")
        print("|---|" + "---|" * len(lens))
        for p, acc in retrieval.items():
            print(f"| {p} | " + " | ".join(f"{acc[str(n)]:.0f}" for n in lens) + " |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": str(path), "text": a.text, "dtype": a.dtype, "ubatch": a.ubatch, "tokens": len(tokens),
                "retrieval_cases_per_length": a.retrieval}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows, "retrieval": retrieval}, indent=1))


if __name__ == "__main__":
    main()
