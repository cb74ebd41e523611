"""Speed of the C decode attention (kernels/cpu/paged_decode_attention.py) as a decode step meets
it: one call per layer, each layer's K/V pool its own and the batch's blocks scattered over it,
so the rows come from memory (timed over one small pool, they would sit in cache).

    python -m loadtest.engine.decode_attention_bench                     # SmolLM2-135M's shape
    python -m loadtest.engine.decode_attention_bench --context 64 192 512 --kv-dtype float32
    python -m loadtest.engine.decode_attention_bench --against HEAD~1    # A/B against a revision

Per (cache dtype, context): milliseconds for one pass over ``--layers`` layers (best and median
of ``--repeats`` passes after a warm-up), the K/V bytes read per second and that as a share of
the machine's read bandwidth (loadtest/engine/roofline.py ``probe_bandwidth``), and the same
"cached": every call on one layer's pool, which stays in cache (L2 or L3), about the kernel's
compute alone. ``--against REV`` builds the kernel's source at a git revision beside the working
tree's and alternates the two pass by pass (the machines drift from minute to minute), printing
both and their outputs' largest difference.
A benchmark: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels.cpu import paged_decode_attention as pda
from kernels.cpu.build import build_library
from kernels.cpu.paged_decode_attention import DecodeKernel, KernelBatch
from loadtest.engine import roofline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernel_at(rev: str, workdir: Path, threads: int) -> DecodeKernel:
    """The kernel built from its C source (and the headers beside it) at git revision ``rev``."""
    csrc = workdir / rev.replace("/", "_") / "csrc"
    csrc.mkdir(parents=True)
    root = Path(__file__).resolve().parents[2]
    for header in pda.CSRC.glob("*.h"):
        shutil.copy(header, csrc / header.name)
    for path in [*pda.CSRC.glob("*.h"), pda.SOURCE]:
        rel = path.relative_to(root).as_posix()
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True)
        if shown.returncode == 0:
            (csrc / path.name).write_bytes(shown.stdout)
    lib = build_library(csrc / pda.SOURCE.name, pda.FLAGS, csrc.parent / "lib")
    return DecodeKernel(ctypes.CDLL(str(lib)), lib, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, nargs="+", default=[192])
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-dtype", choices=DTYPES, nargs="+", default=["bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--against", default="", metavar="REV", help="A/B with this revision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels: dict[str, DecodeKernel] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            kernels[args.against] = kernel_at(args.against, Path(tmp), args.threads)
        tree = pda.load_kernel(max_threads=args.threads)
        if tree is None:
            raise SystemExit("the decode attention kernel did not build (no C compiler?)")
        kernels["tree"] = tree
        bandwidth = roofline.probe_bandwidth()
        print(f"read bandwidth {bandwidth:.1f} GB/s; batch {args.batch}, heads {args.heads}, "
              f"head {args.head_dim}, {args.layers} layers, {args.threads} threads")  # fmt: skip
        for dtype_name in args.kv_dtype:
            for context in args.context:
                run(args, kernels, DTYPES[dtype_name], context, bandwidth)


def run(
    args: argparse.Namespace,
    kernels: dict[str, DecodeKernel],
    dtype: torch.dtype,
    context: int,
    bandwidth: float,
) -> None:
    (num_heads, num_kv_heads), bs, batch = args.heads, args.block_size, args.batch
    width = -(-context // bs)
    num_blocks = max(2 * batch * width, 256)  # the batch's blocks scattered over twice as many
    g = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, bs, num_kv_heads, args.head_dim)
    pools = [torch.randn(shape, generator=g).to(dtype) for _ in range(args.layers)]
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)
    rows = KernelBatch(
        tables.contiguous(), torch.full((batch,), context, dtype=torch.int64), context, bs
    )
    q = torch.randn(batch, num_heads, args.head_dim, generator=g)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * batch * context * num_kv_heads * args.head_dim * pools[0].element_size()
    outs = {name: k.attend(q, pools[0], rows, scale) for name, k in kernels.items()}
    passes: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):  # the kernels and the two modes alternated pass by pass
        for name, k in kernels.items():
            for mode, layer_pools in (("memory", pools), ("cached", [pools[0]] * len(pools))):
                t0 = time.perf_counter()
                for pool in layer_pools:
                    k.attend(q, pool, rows, scale)
                passes.setdefault((name, mode), []).append(time.perf_counter() - t0)
    label = f"{str(dtype).removeprefix('torch.')} cache, context {context}"
    for (name, mode), times in passes.items():
        best, median = min(times), statistics.median(times)
        gbs = args.layers * kv_bytes / best / 1e9
        share = gbs / bandwidth
        print(f"{label}, {name:>10} {mode:6s}: best {best * 1e3:7.2f} ms, median "
              f"{median * 1e3:7.2f} ms, {gbs:5.1f} GB/s ({share:4.0%} of the probe)")  # fmt: skip
    if len(outs) == 2:
        a, b = outs.values()
        print(f"{label}: outputs differ by at most {(a - b).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
