"""Split a model's misses on the shipped `Account N balance:` retrieval cases into the two steps of the answer:
restating the account number from the question, and copying the balance from the document (each teacher-forced,
one forward pass per case).  Session 10 used it to compare dense6 and dense8 (docs/bundled-model.md).

    python -m training.scripts.account_keys models/turbospec-tiny runs/dense8/final
    python -m training.scripts.account_keys --eval runs/dense9/final_eval.json   # its generated account misses

With ``--eval`` it lists, from an evaluation's generated answers, each account miss whose restated number is
wrong: the number asked for, the number written, and whether that number is in any row of the document.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from training.evaldata import default_eval_dir, load_jsonl
from training.evaluate import forward_hidden, load_exported
from training.tokenizer import load_tokenizer, token_span


@torch.no_grad()
def account_steps(model_dir: str, limits: dict[int, int]) -> dict[int, tuple[int, int, int]]:
    """{length: (account cases, key restated, balance right)} over the first ``limits[length]`` cases per length."""
    model, tok = load_exported(model_dir).eval(), load_tokenizer(model_dir)
    seen: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for c in load_jsonl(f"{default_eval_dir()}/retrieval.jsonl"):
        n = c["target_tokens"]
        if n not in limits:
            continue
        seen[n] = seen.get(n, 0) + 1
        if seen[n] > limits[n] or c["family"] != "account":
            continue
        p_ids, enc = tok.encode(c["prompt"]).ids, tok.encode(c["answer"])
        _, logits = forward_hidden(model, torch.tensor([p_ids + enc.ids]))
        pred = logits[0, len(p_ids) - 1:-1].argmax(-1).tolist()
        key = c["answer"].split()[1]
        ks = c["answer"].index(" " + key) + 1
        vs = c["answer"].index(c["value"])
        row = out.setdefault(n, [0, 0, 0])
        row[0] += 1
        row[1] += all(pred[k] == enc.ids[k] for k in token_span(enc.offsets, ks, ks + len(key)))
        row[2] += all(pred[k] == enc.ids[k] for k in token_span(enc.offsets, vs, len(c["answer"])))
    return {n: tuple(v) for n, v in sorted(out.items())}


def wrong_keys(eval_path: str) -> list[tuple[str, str, str, bool]]:
    """(case id, number asked, number written, written number is in a document row) for each generated account
    answer of ``eval_path`` that restates the wrong number."""
    cases = {c["id"]: c for c in load_jsonl(f"{default_eval_dir()}/retrieval.jsonl")}
    out = []
    for res in json.loads(Path(eval_path).read_text())["retrieval"].values():
        for f in res["failures"]:
            if f["family"] != "account":
                continue
            c = cases[f["id"]]
            asked, got = c["answer"].split()[1], f["got"].split()[1]
            if asked != got:
                out.append((f["id"], asked, got, got in re.findall(r"Account (\d+)", c["prompt"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--eval", help="an evaluation's JSON (python -m training.evaluate --out)")
    ap.add_argument("--limits", default="1024:40,2048:40,4096:24", help="cases per length, as the model card counts")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not a.models and not a.eval:
        ap.error("give model directories and/or --eval FILE")
    torch.set_num_threads(a.threads)
    limits = {int(n): int(k) for n, k in (p.split(":") for p in a.limits.split(","))}
    if a.eval:
        for case, asked, got, in_doc in wrong_keys(a.eval):
            print(f"{case}: asked account {asked}, wrote {got} ({'in' if in_doc else 'in no row of'} the document)")
    for m in a.models:
        for n, (cases, keys, values) in account_steps(m, limits).items():
            print(f"{m} {n}: {cases} account cases, account number restated {keys}, balance right {values}")


if __name__ == "__main__":
    main()
