"""`python -m training.heads`: graft Medusa heads onto a frozen base by self-distillation.

The base runs over random windows of a text corpus (turbospec's own forward, inference mode); its final-normed
hidden states are detached and the heads train on them in autograd. Labels come from the base itself: head i at
position t learns the base's greedy token at t+1+i (the token the base would emit after position t+1+i), i.e.
token t+2+i -- or, with --loss kl, the base's whole distribution there. AdamW, cosine schedule with warmup,
a tqdm progress bar, and checkpoints every --save-every steps (heads + optimizer state) so --resume continues.

    python -m training.heads -m models/turbospec-tiny-hybrid --text corpus.txt --steps 400 --seq-len 256
    turbospec run -m models/turbospec-tiny-hybrid --spec-type medusa --temp 0 -p "def f(x):"

Output: medusa_config.json + medusa_heads.safetensors in --out (default: the model directory, where
`turbospec run --spec-type medusa` looks), plus medusa_train_state.pt (optimizer state, for --resume).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from turbospec.engine import model_path
from turbospec.errors import TurboSpecError
from turbospec.speculative.medusa import CONFIG_NAME, MedusaHeads, load_heads, save_heads

STATE_NAME = "medusa_train_state.pt"


# ---- data --------------------------------------------------------------------------------------------------
def read_texts(files: list[str]) -> list[str]:
    """Plain text files (one document each) or .jsonl files with a "text" field per line."""
    docs = []
    for f in files:
        p = Path(f)
        try:
            raw = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise TurboSpecError(f"cannot read --text {f}: {e}") from None
        if p.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    t = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError):
                    raise TurboSpecError(f"{f}:{n}: not a JSON object") from None
                if isinstance(t, str) and t:
                    docs.append(t)
        elif raw:
            docs.append(raw)
    if not docs:
        raise TurboSpecError("--text: no text found")
    return docs


def token_stream(tok, docs: list[str], sep: int | None) -> torch.Tensor:
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d, add_special=False)
        if sep is not None:
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.int64)


def train_eval_streams(tok, texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train stream, eval stream, corpus tokens) of the --text files: documents joined by the tokenizer's eos, the
    last 10% held out for the eval windows when that is at least one window long (else both are the whole stream)."""
    eos = min(tok.eos_ids) if tok.eos_ids else None
    stream = token_stream(tok, read_texts(texts), eos)
    if stream.numel() < seq_len + 1:
        raise TurboSpecError(f"train-heads: the corpus has {stream.numel()} tokens, fewer than --seq-len {seq_len}")
    cut = int(stream.numel() * 0.9)
    if stream.numel() - cut >= seq_len:
        return stream[:cut], stream[cut:], stream.numel()
    return stream, stream, stream.numel()


def windows(stream: torch.Tensor, n: int, seq_len: int, g: torch.Generator) -> list[torch.Tensor]:
    hi = max(1, stream.numel() - seq_len + 1)
    starts = torch.randint(0, hi, (n,), generator=g).tolist()
    return [stream[s:s + seq_len] for s in starts]


# ---- the base's features -------------------------------------------------------------------------------------
def base_features(model, ids: torch.Tensor, want_logp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One window through the frozen base: (hidden [T, H] float32, greedy next tokens [T], log-probs [T, V])."""
    from turbospec.kv.plan import AttentionPlan

    cache = model.new_cache(ids.numel())
    with torch.inference_mode():
        h = model.forward(ids, AttentionPlan.causal(0, ids.numel()), cache)
        logits = model.logits(h)
        labels = logits.argmax(-1)
        logp = F.log_softmax(logits, -1) if want_logp else None
    # clone outside inference mode: normal tensors that autograd may save
    return h.float().clone(), labels.clone(), logp.clone() if logp is not None else None


def head_losses(heads: MedusaHeads, feats, loss: str) -> tuple[torch.Tensor, list[float], list[float]]:
    """Mean over windows of sum_i w_i * loss_i (w_i = 0.8^i); also per-head loss and top-1 agreement."""
    total = torch.zeros(())
    per_loss = [0.0] * heads.num_heads
    per_acc = [0.0] * heads.num_heads
    for h, labels, logp in feats:
        T = h.shape[0]
        for i in range(heads.num_heads):
            n = T - 1 - i
            if n <= 0:
                continue
            out = heads.head_logits(i, h[:n])
            if loss == "kl":
                li = F.kl_div(F.log_softmax(out, -1), logp[1 + i:1 + i + n], log_target=True, reduction="batchmean")
            else:
                li = F.cross_entropy(out, labels[1 + i:1 + i + n])
            total = total + (0.8 ** i) * li
            per_loss[i] += float(li.detach()) / len(feats)
            per_acc[i] += float((out.detach().argmax(-1) == labels[1 + i:1 + i + n]).float().mean()) / len(feats)
    return total / len(feats), per_loss, per_acc


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ---- training ------------------------------------------------------------------------------------------------
def train_heads(model_path: str, texts: list[str], out: str | None = None, *, steps: int = 400, seq_len: int = 256,
                batch: int = 4, lr: float = 1e-3, weight_decay: float = 0.0, num_heads: int = 3,
                num_layers: int = 1, shared_head: bool = False, loss: str = "ce", save_every: int = 100,
                resume: bool = False, seed: int = 0, eval_windows: int = 4, dtype: str = "float32",
                progress: bool = True, log=None) -> dict:
    """Train Medusa heads on a frozen base; returns a summary with the eval loss/accuracy before and after."""
    from turbospec.model import load_model
    from turbospec.tokenizer import Tokenizer

    log = log or (lambda s: print(s, file=sys.stderr))
    if steps < 1 or seq_len < 2 + num_heads or batch < 1 or num_heads < 1 or num_layers < 0:
        raise TurboSpecError("train-heads: need steps >= 1, batch >= 1, heads >= 1, seq-len >= heads + 2")
    if loss not in ("ce", "kl"):
        raise TurboSpecError("--loss must be ce or kl")
    model = load_model(model_path, dtype)  # every model family has an lm_head (the Model protocol)
    out_dir = Path(out or model_path)
    train_s, eval_s, n_tokens = train_eval_streams(Tokenizer(model_path), texts, seq_len)
    cfg = model.cfg
    lm_w = model.lm_head.weight.float()
    state_path = out_dir / STATE_NAME
    start = 0
    if resume:
        if not state_path.exists() or not (out_dir / CONFIG_NAME).exists():
            raise TurboSpecError(f"--resume: no checkpoint ({STATE_NAME}) in {out_dir}")
        heads = load_heads(out_dir, cfg.hidden_size, cfg.vocab_size, lm_w)
        heads.float()
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        start = int(state["step"])
        num_heads, num_layers, shared_head = heads.num_heads, heads.num_layers, heads.shared_head
    else:
        torch.manual_seed(seed)
        heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers, shared_head, lm_w)
        state = None
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    if state is not None:
        opt.load_state_dict(state["optim"])
    warmup = max(1, min(50, steps // 10))
    want_logp = loss == "kl"

    eg = torch.Generator().manual_seed(seed + 12345)
    eval_feats = [base_features(model, w, True) for w in windows(eval_s, eval_windows, seq_len, eg)]

    def evaluate() -> tuple[float, list[float], list[float]]:
        with torch.no_grad():
            tot, pl, pa = head_losses(heads, eval_feats, loss)
        return float(tot), pl, pa

    before = evaluate()
    log(f"train-heads: {cfg.arch} H={cfg.hidden_size} V={cfg.vocab_size}, {num_heads} heads x {num_layers} "
        f"layers ({'shared lm_head' if shared_head else 'own heads'}), corpus {n_tokens} tokens, "
        f"steps {start}->{steps}, eval loss {before[0]:.4f} acc {_fmt(before[2])}")

    def checkpoint(step: int, last_loss: float) -> None:
        save_heads(out_dir, heads, {"trained_steps": step, "base_model": str(model_path), "loss": loss,
                                    "seq_len": seq_len, "train_loss": round(last_loss, 5)})
        tmp = state_path.with_suffix(".tmp")
        torch.save({"step": step, "optim": opt.state_dict(), "seed": seed}, tmp)
        tmp.replace(state_path)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, desc="train-heads", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    last = float("nan")
    heads.train()
    for step in range(start, steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # resumable: batch depends on the step only
        feats = [base_features(model, w, want_logp) for w in windows(train_s, batch, seq_len, g)]
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr, warmup)
        total, per_loss, _ = head_losses(heads, feats, loss)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        last = float(total.detach())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{last:.3f}", h0=f"{per_loss[0]:.3f}")
        if save_every > 0 and (step + 1) % save_every == 0 and step + 1 < steps:
            checkpoint(step + 1, last)
    if bar is not None:
        bar.close()
    heads.eval()
    if start < steps or not (out_dir / CONFIG_NAME).exists():
        checkpoint(steps, last)
    after = evaluate()
    summary = {"out": str(out_dir), "steps": steps, "start_step": start, "seconds": time.perf_counter() - t0,
               "eval_loss_before": before[0], "eval_loss_after": after[0],
               "head_loss_before": before[1], "head_loss_after": after[1],
               "head_acc_before": before[2], "head_acc_after": after[2], "corpus_tokens": int(n_tokens)}
    log(f"train-heads: eval loss {before[0]:.4f} -> {after[0]:.4f}, top-1 agreement with the base per head "
        f"{_fmt(before[2])} -> {_fmt(after[2])}; saved to {out_dir}")
    return summary


def _fmt(xs: list[float]) -> str:
    return "[" + ",".join(f"{x:.2f}" for x in xs) + "]"


# ---- command line ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.heads",
        description="Self-distil Medusa heads onto a frozen base: head i learns the base's greedy token t+2+i "
                    "from the base's hidden state at t. Writes medusa_config.json + medusa_heads.safetensors.")
    p.add_argument("-m", "--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--text", nargs="+", required=True, help="training text files (.txt, or .jsonl with 'text')")
    p.add_argument("--out", default=None, help="output directory (default: the model directory)")
    p.add_argument("--kind", choices=["medusa", "mtp"], default="medusa",
                   help="medusa: new Medusa heads; mtp: self-distil the checkpoint's own MTP module (mtp.*) toward "
                        "its frozen base, in place (needs transformers)")
    p.add_argument("--num-heads", type=int, default=3, help="Medusa heads (default 3)")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (default 1)")
    p.add_argument("--shared-head", action="store_true",
                   help="reuse the model's lm_head for every head (train only the residual blocks; smaller files)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps in total (default 400)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window (default 256)")
    p.add_argument("--batch", type=int, default=4, help="windows per step (default 4)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 medusa, 3e-4 mtp)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--loss", choices=["ce", "kl"], default=None,
                   help="ce: the base's greedy tokens as labels; kl: its full distribution (default ce medusa, kl mtp)")
    p.add_argument("--minutes", type=float, default=None, help="mtp: stop after this much training time")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--eval-windows", type=int, default=4, help="held-out windows for the eval loss (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="dtype of the frozen base (default float32)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except TurboSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    path = model_path(args.model)
    if args.threads is not None:
        if args.threads <= 0:
            raise TurboSpecError("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.kind == "mtp":
        from training.mtp import train_mtp

        if args.out:
            raise TurboSpecError("--kind mtp trains the checkpoint's mtp.* in place; --out is not supported")
        summary = train_mtp(
            path, args.text, steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr or 3e-4,
            loss=args.loss or "kl", save_every=args.save_every, resume=args.resume, seed=args.seed,
            eval_windows=args.eval_windows, minutes=args.minutes, progress=not args.no_progress,
        )
    else:
        summary = train_heads(
            path, args.text, args.out, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
            lr=args.lr or 1e-3, weight_decay=args.weight_decay, num_heads=args.num_heads,
            num_layers=args.num_layers, shared_head=args.shared_head, loss=args.loss or "ce",
            save_every=args.save_every, resume=args.resume, seed=args.seed, eval_windows=args.eval_windows,
            dtype=args.dtype, progress=not args.no_progress,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
