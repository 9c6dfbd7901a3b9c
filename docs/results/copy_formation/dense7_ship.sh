#!/bin/bash
# ship runs/dense7/final as models/turbospec-tiny (replaces session 8's dense6; the hybrid stays in models/turbospec-tiny-hybrid)
set -ex
cd /work/main
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json training_summary.json; do
  cp runs/dense7/final/$f models/turbospec-tiny/
done
cp runs/dense7/final_eval.json models/turbospec-tiny/eval.json
python -m turbospec.spec.draft_vocab --model models/turbospec-tiny
cmp models/turbospec-tiny/draft_vocab.json models/turbospec-tiny-hybrid/draft_vocab.json && echo "draft vocab identical to the hybrid's (same tokenizer, same training split)"
