#!/bin/bash
set -x
cd /work/main
while pgrep -f "turbospec.train --run runs/dense7 " >/dev/null; do sleep 10; done
test -f runs/dense7/export/model.safetensors || python -m turbospec.train --run runs/dense7 --export-only --export runs/dense7/export
rm -rf runs/dense7/final && cp -r runs/dense7/export runs/dense7/final
turbospec train-heads --kind mtp -m runs/dense7/final --text runs/mtp_distill/train.jsonl --steps 720 \
    --batch 8 --seq-len 256 --lr 5e-4 --minutes 14.5 --save-every 100 --eval-windows 16 -t 2 --no-progress > runs/dense7/mtp_distill.log 2>&1
date
python -m turbospec.train.evaluate runs/dense7/final --out runs/dense7/final_eval.json \
    --max-tokens 12000 --accept-prompts 4 --accept-tokens 48 --lengths 1024,2048,4096
echo FINALIZE_DONE
