"""How many steps until a freshly initialised model learns to copy (induction), on random-symbol sequences.

    python -m training.scripts.copy_formation --arch qwen3_5_text --layers 8 --hidden 256 --symbols 64 \\
        --batch 16 --half 32 --steps 900

Each sequence is `half` random symbols followed by the same symbols again; the second half is predictable only
by copying.  With a fixed `half` a head that looks back a fixed distance solves it; --episodes MIN,MAX puts
copy episodes of random half-length back to back, so only content matching (induction) does.
--induction-init starts the dense model with a planted induction circuit (training/induction_init.py).
Prints the LM loss and the top-1 accuracy on the copied tokens every --every steps.  Used to choose
a copy-forming warm-up for the bundled model (docs/bundled-model.md, "Why retrieval fails").
"""

from __future__ import annotations

import argparse
import time

import torch

from training.induction_init import plant_induction_circuit
from training.model import TrunkWithMTP, build_config


def batch(a, offset: int):
    """(tokens [B, 2*half], mask of the positions whose next token is a copy)."""
    if not a.episodes:
        half = torch.randint(0, a.symbols, (a.batch, a.half)) + offset
        mask = torch.zeros(a.batch, 2 * a.half - 1, dtype=torch.bool)
        mask[:, a.half:] = True
        return torch.cat([half, half], 1), mask
    lo, hi = (int(v) for v in a.episodes.split(","))
    n = 2 * a.half
    xs, ms = [], []
    for _ in range(a.batch):
        row, m = [], []
        while len(row) < n:
            k = int(torch.randint(lo, hi + 1, ()))
            h = (torch.randint(0, a.symbols, (k,)) + offset).tolist()
            row += h + h
            m += [False] * k + [True] * k
        xs.append(row[:n])
        ms.append(m[1:n])
    return torch.tensor(xs), torch.tensor(ms)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--symbols", type=int, default=64, help="distinct symbols (token ids 1000..1000+symbols)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--half", type=int, default=32)
    ap.add_argument("--episodes", default=None, metavar="MIN,MAX", help="random half-lengths, episodes back to back")
    ap.add_argument("--induction-init", action="store_true", help="dense only: plant the circuit (rope theta 1e8)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = build_config(a.arch, a.vocab, hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2, head_dim=a.hidden // 4,
                       intermediate=a.hidden * 3, linear_heads=4, linear_head_dim=a.hidden // 4,
                       rope_theta=1e8 if a.induction_init else 1e5)
    cfg._attn_implementation = "sdpa"
    model = TrunkWithMTP(cfg, a.arch)
    if a.induction_init:
        plant_induction_circuit(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    offset = 1000 if a.symbols + 1000 <= a.vocab else 0
    t0 = time.time()
    for step in range(a.steps):
        x, mask = batch(a, offset)
        loss, lm, _ = model(x, mtp_weight=0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.every == 0 or step == a.steps - 1:
            with torch.no_grad():
                pred = model.lm(input_ids=x).logits.argmax(-1)
                acc = (pred[:, :-1] == x[:, 1:])[mask].float().mean().item()
            print(f"step {step} loss {lm.item():.3f} copy top-1 {acc:.3f} t={time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
