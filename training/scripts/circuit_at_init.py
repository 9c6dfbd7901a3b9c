"""Compare planted induction circuits at initialisation (nothing trained): the table in docs/bundled-model.md,
"Session 8" and "Session 9".

    python -m training.scripts.circuit_at_init            # ~4 min on 2 cores
    python -m training.scripts.circuit_at_init --bf16     # the same under CPU bfloat16 autocast (session 11)
    python -m training.scripts.circuit_at_init --bf16 --circuits digits   # session 12: one token per digit

The session-8/9 table (``--circuits all``) tokenizes the shipped cases with the merged-digit tokenizer that
models/turbospec-tiny had until session 11 (the hybrid's, models/turbospec-tiny-hybrid); ``--circuits digits``
with the one-token-per-digit tokenizer of today's models/turbospec-tiny (session 12 ran it from runs/tokd/tokenizer,
the same file).

For each (offsets, rope theta, k): account-like rows (6 rows `R n1 n2 B1 B2 B3 C v1 v2 v3` sharing everything but
the account number and value, 16 documents, with ~10 or ~250 filler tokens per row) -- does the next token after
the asked row's prefix equal its first value token; random-token copy top-1 (from the 2nd / 6th token of the
repeat) at distance 0 and 3500; and the shipped 2K / 4K retrieval cases teacher-forced up to the value: first
value token / whole value right.  A 2-layer qwen3 (hidden 256, 4 / 2 heads x 64, vocab 8192; 6 / 2 heads where a
second induction head is planted) with the circuit planted and every other output zero.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from training.induction_init import plant_induction_circuit
from training.model import TrunkWithMTP, build_config
from training.tokenizer import load_tokenizer

# (offsets, rope theta, k, query heads, further induction heads' offsets)
CIRCUITS = [((0, 1), 1e8, 16, 4, ()), ((0, 1, 2), 1e12, 14, 4, ()), ((0, 1, 4), 1e12, 14, 4, ()),
            ((0, 3, 4), 1e12, 14, 4, ()), ((0, 4, 5), 1e12, 14, 4, ()),
            ((0, 1, 4), 1e12, 14, 6, ((0, 1, 2),)), ((0, 1, 4), 1e12, 14, 6, ((0, 1, 5),))]
# with one token per digit `Account 70 balance: 2...` reads `7 0 Ġb al ance : Ġ 2`: the account number is 5 and 6
# tokens before the first value digit
DIGIT_CIRCUITS = [((0, 1, 4), 1e12, 14, 4, ()), ((0, 1, 2), 1e12, 14, 4, ()), ((0, 1, 5), 1e12, 14, 4, ()),
                  ((0, 5, 6), 1e12, 14, 4, ()), ((0, 1, 2), 1e12, 14, 6, ((0, 5, 6),)),
                  ((0, 1, 5), 1e12, 14, 6, ((0, 1, 2),)), ((0, 1, 4), 1e12, 14, 6, ((0, 1, 2),))]
FAMILIES = ("passkey", "code", "secret", "budget", "account")


def model(offsets, theta, k, heads=4, more=()):
    cfg = build_config("qwen3", 8192, hidden=256, layers=2, heads=heads, kv_heads=2, head_dim=64, intermediate=256,
                       rope_theta=theta)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = TrunkWithMTP(cfg, "qwen3")
    plant_induction_circuit(m, offsets=offsets, k=k, more_offsets=more)
    return m.eval()


def account_docs(gap: int, g: torch.Generator, rows: int = 6, n_docs: int = 16):
    docs = []
    for _ in range(n_docs):
        nums = (torch.randperm(90, generator=g)[:rows] + 10).tolist()
        vals = torch.randint(100, 8192, (rows, 3), generator=g)
        ids = []
        for n, v in zip(nums, vals):
            ids += [11, 20 + n // 10, 20 + n % 10, 12, 13, 14, 15, *v.tolist()]
            ids += torch.randint(100, 8192, (gap // rows,), generator=g).tolist()
        n = nums[3]
        docs.append((torch.tensor(ids + [11, 20 + n // 10, 20 + n % 10, 12, 13, 14, 15]), int(vals[3, 0])))
    return docs


def copy_top1(m, gap: int, half: int = 48) -> list[float]:
    g = torch.Generator().manual_seed(1)
    h = torch.randint(100, 8192, (2, half), generator=g)
    x = torch.cat([h, torch.randint(100, 8192, (2, gap), generator=g), h], 1)
    pred = m.lm(input_ids=x).logits.argmax(-1)
    return [round((pred[:, -half + o:-1] == x[:, -half + o + 1:]).float().mean().item(), 3) for o in (1, 5)]


def shipped_cases(tok_dir: str, path="turbospec/data/eval/retrieval.jsonl"):
    tok = load_tokenizer(tok_dir)
    out = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r["target_tokens"] in (2048, 4096):
            i = r["answer"].index(r["value"])
            pre = tok.encode(r["prompt"] + r["answer"][:i]).ids
            out.append((r["family"], r["target_tokens"], tok.encode(r["prompt"] + r["answer"]).ids, len(pre)))
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", action="store_true", help="run the models under CPU bfloat16 autocast")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer of the shipped cases (default: models/turbospec-tiny-hybrid's merged digits for "
                         "--circuits all, models/turbospec-tiny's one token per digit for --circuits digits)")
    ap.add_argument("--circuits", choices=("all", "digits"), default="all",
                    help="all: the table of sessions 8/9; digits: the circuits compared for the digit tokenizer")
    args = ap.parse_args()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        if args.circuits == "all":
            compare(args.tokenizer or "models/turbospec-tiny-hybrid", CIRCUITS)
        else:
            compare(args.tokenizer or "models/turbospec-tiny", DIGIT_CIRCUITS)


def compare(tok_dir: str, circuits) -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(2)
    docs = {gap: account_docs(gap, g) for gap in (60, 1500)}
    cases = shipped_cases(tok_dir=tok_dir)
    for offsets, theta, k, heads, more in circuits:
        m = model(offsets, theta, k, heads, more)
        acct = {gap: sum(int(m.lm(input_ids=d[None]).logits[0, -1].argmax() == x) for d, x in ds)
                for gap, ds in docs.items()}
        first, whole = defaultdict(list), defaultdict(list)
        for fam, L, full, p in cases:
            x = torch.tensor(full)[None]
            ok = (m.lm(input_ids=x).logits[0].argmax(-1)[p - 1:len(full) - 1] == x[0, p:]).tolist()
            first[(L, fam)].append(ok[0])
            whole[(L, fam)].append(all(ok))
        print(f"offsets {offsets}{f' + {more}, {heads} heads' if more else ''} theta {theta:g} k {k}: account rows {acct} of 16; "
              f"copy {({gap: copy_top1(m, gap) for gap in (0, 3500)})}", flush=True)
        for L in (2048, 4096):
            fams = " ".join(f"{f} {sum(first[(L, f)])}/{sum(whole[(L, f)])}/{len(first[(L, f)])}" for f in FAMILIES)
            print(f"  shipped {L} (first/whole/n): {fams}; whole {sum(sum(whole[(L, f)]) for f in FAMILIES)}",
                  flush=True)


if __name__ == "__main__":
    main()
