#!/bin/bash
# ship runs/dense6/final as models/turbospec-tiny; the session-3 hybrid moves to models/turbospec-tiny-hybrid
set -ex
cd /work/main
git mv models/turbospec-tiny models/turbospec-tiny-hybrid
sed -i -E 's#models/turbospec-tiny([^-]|$)#models/turbospec-tiny-hybrid\1#g' models/turbospec-tiny-hybrid/README.md models/turbospec-tiny-hybrid/medusa_config.json
mkdir -p models/turbospec-tiny
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json training_summary.json; do
  cp runs/dense6/final/$f models/turbospec-tiny/
done
cp runs/dense6/final_eval.json models/turbospec-tiny/eval.json
python -m turbospec.spec.draft_vocab --model models/turbospec-tiny
cmp models/turbospec-tiny/draft_vocab.json models/turbospec-tiny-hybrid/draft_vocab.json && echo "draft vocab identical to the hybrid's (same tokenizer, same training split)"
