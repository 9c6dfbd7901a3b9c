#!/usr/bin/env bash
# The GPU check (issue #28): on a fresh CUDA machine with only this repository, install turbospec (no downloads),
# run the GPU tests file by file (each file's report printed before the next starts), time the Triton kernels
# alone, then measure a Qwen3.6-27B-shaped model through the engine. Writes OUTDIR/tests.log, OUTDIR/kernels.json,
# OUTDIR/gpu_check.json (each row as it comes), OUTDIR/gpu_check.md and OUTDIR/bench.log. About 8 minutes on an
# H200; the limits below keep it there.
#
#     bash benchmarks/gpu_check.sh [OUTDIR] [gpu_check.py options...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check_out}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TURBOSPEC_NO_KERNEL=1  # the CPU reference runs torch's ops: no C++ build on this machine
py=${PYTHON:-python3}
start=$(date +%s)
# the engine's own dependencies are on such machines; the server's and GGUF export's are not needed here
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || export PYTHONPATH=$PWD
$py - <<'PY' 2>&1 | tee "$out/env.log"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton missing")
PY
for f in tests/test_gpu.py tests/test_triton_attention.py tests/test_triton_encode.py tests/test_triton_deltanet.py \
    tests/test_triton_norm.py tests/test_triton_packed.py tests/test_triton_moe.py; do
    timeout "${GPU_TEST_TIMEOUT:-90}" $py -m pytest -q -p no:cacheprovider --timeout=60 --tb=short "$f" 2>&1 \
        | tee -a "$out/tests.log" | tail -15
done
echo "tests: $(( $(date +%s) - start )) s" | tee -a "$out/tests.log"
timeout "${GPU_KERNEL_TIMEOUT:-60}" $py benchmarks/gpu_kernels.py --reps 10 --out "$out/kernels.json" >"$out/kernels.log" 2>&1
timeout "${GPU_BENCH_TIMEOUT:-200}" $py benchmarks/gpu_check.py --gen 16 --reps 2 --out "$out/gpu_check.json" \
    --md "$out/gpu_check.md" "$@" 2>&1 | tee "$out/bench.log" | grep -v '^ \|^-'
echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/bench.log"
