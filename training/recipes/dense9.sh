#!/bin/bash
# session 11: dense6's command under CPU bfloat16 autocast (this machine has AMX: ~1.5x the steps in the same
# time) plus --key-weight 4 (the restated account number / project name weighted 4x)
cd "$(dirname "$0")/../.."  # the repository root
python -m training --run runs/dense9 --arch qwen3 --rope-theta 1e12 --induction-init --induction-offsets 0,1,4 \
  --induction-k 14 --freeze-circuit --lr 1.5e-3 --time-budget-min 104 --no-progress --ckpt-every-min 5 --max-facts 3 \
  --symbol-pool frequent --symbol-episodes 8,32 --key-weight 4 --autocast bf16 \
  --curriculum '[[0.0,256,4,0.2,0.1,0.1,8192],[0.15,512,2,0.3,0.1,0.05,8192],[0.35,1024,1,0.45,0.05,0.05,8192],[0.6,2048,1,0.5,0.05,0.0],[0.88,4096,1,0.5,0.0,0.0]]' \
  --export runs/dense9/export
