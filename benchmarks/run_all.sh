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
for m in turbospec-tiny turbospec-tiny-hybrid; do
    kind=$([ "$m" = turbospec-tiny ] && echo dense || echo hybrid)
    python benchmarks/spec_speedup.py -m models/$m --dtype bfloat16 --categories code explain --edit 4 --gen 256 \
        --reps 5 --configs ngram-mod suffix "draft-mtp:n=3" "suffix,draft-mtp:n=3" \
        --out docs/results/spec_suffix_$kind.json
    python benchmarks/spec_speedup.py -m models/$m --categories code explain --edit 2 --gen 128 --reps 5 \
        --configs "draft-mtp:n=3" "draft-mtp:n=3,topk=2" "draft-mtp:n=6" "suffix,draft-mtp:n=3" \
        "suffix,draft-mtp:n=3,merge=1" --out docs/results/spec_trees_${m#turbospec-}.json
    python benchmarks/spec_speedup.py -m models/$m --categories code explain --gen 128 --reps 5 --temp 0.7 \
        --configs "draft-mtp:n=3,sample=0" "draft-mtp:n=3" "draft-mtp:n=3,topk=2,sample=0" "draft-mtp:n=3,topk=2" \
        --out docs/results/spec_sampling_${m#turbospec-}.json
done
python benchmarks/spec_speedup.py -m models/turbospec-tiny --categories code explain --edit 2 --gen 256 --reps 5 \
    --configs suffix ngram-mod "ngram-mod,draft-mtp:n=3" "suffix,draft-mtp:n=3" --out docs/results/spec_suffix_dense_f32.json
python benchmarks/spec_speedup.py -m models/turbospec-tiny --dtype bfloat16 --categories code explain --edit 4 --gen 256 \
    --reps 5 --repeat --configs suffix "suffix:shared=1" "suffix,draft-mtp:n=3,shared=1" \
    --out docs/results/spec_suffix_repeat.json
python benchmarks/kv_decode.py 600,4096 docs/results/kv_decode_vs_f16.json
