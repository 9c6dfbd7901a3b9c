#!/bin/bash
# session 9: dense6 + 6 query heads (look-back 1-5 in layer 0) and a second induction head matching offsets 0,1,2
cd "$(dirname "$0")/../.."  # the repository root
python -m training --run runs/dense7 --arch qwen3 --rope-theta 1e12 --induction-init --induction-offsets 0,1,4 \
  --induction-k 14 --heads 6 --induction-more-offsets 0,1,2 --freeze-circuit --lr 1.5e-3 --time-budget-min 104 --no-progress --ckpt-every-min 5 --max-facts 3 \
  --symbol-pool frequent --symbol-episodes 8,32 \
  --curriculum '[[0.0,256,4,0.2,0.1,0.1,8192],[0.15,512,2,0.3,0.1,0.05,8192],[0.35,1024,1,0.45,0.05,0.05,8192],[0.6,2048,1,0.5,0.05,0.0],[0.88,4096,1,0.5,0.0,0.0]]' \
  --export runs/dense7/export
