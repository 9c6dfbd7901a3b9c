#!/bin/bash
# usage: finalize.sh RUN (dense6 in session 8, dense7 in session 9) -- waits for the trunk of runs/RUN to finish,
# then 14.5 min of MTP self-distillation onto it and the evaluation on the shipped held-out texts
set -x
run=runs/${1:?usage: finalize.sh RUN}
cd "$(dirname "$0")/../.."  # the repository root
while pgrep -f "training --run $run " >/dev/null; do sleep 10; done
test -f $run/export/model.safetensors || python -m training --run $run --export-only --export $run/export
rm -rf $run/final && cp -r $run/export $run/final
python -m training.heads --kind mtp -m $run/final --text runs/mtp_distill/train.jsonl --steps 720 \
    --batch 8 --seq-len 256 --lr 5e-4 --minutes 14.5 --save-every 100 --eval-windows 16 -t 2 --no-progress > $run/mtp_distill.log 2>&1
date
python -m training.evaluate $run/final --out $run/final_eval.json \
    --max-tokens 12000 --accept-prompts 4 --accept-tokens 48 --lengths 1024,2048,4096
echo FINALIZE_DONE
