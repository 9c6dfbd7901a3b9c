"""Train the bundled model (trunk + MTP head jointly), time-boxed and resumable.

    python -m training --run runs/tiny --time-budget-min 80 --export models/turbospec-tiny

Progress (for the LR schedule and the sequence-length curriculum) is the fraction of the wall-clock
budget already used (or of --max-steps when no budget is given), so the run always finishes its
schedule and exports, whatever the machine's speed.  Checkpoints go to <run>/ckpt.pt every
--ckpt-every-min minutes; rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch

from .corpus import FAMILIES, CorpusError, load_corpus
from .data import BatchSampler, build_streams
from .export import export_model
from .induction_init import CircuitGuard, plant_induction_circuit
from .model import TrunkWithMTP, build_config, count_params
from .tokenizer import EOT, load_tokenizer, save_tokenizer, train_tokenizer

# (progress threshold, seq_len, batch[, share of sequences with a retrieval document[, share of sequences that
# repeat a window of real text]]) -- from short to long context; the retrieval share rises for the long phases
# (copying a value across 1K-4K tokens is the skill that forms last).  This is the shipped model's schedule;
# docs/bundled-model.md lists the copy-heavy variants tried since (multi-fact documents, repeated windows).
DEFAULT_CURRICULUM = [(0.0, 256, 4, 0.3), (0.20, 512, 2, 0.3), (0.45, 1024, 2, 0.6), (0.70, 2048, 1, 0.6),
                      (0.90, 4096, 1, 0.6)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/tiny", help="run directory (checkpoints, tokenizer, caches)")
    ap.add_argument("--arch", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=832)
    ap.add_argument("--linear-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--split-digits", action="store_true",
                    help="train the tokenizer with one token per digit (a run's cached tokenizer is reused; "
                         "one that merges digits is refused)")
    ap.add_argument("--induction-context", type=int, default=1, choices=[1, 2, 3],
                    help="with --induction-init: tokens the planted induction head matches (2 = current + previous)")
    ap.add_argument("--induction-offsets", default=None, metavar="O1,O2,...",
                    help="with --induction-init: which earlier tokens the induction head matches, e.g. 0,1,4 "
                         "(overrides --induction-context; 0 = the current token)")
    ap.add_argument("--induction-more-offsets", default=None, metavar="O1,O2,.../...",
                    help="with --induction-init: further induction heads (one per key-value group after the first), "
                         "each with its own offsets, sets separated by '/', e.g. 0,1,2")
    ap.add_argument("--induction-k", type=int, default=None,
                    help="with --induction-init: slow dims per matched token (default 32 // number matched)")
    ap.add_argument("--freeze-circuit", action="store_true",
                    help="with --induction-init: hold layers 0-1 (the planted circuit) fixed for the whole run")
    ap.add_argument("--keep-random-outputs", action="store_true",
                    help="with --induction-init: leave the other output projections at their random init")
    ap.add_argument("--rope-theta", type=float, default=100000.0)
    ap.add_argument("--induction-init", action="store_true",
                    help="dense qwen3 only: plant a previous-token + induction head circuit at initialisation "
                         "(training/induction_init.py; use with --rope-theta 1e8)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--p-retrieval", type=float, default=0.3,
                    help="share of sequences with a retrieval document (curriculum phases may override it)")
    ap.add_argument("--answer-weight", type=float, default=4.0,
                    help="loss weight of the answer tokens (with --max-facts > 1: of the tokens from the value on)")
    ap.add_argument("--max-facts", type=int, default=1,
                    help="facts (and questions) per retrieval document (1 = one fact: the shipped model's recipe)")
    ap.add_argument("--key-weight", type=float, default=1.0,
                    help="loss weight of the answer tokens that restate the fact's key from the question (account "
                         "number, project name) in multi-fact documents (--max-facts > 1)")
    ap.add_argument("--fact-families", default=None, metavar="NAME=W,...",
                    help="relative weights of the fact families in multi-fact documents (--max-facts > 1), e.g. "
                         "'account=3,budget=1.5'; unnamed families weigh 1 (default: uniform)")
    ap.add_argument("--time-budget-min", type=float, default=105.0, help="wall-clock training budget (0 = use --max-steps)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--curriculum", default=None,
                    help='JSON list of [progress, seq_len, batch(, p_retrieval(, p_repeat(, p_symbols(, n_symbols))))]')
    ap.add_argument("--symbol-pool", default="digits", choices=["digits", "frequent"],
                    help="symbols of the copy task: the most frequent digit tokens, or the most frequent tokens")
    ap.add_argument("--symbol-episodes", default=None, metavar="MIN,MAX",
                    help="copy task as short episodes back to back, half-length MIN..MAX (default: one repeat)")
    ap.add_argument("--ckpt-every-min", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=("none", "bf16"), default="none",
                    help="run forward/backward under CPU bfloat16 autocast (weights and optimizer stay fp32); "
                         "~1.5x faster on CPUs with AMX / AVX-512 BF16, much slower without them")
    ap.add_argument("--docs-dir", default=None, help="Python docs _sources dir (default: python3.11-doc package)")
    ap.add_argument("--code-dir", default=None, help="code root (default: this interpreter's stdlib)")
    ap.add_argument("--export", default=None, help="export the final model to this directory")
    ap.add_argument("--export-only", action="store_true", help="export the checkpoint in --run and exit")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def _phase(progress: float, curriculum):
    """The curriculum entry in force at `progress` (the last one whose threshold has been reached)."""
    cur = curriculum[0]
    for c in curriculum:
        if progress >= c[0]:
            cur = c
    return cur


def phase_at(progress: float, curriculum, p_retrieval: float = 0.3):
    """(seq_len, batch, retrieval share, repeat share, symbol-copy share) of the curriculum phase at `progress`."""
    cur = _phase(progress, curriculum)
    return (int(cur[1]), int(cur[2]), float(cur[3]) if len(cur) > 3 else p_retrieval,
            float(cur[4]) if len(cur) > 4 else 0.0, float(cur[5]) if len(cur) > 5 else 0.0)


def symbols_at(progress: float, curriculum) -> int | None:
    """Symbol-pool size of the curriculum phase at `progress` (element 6), None when the phase does not set it."""
    cur = _phase(progress, curriculum)
    return int(cur[6]) if len(cur) > 6 else None


def prepare(args):
    """Corpus, tokenizer (trained once, cached in the run dir) and token streams."""
    corpus = load_corpus(code_dir=args.code_dir, docs_dir=args.docs_dir)
    tok_dir = os.path.join(args.run, "tokenizer")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        tok = load_tokenizer(tok_dir)
        if args.split_digits and len(tok.encode("70").ids) != 2:
            raise SystemExit(f"--split-digits: {tok_dir} holds a tokenizer that merges digits (use a new --run)")
    else:
        tok = train_tokenizer(corpus.texts(), args.vocab, split_digits=args.split_digits)
        save_tokenizer(tok, tok_dir)
        tok = load_tokenizer(tok_dir)
    streams = build_streams(tok, corpus, os.path.join(args.run, "tokens.npz"))
    return corpus, tok, tok_dir, streams


def _offsets(text: str) -> tuple[int, ...]:
    """``"0,1,4"`` -> ``(0, 1, 4)`` (--induction-offsets, one set of --induction-more-offsets)."""
    return tuple(int(o) for o in text.split(","))


def _family_weights(text: str) -> tuple[float, ...]:
    """``"account=3,budget=1.5"`` -> weights in ``FAMILIES`` order, unnamed families 1."""
    given = {}
    for part in text.split(","):
        name, _, w = part.partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if name.strip() not in FAMILIES or weight < 0:
            raise SystemExit(f"--fact-families: expected NAME=WEIGHT with NAME in {', '.join(FAMILIES)} and WEIGHT >= 0, "
                             f"got {part!r}")
        given[name.strip()] = weight
    weights = tuple(given.get(f, 1.0) for f in FAMILIES)
    if not sum(weights):
        raise SystemExit("--fact-families: at least one family needs a weight above 0")
    return weights


def _fact_options(args) -> tuple[float, ...] | None:
    """Check --fact-families / --key-weight (before any slow work) and return the family weights."""
    if (args.fact_families or args.key_weight != 1.0) and args.max_facts < 2:
        raise SystemExit("--fact-families and --key-weight shape multi-fact documents: use them with --max-facts 2 "
                         "or more")
    return _family_weights(args.fact_families) if args.fact_families else None


def make_model(args, tok):
    cfg = build_config(args.arch, tok.get_vocab_size(), hidden=args.hidden, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                       eos_token_id=tok.token_to_id(EOT), linear_heads=args.linear_heads,
                       linear_head_dim=args.linear_head_dim, rope_theta=getattr(args, "rope_theta", 100000.0))
    cfg._attn_implementation = "sdpa"
    model = TrunkWithMTP(cfg, args.arch)
    if getattr(args, "induction_init", False):
        offs = getattr(args, "induction_offsets", None)
        more = getattr(args, "induction_more_offsets", None)
        offsets = _offsets(offs) if offs else tuple(range(getattr(args, "induction_context", 1)))
        more_offsets = tuple(_offsets(m) for m in more.split("/")) if more else ()
        k = getattr(args, "induction_k", None) or 32 // len(offsets)
        model.planted = plant_induction_circuit(model, seed=args.seed, offsets=offsets, k=k, more_offsets=more_offsets,
                                                zero_outputs=not getattr(args, "keep_random_outputs", False))
    return model


def save_ckpt(path, model, opt, sampler, meta):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state(),
                "torch_rng": torch.get_rng_state(), "meta": meta}, tmp)
    os.replace(tmp, path)


def _has_fast_bf16() -> bool:
    """True where the CPU has bfloat16 matrix instructions (AMX tiles or AVX-512 BF16)."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def main(argv=None):
    args = parse_args(argv)
    family_weights = _fact_options(args)
    os.makedirs(args.run, exist_ok=True)
    torch.set_num_threads(args.threads)
    if args.autocast == "bf16" and not _has_fast_bf16():
        print("warning: --autocast bf16 on a CPU without AMX / AVX-512 BF16 runs slower than fp32", flush=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:
        corpus, tok, tok_dir, streams = prepare(args)
    except CorpusError as e:
        raise SystemExit(f"error: {e}") from None
    curriculum = json.loads(args.curriculum) if args.curriculum else DEFAULT_CURRICULUM
    model = make_model(args, tok)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    guard = CircuitGuard(model) if args.induction_init and args.freeze_circuit else None
    sampler = BatchSampler(tok, corpus, streams, seed=args.seed, p_retrieval=args.p_retrieval,
                           answer_weight=args.answer_weight, max_facts=args.max_facts)
    sampler.symbol_pool = args.symbol_pool
    sampler.key_weight = args.key_weight
    sampler.family_weights = family_weights
    if args.symbol_episodes:
        lo, hi = (int(v) for v in args.symbol_episodes.split(","))
        sampler.symbol_episodes = (lo, hi)
    ckpt_path = os.path.join(args.run, "ckpt.pt")
    meta = {"step": 0, "elapsed_s": 0.0, "tokens": 0, "done": False, "history": [], "args": vars(args)}
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sampler.load_state(ck["sampler"])
        torch.set_rng_state(ck["torch_rng"])
        meta = ck["meta"]
        print(f"resumed from {ckpt_path}: step {meta['step']}, {meta['elapsed_s']/60:.1f} min, {meta['tokens']} tokens")
    if getattr(model, "planted", None):
        meta["induction_init"] = model.planted
    n_params = count_params(model)
    meta["params"] = n_params
    meta["trunk_params"] = count_params(model.lm)
    meta["corpus"] = corpus.summary()
    meta["train_tokens_available"] = {k: len(v) for k, v in streams.items()}
    print(f"params: {n_params/1e6:.2f}M (trunk {meta['trunk_params']/1e6:.2f}M), "
          f"train tokens: {meta['train_tokens_available']}")

    budget_s = args.time_budget_min * 60
    use_time = budget_s > 0
    # a finished run continues if given a larger budget (--time-budget-min / --max-steps)
    remaining = meta["elapsed_s"] < budget_s if use_time else meta["step"] < args.max_steps
    if not args.export_only and remaining:

        def progress():
            if use_time:
                return meta["elapsed_s"] / budget_s
            return meta["step"] / max(1, args.max_steps)

        from tqdm import tqdm

        bar = tqdm(total=int(budget_s) if use_time else args.max_steps, initial=int(meta["elapsed_s"]) if use_time else meta["step"],
                   unit="s" if use_time else "step", disable=args.no_progress, dynamic_ncols=True)
        last_ckpt = time.time()
        ema = None
        hits, seen = 0, 0
        model.train()
        while progress() < 1.0:
            t0 = time.time()
            seq_len, bsz, sampler.p_retrieval, sampler.p_repeat, sampler.p_symbols = phase_at(progress(), curriculum, args.p_retrieval)
            n_sym = symbols_at(progress(), curriculum)
            if n_sym is not None:
                sampler.set_symbols(n_sym)
            lr = lr_at(meta["step"], progress(), args)
            for g in opt.param_groups:
                g["lr"] = lr
            x, w = sampler.batch(bsz, seq_len)
            x = torch.from_numpy(x).long()
            w = torch.from_numpy(w)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
                loss, lm_loss, mtp_loss = model(x, mtp_weight=args.mtp_weight, weights=w)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if guard is not None:
                guard.restore()
            opt.zero_grad(set_to_none=True)
            dt = time.time() - t0
            meta["step"] += 1
            meta["elapsed_s"] += dt
            meta["tokens"] += bsz * seq_len
            ema = lm_loss.item() if ema is None else 0.95 * ema + 0.05 * lm_loss.item()
            hits, seen = hits + model.answer_acc[0], seen + model.answer_acc[1]
            if meta["step"] % 10 == 0:
                meta["history"].append({"step": meta["step"], "elapsed_s": round(meta["elapsed_s"], 1),
                                        "tokens": meta["tokens"], "seq_len": seq_len, "lr": lr,
                                        "lm_loss": round(lm_loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4),
                                        "grad_norm": round(float(gn), 3),
                                        "answer_acc": round(hits / seen, 3) if seen else None})
                hits, seen = 0, 0
            bar.set_postfix(step=meta["step"], seq=seq_len, lm=f"{ema:.3f}", mtp=f"{mtp_loss.item():.3f}",
                            lr=f"{lr:.2e}", tok=meta["tokens"], refresh=False)
            bar.update(int(meta["elapsed_s"]) - bar.n if use_time else 1)
            if args.no_progress and meta["step"] % 20 == 0:
                print(f"step {meta['step']} t={meta['elapsed_s']:.0f}s seq={seq_len} lm={ema:.3f} "
                      f"mtp={mtp_loss.item():.3f} lr={lr:.2e} tokens={meta['tokens']} "
                      f"answers={meta['history'][-1].get('answer_acc')}", flush=True)
            if time.time() - last_ckpt > args.ckpt_every_min * 60:
                meta["retrieval_docs"] = sampler.retrieval_docs
                meta["questions"] = sampler.questions
                save_ckpt(ckpt_path, model, opt, sampler, meta)
                last_ckpt = time.time()
        bar.close()
        meta["done"] = True
        meta["retrieval_docs"] = sampler.retrieval_docs
        meta["questions"] = sampler.questions
        save_ckpt(ckpt_path, model, opt, sampler, meta)
        print(f"training done: {meta['step']} steps, {meta['tokens']} tokens, {meta['elapsed_s']/60:.1f} min")

    with open(os.path.join(args.run, "train_meta.json"), "w") as f:
        json.dump(dict(meta), f, indent=1, default=str)
    if args.export:
        export_model(model, tok_dir, args.export, meta)
        print(f"exported to {args.export}")
    return model, meta


if __name__ == "__main__":
    main()
