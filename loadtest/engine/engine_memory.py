"""Each engine's resident memory against what it must hold: its weights once, in the form its
kernels read, plus its KV cache.

    python -m loadtest.engine.engine_memory --model smollm2-135m-instruct \\
        --format float32:dequantized bfloat16:dequantized float32:packed
    python -m loadtest.engine.engine_memory --preset llama-1b --format float32 bfloat16

Each (engine, format) is built in a process of its own, as ``python -m services up`` starts it
(the same malloc settings: services/__main__.py), and reports its RSS (VmRSS) once the engine
is built, beside ``weight_bytes`` (CausalLM.weight_bytes: packed forms as packed, tied tensors
once), the KV cache's bytes and the RSS of the same process before the model (torch and the
libraries). The aim: RSS - base <= 1.3 x weights + KV. A benchmark: prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest.models import preset_model

CHILD = r"""
import json, sys
from pathlib import Path

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

import torch
from shared.config import BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.models.catalog import resolve_model
model, dtype, weight_format, role, spill = sys.argv[1:6]
model_dir = resolve_model(model)
torch.set_num_threads(1)
base = rss()
config = BatonConfig(model=str(model_dir), dtype=dtype, weight_format=weight_format,
                     kv_cache_mb=64, spill_dir=spill)
build = build_prefill_engine if role == "prefill" else build_decode_engine
engine = build(config, model_dir)
runner = engine.runner
print(json.dumps({"rss": rss(), "base": base, "weight_bytes": runner.model.weight_bytes(),
                  "kv_bytes": runner.kv_cache.untyped_storage().nbytes()}))
"""


def measure(model: str, dtype: str, weight_format: str, role: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))  # as services/__main__.py sets
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    env.setdefault("MALLOC_ARENA_MAX", "1")
    spill = f"/dev/shm/baton-mem-{os.getpid()}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, dtype, weight_format, role, spill],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="BATON_MODEL (a name, a dir, a .gguf)")
    parser.add_argument("--preset", default=None, help="a random model preset (llama-1b, ...)")
    parser.add_argument("--format", nargs="+", default=["float32"],
                        help="DTYPE[:WEIGHT_FORMAT] each, e.g. float32:packed")  # fmt: skip
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    model = args.model if args.model is not None else str(preset_model(args.preset or "bench"))
    rows = []
    print(f"{'engine':8s} {'format':22s} {'weights MB':>11s} {'KV MB':>7s} {'RSS MB':>8s} "
          f"{'base MB':>8s} {'(RSS-base)/(W+KV)':>18s}")  # fmt: skip
    for spec in args.format:
        dtype, _, weight_format = spec.partition(":")
        for role in ("prefill", "decode"):
            m = measure(model, dtype, weight_format or "auto", role)
            need = m["weight_bytes"] + m["kv_bytes"]
            ratio = (m["rss"] - m["base"]) / need
            rows.append({"role": role, "format": spec, **m, "ratio": ratio})
            print(
                f"{role:8s} {spec:22s} {m['weight_bytes'] / 1e6:11.1f} {m['kv_bytes'] / 1e6:7.1f}"
                f" {m['rss'] / 1e6:8.1f} {m['base'] / 1e6:8.1f} {ratio:18.2f}",
                flush=True,
            )
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
