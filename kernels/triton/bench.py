"""Kernel benchmarks on a CUDA device, each beside a torch baseline measured in the same run.

    python -m kernels.triton.bench --out out/bench.json

Decode attention is memory-bound: GB/s over the bytes it must move (the KV actually read, plus
q and out) against the H200's 4.8 TB/s. Prefill attention is compute-bound: TFLOP/s over the
causal FLOPs against 989 dense bf16 TFLOP/s. Baselines: torch SDPA on pre-gathered contiguous
KV (decode; the gather itself is not timed, which favours SDPA) and SDPA is_causal on
contiguous tensors (prefill). On a machine without CUDA it prints why and writes
{"skipped": true, ...}, exiting 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

PEAK_GB_PER_S = 4800.0  # H200 HBM3e, vendor datasheet
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16, vendor datasheet

# (batch, context_len, num_splits): None lets the wrapper choose.
DECODE_POINTS: list[tuple[int, int, int | None]] = [
    (64, 2048, None),
    (256, 512, None),
    (8, 8192, None),
    (1, 32768, None),  # long context, few sequences: split-KV
    (1, 32768, 1),  # the same without splitting, to show what split-KV buys
]
INT8_DECODE_POINTS = [(64, 2048)]
PREFILL_POINTS = [[4096], [1024] * 4]
STORE_KV_POINTS = [64, 4096]


def _run_point(fn: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Runs one point; a failure is recorded and reported instead of ending the run."""
    try:
        return fn()
    except Exception as exc:  # a benchmark keeps going past a broken point
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_benchmarks() -> dict[str, Any]:
    from kernels.triton._bench_inputs import BENCH
    from kernels.triton.int8_kv import bench_int8_decode
    from kernels.triton.kv_store import bench_store_kv
    from kernels.triton.paged_decode_attention import bench_paged_decode
    from kernels.triton.prefill_attention import bench_prefill

    results: dict[str, Any] = {"decode": [], "int8_decode": [], "prefill": [], "store_kv": []}
    dtype = str(BENCH.dtype).removeprefix("torch.")
    heads = {"num_q_heads": BENCH.num_q_heads, "num_kv_heads": BENCH.num_kv_heads}
    common = {**heads, "head_dim": BENCH.head_dim, "dtype": dtype}
    for batch, context_len, num_splits in DECODE_POINTS:
        point = {"batch": batch, "context_len": context_len, "num_splits": num_splits, **common}
        r = _run_point(partial(bench_paged_decode, batch, context_len, num_splits=num_splits))
        if "error" not in r:
            r["pct_peak"] = 100 * r["gb_per_s"] / PEAK_GB_PER_S
            r["speedup_vs_sdpa"] = r["sdpa_ms"] / r["ms"]
        results["decode"].append({**point, **r})
    for batch, context_len in INT8_DECODE_POINTS:
        point = {"batch": batch, "context_len": context_len, **common}
        r = _run_point(partial(bench_int8_decode, batch, context_len))
        if "error" not in r:
            r["pct_peak"] = 100 * r["gb_per_s"] / PEAK_GB_PER_S
            r["speedup_vs_bf16_kernel"] = r["bf16_ms"] / r["ms"]
        results["int8_decode"].append({**point, **r})
    for q_lens in PREFILL_POINTS:
        point = {"batch": len(q_lens), "q_len": q_lens[0], **common}
        r = _run_point(partial(bench_prefill, q_lens))
        if "error" not in r:
            r["pct_peak"] = 100 * r["tflops"] / PEAK_TFLOPS
            r["speedup_vs_sdpa"] = r["sdpa_ms"] / r["ms"]
        results["prefill"].append({**point, **r})
    for num_tokens in STORE_KV_POINTS:
        r = _run_point(partial(bench_store_kv, num_tokens))
        if "error" not in r:
            r["speedup_vs_torch"] = r["torch_ms"] / r["ms"]
        results["store_kv"].append(
            {"num_tokens": num_tokens, "num_kv_heads": BENCH.num_kv_heads, **r}
        )
    return results


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def print_table(results: dict[str, Any]) -> None:
    print("\npaged decode attention (bf16, D=128, 32q/8kv heads)")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'ms':>8} {'GB/s':>8} {'%peak':>6} "
          f"{'sdpa ms':>8} {'sdpa GB/s':>9} {'x sdpa':>7}")  # fmt: skip
    for r in results["decode"]:
        print(
            f"{r['batch']:>6} {r['context_len']:>6} {str(r['num_splits']):>6} "
            f"{_fmt(r, 'ms', '8.4f')} {_fmt(r, 'gb_per_s', '8.0f')} {_fmt(r, 'pct_peak', '6.1f')} "
            f"{_fmt(r, 'sdpa_ms', '8.4f')} {_fmt(r, 'sdpa_gb_per_s', '9.0f')} "
            f"{_fmt(r, 'speedup_vs_sdpa', '7.2f')} {r.get('error', '')}"
        )
    print("\nint8 KV decode attention (vs the bf16 kernel on the dequantized cache)")
    for r in results["int8_decode"]:
        print(
            f"{r['batch']:>6} {r['context_len']:>6} {_fmt(r, 'ms', '8.4f')} ms "
            f"{_fmt(r, 'gb_per_s', '8.0f')} GB/s {_fmt(r, 'pct_peak', '6.1f')}% "
            f"bf16 {_fmt(r, 'bf16_ms', '8.4f')} ms x{_fmt(r, 'speedup_vs_bf16_kernel', '.2f')} "
            f"{r.get('error', '')}"
        )
    print("\nprefill attention (bf16, causal, D=128, 32q/8kv heads)")
    print(f"{'batch':>6} {'q_len':>6} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} {'sdpa ms':>8} "
          f"{'sdpa TF/s':>9} {'x sdpa':>7}")  # fmt: skip
    for r in results["prefill"]:
        print(
            f"{r['batch']:>6} {r['q_len']:>6} {_fmt(r, 'ms', '8.4f')} {_fmt(r, 'tflops', '8.1f')} "
            f"{_fmt(r, 'pct_peak', '6.1f')} {_fmt(r, 'sdpa_ms', '8.4f')} "
            f"{_fmt(r, 'sdpa_tflops', '9.1f')} {_fmt(r, 'speedup_vs_sdpa', '7.2f')} "
            f"{r.get('error', '')}"
        )
    print("\nstore_kv (bf16, 8 kv heads, D=128)")
    for r in results["store_kv"]:
        print(
            f"{r['num_tokens']:>6} tokens {_fmt(r, 'ms', '8.4f')} ms "
            f"{_fmt(r, 'gb_per_s', '8.0f')} GB/s torch {_fmt(r, 'torch_ms', '8.4f')} ms "
            f"x{_fmt(r, 'speedup_vs_torch', '.2f')} {r.get('error', '')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        reason = "no CUDA device: the kernel benchmarks only run on a GPU"
        print(f"skipped: {reason}")
        args.out.write_text(json.dumps({"skipped": True, "reason": reason}, indent=2) + "\n")
        return 0
    import triton

    results = run_benchmarks()
    report = {
        "skipped": False,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peak_gb_per_s": PEAK_GB_PER_S,
        "peak_tflops": PEAK_TFLOPS,
        **results,
    }
    print_table(results)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
