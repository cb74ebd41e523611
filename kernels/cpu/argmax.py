"""Row-wise argmax of a CPU step's logits through the C kernel of ``csrc/argmax.c``.

torch's ``max(dim=-1)`` tracks an index per compared value one lane at a time, a visible share
of a small model's decode step at large batches; the kernel gives the same indices (the first
maximum; a NaN counts as the maximum) with a vectorised maximum and a scan for its first
occurrence (docs/perf-log.md, "argmax"). Built and loaded like the attention kernels; without a
compiler torch's answer serves.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_library

SOURCE = CSRC / "argmax.c"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")

_P, _I = ctypes.c_void_p, ctypes.c_int64


def torch_argmax(logits: torch.Tensor) -> list[int]:
    """The reference, and the answer without a compiler: ``max().indices`` is argmax (first
    index among ties, as torch.argmax and HF), and cheaper than ``argmax`` on CPU."""
    return logits.max(dim=-1).indices.tolist()


class ArgmaxKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._argmax = lib.baton_argmax_f32
        self._argmax.argtypes = [_P, _I, _I, _I, _P]
        self._argmax.restype = None

    def __call__(self, logits: torch.Tensor) -> list[int]:
        """One index per row of a 2-D tensor; anything but fp32 CPU rows with contiguous columns
        goes to torch."""
        if (
            logits.dim() != 2
            or logits.dtype != torch.float32
            or logits.device.type != "cpu"
            or logits.shape[1] == 0
            or logits.stride(1) != 1
        ):
            return torch_argmax(logits)
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
        return out.tolist()


def load_argmax(cache_dir: Path | None = None) -> ArgmaxKernel | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's max")
    return ArgmaxKernel(*loaded) if loaded is not None else None
