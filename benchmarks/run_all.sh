#!/usr/bin/env bash
# Run the speed measurements one after another on an otherwise idle machine (two thread pools on two cores
# slow each other down by up to 100x: never run these beside another heavy process).
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/engine_speed.py --reps 5 --out docs/results/engine_speed.json
python benchmarks/kv_speed.py --steps 8 --threads 2 --out docs/results/kv_speed_2t.json
python benchmarks/hybrid_depth.py --threads 2 --steps 16 --out docs/results/hybrid_depth_2t.json
