#!/usr/bin/env bash
# Install Baton and its test/loadtest tools into the current Python (idempotent, fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# torch first, pinned to the release this project is tested with: an unpinned resolve would pull
# several GB of CUDA wheels on a CPU-only machine.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,loadtest]"
# Hugging Face's `kernels` distribution (pulled in by transformers>=5.25, see pyproject.toml)
# makes transformers import `kernels`, which resolves to this repository's Triton package:
# remove it. transformers only imports it when it is installed.
if "$PY" -c "import importlib.metadata as m; m.distribution('kernels')" 2>/dev/null; then
  "$PY" -m pip uninstall -q -y kernels
fi
# docker-compose validates compose.yaml in the tests (no Docker engine needed).
if ! command -v docker-compose >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q docker-compose >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker-compose >/dev/null 2>&1)) \
    || echo "note: docker-compose not installed; the compose tests will be skipped" >&2
fi
# Mooncake's transfer engine (BATON_KV_TRANSPORT=mooncake, the multi-node tests), CPU build: its
# library links libibverbs even for TCP. Optional: without it those tests skip with a reason.
if ! "$PY" -c "import mooncake.engine" 2>/dev/null; then
  if ! ldconfig -p | grep -q libibverbs.so.1 && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q libibverbs1 ibverbs-providers >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 \
          && apt-get install -y -q libibverbs1 ibverbs-providers >/dev/null 2>&1)) || true
  fi
  "$PY" -m pip install -q mooncake-transfer-engine-non-cuda \
    || echo "note: mooncake not installed; the multi-node tests will be skipped" >&2
fi
