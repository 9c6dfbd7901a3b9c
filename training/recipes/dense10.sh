#!/bin/bash
# session 12: a tokenizer with one token per digit (--split-digits; the run copied runs/tokd/tokenizer, the one
# circuit_at_init.py was run with -- byte-identical to what --split-digits trains in a fresh run dir) and two planted induction
# heads: (0,1,5) reaches the account number's last digit from the first value digit (`7 0 Ġb al ance : Ġ`), (0,1,2)
# follows the digits inside a number; CPU bfloat16 autocast (AMX); otherwise dense6's command
cd "$(dirname "$0")/../.."  # the repository root
mkdir -p runs/dense10/tokenizer && cp runs/tokd/tokenizer/* runs/dense10/tokenizer/
python -m training --run runs/dense10 --split-digits --arch qwen3 --rope-theta 1e12 --induction-init \
  --induction-offsets 0,1,5 --induction-more-offsets 0,1,2 --heads 6 \
  --induction-k 14 --freeze-circuit --lr 1.5e-3 --time-budget-min 100 --no-progress --ckpt-every-min 5 --max-facts 3 \
  --symbol-pool frequent --symbol-episodes 8,32 --autocast bf16 \
  --curriculum '[[0.0,256,4,0.2,0.1,0.1,8192],[0.15,512,2,0.3,0.1,0.05,8192],[0.35,1024,1,0.45,0.05,0.05,8192],[0.6,2048,1,0.5,0.05,0.0],[0.88,4096,1,0.5,0.0,0.0]]' \
  --export runs/dense10/export
