"""Speed of the dense tile projections (kernels/cpu/dense_tiles.py) against oneDNN's packed form
and ``F.linear``, as a decode step meets them: every projection of a model's layers in turn, so
each weight comes from memory (a step reads each layer's weights once; timed in a loop over one
weight, it would sit in cache).

    python -m loadtest.engine.dense_tiles_bench                          # SmolLM2-135M's shapes
    python -m loadtest.engine.dense_tiles_bench --dtype bfloat16 --rows 1 4 16 --threads 1 2

Per (dtype, threads, rows): milliseconds for one pass over ``--layers`` layers' projections
(fused qkv, o_proj, fused gate_up, down_proj; random weights) and the weight bytes read per
second, for the tiles, oneDNN's packed form (where torch has it for the dtype) and ``F.linear``
on the plain weight; the last column is oneDNN's time over the tiles'. Medians of ``--repeats``
passes after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kernels.cpu import dense_tiles, onednn_pack
from kernels.cpu.dense_tiles import DenseTileWeight
from loadtest.engine.quant_linear_bench import cpu_model

# SmolLM2-135M (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pass_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def apply_all(fns: list[Callable[[torch.Tensor], torch.Tensor]], xs: list[torch.Tensor]) -> None:
    for f, x in zip(fns, xs, strict=True):
        f(x)


def run(
    dtype: torch.dtype, shapes: list[tuple[int, int]], layers: int, rows: list[int],
    threads: list[int], repeats: int,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    weights = [
        [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for n, k in shapes]
        for _ in range(layers)
    ]  # fmt: skip
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    forms: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "tiles": [DenseTileWeight(w).linear for layer in weights for w in layer],
        "F.linear": [partial(F.linear, weight=w) for layer in weights for w in layer],
    }
    if onednn_pack.available(dtype):
        forms["oneDNN"] = [onednn_pack.OneDnnWeight(w).linear for layer in weights for w in layer]
    widths = [k for _ in range(layers) for _, k in shapes]
    print(f"\n{dtype}, {layers} layers of {shapes} ({nbytes / 1e6:.0f} MB):")
    print(f"{'thr':>3} {'rows':>4} " + " ".join(f"{name:>20}" for name in forms) + "  oneDNN/tiles")
    for t in threads:
        torch.set_num_threads(t)
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in set(widths)}
            inputs = [xs[k] for k in widths]
            ms = {
                name: pass_ms(partial(apply_all, fs, inputs), repeats) for name, fs in forms.items()
            }
            cells = " ".join(f"{v:8.2f} ms {nbytes / v / 1e6:5.1f} GB/s" for v in ms.values())
            ratio = f"{ms['oneDNN'] / ms['tiles']:8.2f}x" if "oneDNN" in ms else "-"
            print(f"{t:3d} {m:4d} {cells}  {ratio}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{n}x{k}" for n, k in SHAPES],
        help="N x K of each layer's weights (default: SmolLM2-135M's)",
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    kernels = dense_tiles.load_dense_tile_kernels()
    isa = (
        {str(d): i for d, i in kernels.isa.items()} if kernels is not None else "none (no compiler)"
    )
    print(f"CPU: {cpu_model()}; tile kernels: {isa}")
    for name in args.dtype:
        if not dense_tiles.available(DTYPES[name]):
            print(f"\n{name}: no tile kernel in this build")
            continue
        shapes = [(int(n), int(k)) for n, k in (s.split("x") for s in args.shapes)]
        run(DTYPES[name], shapes, args.layers, args.rows, args.threads, args.repeats)


if __name__ == "__main__":
    main()
