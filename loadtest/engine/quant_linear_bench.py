"""Speed of the packed GGUF linear (kernels/cpu/quant_linear.py) on SmolLM2-135M's
projection shapes, per weight type and row count, one thread and all of them:

    python -m loadtest.engine.quant_linear_bench                      # Q4_0, Q4_1, Q8_0
    python -m loadtest.engine.quant_linear_bench --types q4_1 --rows 1 16 --shapes 960x576

Per (type, N x K, M): microseconds per call of the fp32 kernel (``f32``: each weight block
dequantized in registers, x kept fp32), of the int8 kernel on the row layout (``int8``) and on
tiles of 16 rows (``tiles``: the decode engine's form where the build has it,
kernels/cpu/csrc/quant_tiles.c; ``-`` elsewhere), of the same tiles in a bf16 model's arithmetic on
AMX's bf16 tiles (``bf16``: the decode engine's from 32 rows where the CPU has AMX,
kernels/cpu/csrc/quant_tiles_bf16.h; ``-`` elsewhere), of dequantize + SGEMM (``deq+gemm``: the
path above ``small_max_rows``, into the reused scratch) and of ``F.linear`` on the already
dequantized fp32 weight (``fp32``: what an unquantized model pays); the kernels' GFLOP/s
(2 M N K per call) and the f32 kernel's packed-weight bytes read per second. Each figure is the
median of repeated calls after a warm-up (the best of ``--rounds`` such medians); the weights
are random (the kernels' speed does not depend on the values). About 25 s a round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kernels.cpu import cpu_isa
from kernels.cpu.quant_formats import PACKED_TYPES, quantize
from kernels.cpu.quant_linear import (
    F32_MAX_ROWS,
    INT8_MAX_ROWS,
    QuantWeight,
    load_quant_kernels,
)

# SmolLM2-135M (hidden 576, intermediate 1536, vocab 49152, 9 query / 3 KV heads of 64):
# fused qkv, o_proj, fused gate_up, down_proj, the tied lm head.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
ROWS = (1, 4, 16, 64)


def per_call_us(fn: Callable[[], object], budget_s: float) -> float:
    """Median microseconds of ``fn`` over about ``budget_s`` (at least 3 calls, 1 warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _col(us: float, kflop: float) -> str:
    """A kernel's microseconds and GFLOP/s, or dashes where it did not run."""
    return f"{us:9.1f} {kflop / us:7.1f}" if us < float("inf") else f"{'-':>9} {'-':>7}"


def cpu_model() -> str:
    return cpu_isa.cpuinfo("model name") or platform.processor() or platform.machine()


def bench(
    types: list[str],
    rows: list[int],
    threads: list[int],
    budget_s: float,
    rounds: int,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
) -> None:
    kernels = load_quant_kernels()
    if kernels is None:
        raise SystemExit("no C compiler: the kernels cannot be built")
    print(f"{cpu_model()}, kernel builds {kernels.f32_isa} / {kernels.isa} / tiles "
          f"{kernels.tiles_isa}, torch {torch.__version__}, F32_MAX_ROWS {F32_MAX_ROWS}, "
          f"INT8_MAX_ROWS {INT8_MAX_ROWS}")  # fmt: skip
    print(f"{'type':5} {'N x K':>11} {'M':>3} {'thr':>3} | {'f32 us':>9} {'GB/s':>6} "
          f"{'GFLOP/s':>7} | {'int8 us':>9} {'GFLOP/s':>7} | {'tiles us':>9} {'GFLOP/s':>7} | "
          f"{'bf16 us':>9} {'GFLOP/s':>7} | {'deq+gemm':>9} | {'fp32 us':>9}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for name in types:
            qtype = PACKED_TYPES[name.upper()]
            for n, k in shapes:
                raw = quantize(torch.randn(n, k, generator=g), qtype)
                weight = QuantWeight(raw, qtype, k, kernels)
                dense = weight.dequantize()
                tiles = kernels.pack_tiles(raw, qtype, k) if kernels.tile_rows else None
                amx = tiles is not None and kernels.bf16_rows > 0
                for m in rows:
                    x = torch.randn(m, k, generator=g)
                    for t in threads:
                        torch.set_num_threads(t)
                        calls: list[Callable[[], object] | None] = [
                            partial(kernels.linear_f32, raw, qtype, k, x, None),
                            partial(kernels.linear, raw, qtype, k, x, None),
                            None
                            if tiles is None
                            else partial(kernels.linear_tiles, tiles, qtype, n, k, x, None),
                            None
                            if tiles is None or not amx
                            else partial(kernels.linear_tiles_bf16, tiles, qtype, n, k, x, None),
                            partial(weight.linear_dequantized, x),
                            partial(F.linear, x, dense),
                        ]
                        best = [float("inf")] * len(calls)
                        for _ in range(rounds):  # the calls interleaved, each its best round
                            for i, call in enumerate(calls):
                                if call is not None:
                                    best[i] = min(best[i], per_call_us(call, budget_s))
                        f32, int8, tiled, bf16, deq, fp32 = best
                        flop = 2 * m * n * k / 1e3

                        print(f"{name.upper():5} {f'{n}x{k}':>11} {m:>3} {t:>3} | "
                              f"{f32:9.1f} {weight.nbytes / f32 / 1e3:6.1f} {flop / f32:7.1f} | "
                              f"{int8:9.1f} {flop / int8:7.1f} | {_col(tiled, flop)} | "
                              f"{_col(bf16, flop)} | {deq:9.1f} | {fp32:9.1f}")  # fmt: skip
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["q4_0", "q4_1", "q8_0"],
                        choices=[t.lower() for t in PACKED_TYPES])  # fmt: skip
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES],
                        help="N x K weight shapes, e.g. 960x576")  # fmt: skip
    parser.add_argument("--threads", nargs="+", type=int,
                        default=sorted({1, torch.get_num_threads()}))  # fmt: skip
    parser.add_argument("--budget", type=float, default=0.04,
                        help="seconds of repeated calls per figure and round")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each figure this many times, keep the best (a shared, "
                        "noisy machine)")  # fmt: skip
    args = parser.parse_args(argv)
    shapes = tuple((int(n), int(k)) for n, k in (s.lower().split("x") for s in args.shapes))
    bench(args.types, args.rows, args.threads, args.budget, args.rounds, shapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
