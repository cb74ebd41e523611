#!/usr/bin/env bash
# GPU check: the kernel tests compiled for the GPU at full size, the kernel benchmarks, and the
# cuda-ipc KV handoff between two real processes (1k tokens of a Llama-3.1-8B-shaped KV, bf16:
# bytes checked equal, time per handoff). Meant for a lent H200 (torch + triton preinstalled):
#     OUT=/some/dir scripts/gpu_check.sh
# Writes under $OUT (default ./out): env.txt, pytest.xml, pytest.log, bench.json, bench.log,
# cuda_ipc.log. Budget: under 7 minutes (pytest 240 s, bench 100 s, cuda-ipc 60 s). Exit status:
# the first failure of pytest, the bench, the cuda-ipc check.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the tests pick the interpreter only when CUDA is missing

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
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Kernel compilation dominates the test time; spread it over processes when xdist is there.
parallel=()
if "$PY" -c "import xdist" 2>/dev/null; then
    parallel=(-n 6)
fi
start=$(date +%s)
timeout 240 "$PY" -m pytest tests/kernels -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
    --junitxml="$OUT/pytest.xml" --durations=10 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit $test_rc after $(($(date +%s) - start)) s"

start=$(date +%s)
timeout 100 "$PY" -m kernels.bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench exit $bench_rc after $(($(date +%s) - start)) s"

# The same-node GPU handoff (shared/kv_transfer/cuda_ipc.py): two processes, one CUDA IPC export.
start=$(date +%s)
timeout 60 "$PY" -m shared.kv_transfer.cuda_ipc --selftest 2>&1 | tee "$OUT/cuda_ipc.log"
ipc_rc=${PIPESTATUS[0]}
echo "cuda-ipc selftest exit $ipc_rc after $(($(date +%s) - start)) s"

for rc in "$test_rc" "$bench_rc" "$ipc_rc"; do
    if [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
done
exit 0
