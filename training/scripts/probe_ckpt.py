"""Probe a training checkpoint while the run goes on: in-context copying and a few retrieval cases.

    python -m training.scripts.probe_ckpt runs/dense1 --lengths 1024 --limit 10 --threads 1

Loads <run>/ckpt.pt (model only) and prints the copy probe (top-1 on a held-out code window and on its
repetition) and retrieval accuracy on the first --limit shipped cases per length.  Use one thread beside a
training run; it costs that run a little speed for ~30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import torch

from training.data import symbol_ids
from training.evaldata import default_eval_dir, load_jsonl
from training.evaluate import copy_probe, retrieval
from training.tokenizer import load_tokenizer
from training.train import make_model


@torch.no_grad()
def symbol_copy(model, run: str, tok, pools=(256, 8192), half: int = 16, n: int = 16) -> dict:
    """Top-1 on the second half of random-symbol episodes (the training copy task), per pool size."""
    z = np.load(os.path.join(run, "tokens.npz"))
    ranked = symbol_ids(tok, {k: z[k] for k in z.files}, "frequent", max(pools))
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in pools:
        pool = torch.tensor(ranked[:p])
        h = pool[torch.randint(0, len(pool), (n, half), generator=g)]
        x = torch.cat([h, h], 1)
        pred = model.lm(input_ids=x).logits.argmax(-1)
        out[str(p)] = round((pred[:, half:-1] == x[:, half + 1:]).float().mean().item(), 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ck = torch.load(os.path.join(a.run, "ckpt.pt"), map_location="cpu", weights_only=True)
    meta = ck["meta"]
    tok = load_tokenizer(os.path.join(a.run, "tokenizer"))
    model = make_model(SimpleNamespace(**meta["args"]), tok)
    model.load_state_dict(ck["model"])
    model.eval()
    t0 = time.time()
    code = [r["text"] for r in load_jsonl(os.path.join(default_eval_dir(), "code.jsonl"))]
    cases = load_jsonl(os.path.join(default_eval_dir(), "retrieval.jsonl"))
    cp = copy_probe(model, tok, code)
    sym = symbol_copy(model, a.run, tok)
    ret = retrieval(model, tok, cases, [int(x) for x in a.lengths.split(",")], a.limit)
    out = {"step": meta["step"], "minutes": round(meta["elapsed_s"] / 60, 1), "tokens": meta["tokens"],
           "copy_first": round(cp["first_copy_top1"], 3), "copy_second": round(cp["second_copy_top1"], 3),
           "symbols_second": sym,
           "retrieval": {k: (v["accuracy"], v["value_accuracy"], v["n"]) for k, v in ret.items()},
           "probe_s": round(time.time() - t0, 1)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
