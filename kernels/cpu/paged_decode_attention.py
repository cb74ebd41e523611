"""CPU decode attention through the C kernel of ``csrc/paged_decode_attention.c``, over an fp32
or a bf16 cache.

Why a C kernel: on CPU the torch path (index_select of K rows, the scores bmm, embedding_bag
over V) spends a large share of a small model's decode step at large batches in attention, all
of it moving short rows one at a time. The kernel reads each sequence's K and V blocks in
place, once, with the softmax between its two passes, in one call: a row's scores stay in its
thread's cache. Same numbers as the torch path up to float summation order and the exp's last bits
(tests/runtime/test_cpu_attention.py sweeps shapes against it). Over a bf16
cache it computes in fp32 (q widened, the output rounded to bf16 once), as SDPA's CPU kernel
does in bf16; torch's bf16 path rounded scores and probabilities to bf16 on the way.

The library is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``) into a cache directory keyed by the source, the flags, the compiler
and the CPU, and loaded with ctypes (calls release the GIL). A batch is split across
``torch.get_num_threads()`` threads (read at each call) of torch's own OpenMP team: the library
links libgomp, which resolves to the copy torch has loaded (threads the C code started itself
met that team still spinning after the step's GEMMs, and two threads ran slower than one). No
compiler, or a failed build: ``load_kernel`` returns None and the torch path serves (one
warning).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_threaded, split_parts

SOURCE = CSRC / "paged_decode_attention.c"
# Contraction on: the dot products' and sums' multiply-adds as FMAs (the results stay within
# the tests' fp32 tolerances of the fp64 reference).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# Rows of the batch per thread below which splitting costs more than it saves.
MIN_ROWS_PER_THREAD = 8

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DecodeKernel:
    """The loaded library: one call a layer, splitting the batch on threads (see the C file)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, max_threads: int) -> None:
        self.path = path
        self._attend = {}  # the cache's dtype -> its entry point
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            attend = getattr(lib, f"baton_paged_decode_attend_{suffix}")
            attend.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P]
            attend.restype = None
            self._attend[dtype] = attend
        self.max_threads = max(1, max_threads)

    def attend(
        self, q: torch.Tensor, kv_layer: torch.Tensor, rows: KernelBatch, scale: float
    ) -> torch.Tensor:
        """q ``[B, Hq, D]`` -> ``[B, Hq, D]`` in q's dtype; ``kv_layer`` ``[2, blocks, bs, Hkv,
        D]``; row b attends to positions ``rows.starts[b] .. rows.context_lens[b] - 1``. q and the
        cache: fp32 or bf16 each; q's rows may be strided (views of a fused projection)."""
        batch, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, pool_dim = kv_layer.shape
        if q.dtype not in self._attend or kv_layer.dtype not in self._attend:
            raise ValueError(f"fp32 or bf16 only (q {q.dtype}, cache {kv_layer.dtype})")
        if q.device.type != "cpu" or not kv_layer.is_contiguous():
            raise ValueError("a contiguous CPU cache is required")
        if pool_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not match the pool {tuple(kv_layer.shape)}")
        if batch != rows.context_lens.shape[0] or block_size != rows.block_size:
            raise ValueError("one block table and one context length per query row, same blocks")
        out_dtype = q.dtype
        q = q.to(torch.float32)
        if q.stride()[1:] != (head_dim, 1):
            q = q.contiguous()
        out = torch.empty(batch, num_heads, head_dim)
        starts = None if rows.starts is None else rows.starts.data_ptr()
        self._attend[kv_layer.dtype](q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(),
                                     kv_layer[1].data_ptr(), rows.block_tables.data_ptr(),
                                     rows.block_tables.shape[1], rows.context_lens.data_ptr(),
                                     starts, batch, self.parts(batch), num_heads, num_kv_heads,
                                     head_dim, block_size, scale, rows.max_context_len,
                                     out.data_ptr())  # fmt: skip
        return out.to(out_dtype)

    def parts(self, batch: int) -> int:
        """Threads a pass runs on: torch's current thread count (up to ``max_threads``), fewer
        where a thread would get under ``MIN_ROWS_PER_THREAD`` rows (the C side hands the rows
        out in chunks, to whichever of them is free)."""
        return split_parts(
            batch, MIN_ROWS_PER_THREAD, min(self.max_threads, torch.get_num_threads())
        )


@dataclass(frozen=True)
class KernelBatch:
    """One step's block tables and context lengths, checked once here (every layer reads them):
    what the C code assumes and cannot check itself."""

    block_tables: torch.Tensor  # int64 [B, max_blocks], contiguous
    context_lens: torch.Tensor  # int64 [B], contiguous
    max_context_len: int  # the scores' width: no row attends to more positions
    block_size: int
    # int64 [B], contiguous: each row's first visible position (a sliding window); None: 0.
    starts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tables, lens, starts = self.block_tables, self.context_lens, self.starts
        if tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("block tables and context lengths must be int64")
        if not (tables.is_contiguous() and lens.is_contiguous()):
            raise ValueError("block tables and context lengths must be contiguous")
        if lens.dim() != 1 or tables.dim() != 2 or tables.shape[0] != lens.shape[0]:
            raise ValueError("one block table and one context length per query row")
        capacity = tables.shape[1] * self.block_size
        if lens.numel() and int(lens.max()) > capacity:
            raise ValueError("a context is longer than its block table")
        spans = lens
        if starts is not None:
            if starts.dtype != torch.int64 or not starts.is_contiguous():
                raise ValueError("window starts must be contiguous int64")
            if starts.shape != lens.shape or bool(((starts < 0) | (starts > lens)).any()):
                raise ValueError("a window start outside 0..its context length")
            spans = lens - starts
        if spans.numel() and int(spans.max()) > self.max_context_len:
            raise ValueError("a context (from its window start) is longer than the scores width")


def load_kernel(
    cache_dir: Path | None = None, max_threads: int | None = None
) -> DecodeKernel | None:
    """Build (once per machine and source) and load the kernel; None if it cannot be built.
    ``max_threads``: as :func:`~kernels.cpu.build.load_threaded` says."""
    return load_threaded(DecodeKernel, SOURCE, FLAGS, cache_dir, "the torch path", max_threads)
