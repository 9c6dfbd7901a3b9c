#!/bin/bash
set -x
cd /work/main
while pgrep -f "turbospec.train --run runs/dense6 " >/dev/null; do sleep 10; done
test -f runs/dense6/export/model.safetensors || python -m turbospec.train --run runs/dense6 --export-only --export runs/dense6/export
rm -rf runs/dense6/final && cp -r runs/dense6/export runs/dense6/final
turbospec train-heads --kind mtp -m runs/dense6/final --text runs/mtp_distill/train.jsonl --steps 720 \
    --batch 8 --seq-len 256 --lr 5e-4 --minutes 14.5 --save-every 100 --eval-windows 16 -t 2 --no-progress > runs/dense6/mtp_distill.log 2>&1
date
python -m turbospec.train.evaluate runs/dense6/final --out runs/dense6/final_eval.json \
    --max-tokens 12000 --accept-prompts 4 --accept-tokens 48 --lengths 1024,2048,4096
echo FINALIZE_DONE
