"""Measure CPU training throughput (forward+backward+AdamW step) of candidate configs.

    python -m training.scripts.throughput --arch qwen3 qwen3_5_text --seq 2048 --steps 3
"""

import argparse
import time

import torch

from training.model import TrunkWithMTP, build_config, count_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["qwen3", "qwen3_5_text"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for arch in args.arch:
        torch.manual_seed(0)
        cfg = build_config(arch, 8192, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                           heads=args.hidden // 64, kv_heads=2)
        cfg._attn_implementation = "sdpa"
        m = TrunkWithMTP(cfg, arch)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        x = torch.randint(0, 8192, (args.batch, args.seq))
        times = []
        for _ in range(args.steps + 1):
            t = time.time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, _, _ = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.time() - t)
        dt = sum(times[1:]) / args.steps
        print(f"{arch}: params={count_params(m)/1e6:.2f}M (trunk {count_params(m.lm)/1e6:.2f}M) "
              f"seq={args.seq} bf16={args.bf16} step={dt:.2f}s tok/s={args.batch*args.seq/dt:.0f} first={times[0]:.2f}s",
              flush=True)


if __name__ == "__main__":
    main()
