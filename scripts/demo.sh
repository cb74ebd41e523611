#!/usr/bin/env bash
# The main job: the whole system on the default model (SmolLM2-135M-Instruct, fetched once),
# streaming its answers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log="$(mktemp -t baton-demo-XXXX.log)"
BATON_LOG_FORMAT=console "$PY" -m services up >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
echo "Baton is starting (logs: $log)..."
for i in $(seq 1 90); do
  if "$PY" -m shared.client.cli "ready?" --max-tokens 1 --no-stream --wait-s 5 >/dev/null 2>&1; then break; fi
  if ! kill -0 $pid 2>/dev/null; then echo "Baton exited; see $log" >&2; tail -20 "$log" >&2; exit 1; fi
  [ "$i" = 90 ] && { echo "Baton did not become ready; see $log" >&2; exit 1; }
  sleep 2
done
"$PY" -m shared.client.cli --demo
