#!/usr/bin/env bash
# Run the speed measurements one after another on an otherwise idle machine (two thread pools on two cores
# slow each other down by up to 100x: never run these beside another heavy process).
# LLAMA_BENCH=<path of llama.cpp's llama-bench> adds llama.cpp to the engine-core comparison (docs/speed.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/engine_speed.py --reps 5 ${LLAMA_BENCH:+--llama-bench "$LLAMA_BENCH"} --out docs/results/engine_speed.json
python benchmarks/kv_speed.py --steps 11 --threads 2 --out docs/results/kv_speed.json
python benchmarks/hybrid_depth.py --threads 2 --steps 16 --out docs/results/hybrid_depth_2t.json
# the commands of docs/speculative.md, each writing the results file the docs cite
python benchmarks/spec_speedup.py -m models/turbospec-tiny --categories code explain \
    --configs "draft-mtp:n=3" "ngram-mod,draft-mtp:n=3" --reps 9 --out docs/results/spec_speedup_dense.json
python benchmarks/spec_speedup.py -m models/turbospec-tiny-hybrid --categories code explain summarize qa_factual \
    --configs "draft-mtp:n=1" "draft-mtp:n=2" "draft-mtp:n=3,vocab=0" "draft-mtp:n=3" "draft-mtp:n=3,vocab=512" \
    "ngram:n=3" "ngram-mod,draft-mtp:n=3" "medusa:n=3" --reps 7 --out docs/results/spec_speedup.json
python benchmarks/spec_prefill.py --model models/turbospec-tiny-hybrid --lengths 512 2048 --windows 0 -1 256 \
    --reps 5 --gen 64 --threads 2 --out docs/results/spec_prefill.json
