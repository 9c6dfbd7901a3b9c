"""Build the random-weight Qwen3 benchmark model (hidden 512, 8 layers, vocab 32000; 40.5M params) locally."""

import argparse

from turbospec.demo import make_demo_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/demo-qwen3")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(make_demo_model(a.out, a.seed))
