#!/bin/bash
# usage: ship.sh RUN -- ship runs/RUN/final (after finalize.sh RUN) as the default models/turbospec-tiny:
# copies the weights, tokenizer and training summary, its held-out evaluation as eval.json, and rebuilds the MTP
# draft vocabulary; then write the card with python -m training.scripts.write_card (see docs/bundled-model.md)
set -ex
run=runs/${1:?usage: ship.sh RUN}
cd "$(dirname "$0")/../.."  # the repository root
test -f $run/final_eval.json
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json training_summary.json; do
  cp $run/final/$f models/turbospec-tiny/
done
cp $run/final_eval.json models/turbospec-tiny/eval.json
python -m training.draft_vocab --model models/turbospec-tiny
git diff --stat models/turbospec-tiny
