#!/usr/bin/env bash
# GPU check, one run on a lent H200 (torch, triton and pytest preinstalled there; the few pure-
# Python packages missing there travel as wheels in .whl/, installed with --no-deps):
#     OUT=/some/dir scripts/gpu_check.sh
# 1. tests on CUDA: the Triton kernels at full size (tests/kernels: sliding windows and the
#    int8 packed-row decode with its full-precision window too), the engines on the Triton
#    backend against the torch backend (int8 with a window and a sliding window among them), the host tier of the KV cache with pinned host memory
#    (tests/runtime/test_kv_tiers.py, tests/engine/test_host_tier.py), the GPU memory metrics;
# 2. the kernel benchmarks (kernels/triton/bench.py);
# 3. the cuda-ipc KV handoff between two real processes (1k tokens of a Llama-3.1-8B-shaped KV);
# 4. what the host tier costs a decode step (python -m loadtest host-tier).
# Writes under $OUT (default ./out; at most 8 files come back): env.txt, pytest.log, bench.json,
# bench.log, cuda_ipc.log, host_tier.json, host_tier.log, summary.txt. Budget: under 6.5 minutes
# (pytest 170 s, bench 90 s, cuda-ipc 45 s, host tier 80 s). Exit status: the first failure.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 BATON_MKL_DISPATCH=stock
unset TRITON_INTERPRET  # the tests pick the interpreter only when CUDA is missing

if compgen -G ".whl/*.whl" >/dev/null; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
    echo "triton missing: installing triton only"
    "$PY" -m pip install -q triton || exit 1
fi

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
        2>&1 || true
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); \
print('triton', triton.__version__)"
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The tiny models, once, before any worker needs them (they travel in models/ when carried).
"$PY" -c "from tests.runtime.helpers import tiny_model_dir; tiny_model_dir('llama'); \
tiny_model_dir('mistral', window=24)" || exit 1

# Kernel compilation dominates the test time; spread it over processes when xdist is there.
parallel=()
if "$PY" -c "import xdist" 2>/dev/null; then
    parallel=(-n 8)
fi
start=$(date +%s)
timeout 170 "$PY" -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
    tests/kernels tests/runtime/test_triton_backend.py tests/runtime/test_kv_tiers.py \
    tests/engine/test_host_tier.py tests/test_metrics.py::test_cuda_device_exports_gpu_memory \
    -rs --durations=10 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit $test_rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"

start=$(date +%s)
timeout 90 "$PY" -m kernels.triton.bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench exit $bench_rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"

# The same-node GPU handoff (shared/kv_transfer/cuda_ipc.py): two processes, one CUDA IPC export.
start=$(date +%s)
timeout 45 "$PY" -m shared.kv_transfer.cuda_ipc --selftest 2>&1 | tee "$OUT/cuda_ipc.log"
ipc_rc=${PIPESTATUS[0]}
echo "cuda-ipc selftest exit $ipc_rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"

start=$(date +%s)
# The qwen2-0.5b preset's model is built on CPU on first use (models/qwen2-0.5b-qwen2, 1.4 GB).
timeout 240 "$PY" -m loadtest host-tier --out "$OUT/host_tier.json" 2>&1 \
    | tee "$OUT/host_tier.log"
tier_rc=${PIPESTATUS[0]}
echo "host tier bench exit $tier_rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"

tail -n 3 "$OUT/pytest.log" >>"$OUT/summary.txt"
for rc in "$test_rc" "$bench_rc" "$ipc_rc" "$tier_rc"; do
    if [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
done
exit 0
