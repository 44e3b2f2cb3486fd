#!/usr/bin/env bash
# GPU check for the Triton backend. Needs no network: only this checkout, torch and triton.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_results)
#
# Writes into OUT_DIR:
#   env.txt                   date, GPU name and capability, torch / triton / CUDA versions
#   triton_tests.log          tests/test_triton_backend.py compiled on the GPU (bf16, fp16,
#                             no-host-sync, CUDA graph, autotune cache) and tests/test_compile_cuda.py
#                             (torch.compile with device split sizes: no sync, CUDA graph capture)
#                             and tests/test_weight_layout_cuda.py (in_out weights, GPT-OSS block)
#   info.log                  python -m fusible_ops info
#   bench_default.log/.json   bench at the default shape, fused path forced to backend "triton"
#   bench_large.log/.json     bench at 8 experts, hidden 4096, ffn 14336, 32768 rows
#   recipes_cuda.log          tests/test_recipes_cuda.py (the scaled_grouped_mm engine against
#                             the emulation), then bench --recipe rowwise and mxfp8 on the GPU
#                             (time and saved bytes against bf16)
#   cuda_suite.log            the whole test suite (only with GPU_CHECK_SUITE=1)
#   summary.txt               one line per step with its exit status
# Exit status: 0 when every step passed.
#
# Sized for one 10-minute device command: the default steps' limits add up to 560 s and
# write 8 files (the most a device run hands back). Environment knobs:
# GPU_CHECK_REPEATS (bench rounds, default 10), GPU_CHECK_SUITE=1 (also run the whole
# suite, GPU_CHECK_SUITE_TIMEOUT seconds, default 300).
set -u -o pipefail

OUT_DIR="${1:-${OUT:-gpu_check_results}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."

unset TRITON_INTERPRET  # compiled kernels: the interpreter would run CUDA tensors on the host
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
REPEATS="${GPU_CHECK_REPEATS:-10}"
SUITE_TIMEOUT="${GPU_CHECK_SUITE_TIMEOUT:-300}"
status=0
: > "$OUT_DIR/summary.txt"

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc (${limit}s limit, took $((SECONDS - start))s)" | tee -a "$OUT_DIR/summary.txt"
    tail -n 25 "$OUT_DIR/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1 || true
    python - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as error:
    print("triton missing:", error)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
else:
    print("CUDA is not available")
EOF
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

step triton_tests 180 python -m pytest -q -p no:cacheprovider -rs tests/test_triton_backend.py \
    tests/test_compile_cuda.py tests/test_weight_layout_cuda.py
step info 30 python -m fusible_ops info

# The bench's fused and unfused variants run with the backend forced to "triton"
# (grouped_mm and dense are independent of the backend setting).
bench() {  # bench NAME LIMIT_S [shape flags...]
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python -m fusible_ops bench --device cuda --backend triton --repeats "$REPEATS" \
        --json "$OUT_DIR/$name.json" "$@"
}
bench bench_default 80
bench bench_large 120 --experts 8 --hidden 4096 --ffn 14336 --rows 32768

# low-precision recipes: the scaled_grouped_mm engine against the emulation (not yet run on a
# GPU), then each recipe's time and saved bytes against bf16 at the default shape
recipes_cuda() {
    python -m pytest -q -p no:cacheprovider -rs tests/test_recipes_cuda.py
    local rc=$?
    for recipe in rowwise mxfp8; do
        python -m fusible_ops bench --device cuda --recipe "$recipe" --repeats "$REPEATS" || rc=1
    done
    return "$rc"
}
export -f recipes_cuda
export REPEATS
step recipes_cuda 150 bash -c recipes_cuda

if [ "${GPU_CHECK_SUITE:-0}" = "1" ]; then
    step cuda_suite "$SUITE_TIMEOUT" python -m pytest -q -p no:cacheprovider -rs tests
fi

echo "results in $OUT_DIR (status $status)"
exit "$status"
