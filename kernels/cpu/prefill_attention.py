"""CPU prefill attention through the C kernel of ``csrc/prefill_attention.c``.

Why a C kernel: for short prompts with small heads SDPA's CPU kernel runs far below the core's
peak, and the copies that feed it per sequence (K and V repeated per query head, transposed)
add to that. The kernel reads q, k and v where the projection left them (strided views)
and computes each fresh prompt's causal attention from small per-head tiles that stay in cache.
Same numbers as SDPA up to float rounding (tests/runtime/test_cpu_prefill_attention.py sweeps
shapes against it); greedy parity with transformers is checked by tests/test_parity.py.

Only fresh prompts (no cached prefix: every key is one of this forward's rows) with head sizes
that are multiples of 16 take it; a chunk that continues a cached prefix keeps SDPA over the
gathered cache. Built and loaded like the decode kernel (kernels/cpu/paged_decode_attention.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_threaded, split_parts

SOURCE = CSRC / "prefill_attention.c"
# Contracted multiply-adds (FMA): the decode kernel's flags plus -ffp-contract=fast, which
# -std=c11 turns off; the sums differ from SDPA's in rounding either way.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")
MAX_HEAD_DIM = 256  # the kernel's accumulators: head_dim / 16 vectors per row

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class FreshPrompts:
    """The row ranges of one forward's fresh prompts, checked once here (every layer uses them):
    what the C code assumes and cannot check itself."""

    bounds: torch.Tensor  # int64 [S, 2]: first row, end row
    max_len: int  # rows of the longest
    num_rows: int  # rows of the forward (every range lies within)

    @classmethod
    def of(cls, ranges: list[tuple[int, int]], num_rows: int) -> FreshPrompts:
        if any(not 0 <= first < end <= num_rows for first, end in ranges):
            raise ValueError(f"row ranges {ranges} do not lie within {num_rows} rows")
        max_len = max((end - first for first, end in ranges), default=0)
        bounds = torch.tensor(ranges, dtype=torch.int64).reshape(len(ranges), 2)
        return cls(bounds, max_len, num_rows)


class PrefillKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path, max_threads: int) -> None:
        self.path = path
        self._attend = {
            torch.float32: lib.baton_prefill_attention_f32,
            torch.bfloat16: lib.baton_prefill_attention_bf16,
        }
        for fn in self._attend.values():
            fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I]
            fn.restype = ctypes.c_int
        self.max_threads = max(1, max_threads)
        lanes = lib.baton_prefill_attention_lanes
        lanes.argtypes, lanes.restype = [], ctypes.c_int64
        # The engines use the kernel where its build has 16-lane registers (AVX-512): on AVX2
        # its 16 x 16 register tiles spill, and a prompt's forward ran ~1.6x slower than with
        # SDPA (docs/perf-log.md, "Decode on AVX2"). The tests run it everywhere.
        self.serves = int(lanes()) >= 16

    @staticmethod
    def supports(head_dim: int) -> bool:
        return head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: FreshPrompts,
        scale: float, out: torch.Tensor, window: int | None = None,
    ) -> None:  # fmt: skip
        """Causal attention of each of ``prompts``' row ranges into those rows of ``out``: q and
        out ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, CPU, all fp32 or all bf16 (computed in
        fp32, each output rounded once), heads contiguous within a row (rows may be strided, as
        in views of a fused projection). Other rows of ``out`` are left as they are.
        ``window``: a sliding window (row i sees rows i - window + 1 .. i)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        attend = self._attend.get(q.dtype)
        for name, t, heads in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads),
                               ("out", out, num_heads)):  # fmt: skip
            if attend is None or t.dtype != q.dtype or t.device.type != "cpu":
                raise ValueError(f"{name} must be fp32 or bf16 (as q) on the CPU, got {t.dtype}"
                                 f" on {t.device}")  # fmt: skip
            if t.shape != (num_tokens, heads, head_dim) or t.stride()[1:] != (head_dim, 1):
                raise ValueError(f"{name} {tuple(t.shape)} strides {t.stride()}: rows of heads")
        if not self.supports(head_dim) or num_heads % num_kv_heads:
            raise ValueError(f"unsupported heads: {num_heads} x {num_kv_heads} of {head_dim}")
        if window is not None and window < 1:
            raise ValueError(f"window {window}: at least one key")
        if prompts.num_rows != num_tokens:
            raise ValueError(f"the prompts cover {prompts.num_rows} rows, q has {num_tokens}")
        num_seqs = prompts.bounds.shape[0]
        if not num_seqs:
            return
        assert attend is not None
        failed = attend(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            prompts.bounds.data_ptr(), num_seqs, prompts.max_len, num_heads, num_kv_heads,
            head_dim, window or 0, scale, out.data_ptr(), out.stride(0), self.parts(num_seqs),
        )  # fmt: skip
        if failed:
            raise MemoryError("prefill attention could not allocate its scratch tiles")

    def parts(self, num_seqs: int) -> int:
        return split_parts(num_seqs, 1, min(self.max_threads, torch.get_num_threads()))


def load_prefill_kernel(
    cache_dir: Path | None = None, max_threads: int | None = None
) -> PrefillKernel | None:
    """Build (once per machine and source) and load the kernel; None if it cannot be built.
    ``max_threads``: as :func:`~kernels.cpu.build.load_threaded` says."""
    return load_threaded(PrefillKernel, SOURCE, FLAGS, cache_dir, "SDPA", max_threads)
