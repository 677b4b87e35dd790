#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script (`make bench-gpu`):
#   1. the kernel and engine tests on CUDA (compiled Triton kernels against their references; every method
#      ingesting, saving, loading and answering on the GPU; the GPU keeping what the CPU keeps);
#   2. each Triton kernel against its PyTorch reference at 32K tokens (benchmarks/kernels.py);
#   3. ingestion overhead over a plain prefill on random weights of the default model's architecture
#      (benchmarks/random_weights.py: timing depends on shapes only), then of a Llama-3.1-8B shape;
#   4. follow-up latency (benchmarks/latency.py) on the default architecture's random weights, then from a cache
#      held in 4-bit codes against the same cache at the model's dtype.
# Each step has its own time limit and the script starts no step past GPU_CHECK_SECONDS, so that a short lease
# still brings back the first steps. Logs and tables go to OUT_DIR (at most 7 files).
#
#   benchmarks/gpu.sh [MODEL_DIR]     MODEL_DIR: config.json + tokenizer of the default model
#                                     (default: its converted directory from `make models`)
set -u
export HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu}
BUDGET=${GPU_CHECK_SECONDS:-3600}
LIKE=${1:-$(ls -d "${INFOKV_CACHE_DIR:-$HOME/.cache/infokv-rag}"/models/default-* 2>/dev/null | head -n 1)}
WORK=${GPU_CHECK_WORKDIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"

if [ -z "$LIKE" ] || [ ! -f "$LIKE/config.json" ]; then
    echo "no model directory with config.json: run 'make models' or pass one" >&2
    exit 2
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU: these checks need one (the CPU suite is 'make test')" >&2
    exit 2
fi

# step NAME LIMIT_SECONDS LOG COMMAND...: run COMMAND under LIMIT, append its output to LOG, its outcome to SUMMARY.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local elapsed=$(($(date +%s) - START))
    if [ "$elapsed" -ge "$BUDGET" ]; then
        echo "$name: not started (${elapsed} s past, budget ${BUDGET} s)" | tee -a "$SUMMARY"
        return
    fi
    echo "== $name" >>"$log"
    local began=$(date +%s)
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $(($(date +%s) - began)) s" | tee -a "$SUMMARY"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
} >"$SUMMARY" 2>&1

step tests 300 "$OUT_DIR/tests.log" $PY -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py tests/test_cuda.py \
    tests/test_models.py::test_dtype_names_and_default_placement
step kernels 180 "$OUT_DIR/kernels.md" $PY benchmarks/kernels.py --repeats 5
step random-default 120 "$OUT_DIR/overhead.md" $PY -m benchmarks.random_weights --like "$LIKE" --out "$WORK/default"
step overhead-default 180 "$OUT_DIR/overhead.md" $PY benchmarks/overhead.py --model "$WORK/default" \
    --tokens 1024 4096 16384 --repeats 2 --variants infokv infokv_4bit snapkv infokv_quality kvzip
step latency-default 120 "$OUT_DIR/latency.md" $PY benchmarks/latency.py --model "$WORK/default" --repeats 3 \
    --reprefills 3
step latency-codes 120 "$OUT_DIR/latency.md" $PY benchmarks/latency.py --model "$WORK/default" --repeats 3 \
    --keep 0.8 --recall 0 --stored-bits 4
step random-8b 180 "$OUT_DIR/overhead-8b.md" $PY -m benchmarks.random_weights --like "$LIKE" --shape llama-3.1-8b \
    --out "$WORK/llama-8b"
step overhead-8b 300 "$OUT_DIR/overhead-8b.md" $PY benchmarks/overhead.py --model "$WORK/llama-8b" \
    --tokens 1024 4096 16384 --repeats 2 --variants infokv snapkv kvzip
# Last: in the first run (2026-12-04) a 32K-token row did not finish within 240 s; the profile says where.
step overhead-32k 240 "$OUT_DIR/overhead-32k.md" $PY benchmarks/overhead.py --model "$WORK/default" --tokens 32000 \
    --repeats 1 --variants infokv --profile
echo "total $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
