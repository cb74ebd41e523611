"""A decoder layer's elementwise ops through the C kernels of ``csrc/layer_ops.c`` (CPU), over fp32
or bf16 rows.

RMSNorm (optionally after the residual add, in place) and SiLU(gate) * up over the fused gate_up
output, fp32 or bf16; rotate-half RoPE in place, bf16 (fp32's is kernels/cpu/rope.py, bit-equal to
torch). Each one pass over its rows, fp32 inside, no temporaries. Who uses them (model_runner.py):
bf16 models, and the decode engine of an fp32 model, plain or with packed GGUF weights (the fused
ops part from torch's bits in the last ulp or two, and the parity tests hold with them); an fp32
prefill engine keeps torch's ops, exact. Built and loaded like the other kernels; without a
compiler torch's ops serve.
What each rounds, and why: the C file. Each call splits its rows on torch's
OpenMP team, into ``torch.get_num_threads()`` parts (read at each call, as the engine's CPU
share moves it), fewer for a small call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_library, split_parts
from kernels.cpu.rope import rope_in_place

SOURCE = CSRC / "layer_ops.c"
# Contraction on: SiLU's polynomial and RoPE's sums as FMAs (one rounding fewer); RMSNorm's
# products are products of products, which it leaves alone.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fopenmp", "-fPIC",
         "-shared", "-std=c11")  # fmt: skip
# Output elements a part has at least: a decode step's SiLU * up at a real size (16 x 4864
# outputs) still gains from a split in two; much smaller calls lose more to waking the team
# than they gain, and stay whole.
MIN_PART_ELEMS = 1 << 14
DTYPES = (torch.float32, torch.bfloat16)


def parts(elems: int) -> int:
    """How many row ranges a call over ``elems`` output elements splits into."""
    return split_parts(elems, MIN_PART_ELEMS, torch.get_num_threads())


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _rows(x: torch.Tensor) -> bool:
    """2-D CPU with contiguous rows (the row stride may be larger); the dtype is checked by the
    entry-point lookup."""
    return x.is_cpu and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)


def _empty(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh ``[rows, cols]`` tensor: the short form where it gives ``dtype`` (it costs a
    decode step's call a third of the keyword form)."""
    out = torch.empty(rows, cols)
    return out if out.dtype is dtype else torch.empty((rows, cols), dtype=dtype)


class LayerKernels:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        # dtype -> entry point, for each op over both element types
        self._norm: dict[torch.dtype, Callable[..., None]] = {}
        self._add_norm: dict[torch.dtype, Callable[..., None]] = {}
        self._silu_mul: dict[torch.dtype, Callable[..., None]] = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            for table, name, argtypes in (
                (self._norm, "rms_norm", [_P, _I, _I, _I, _P, _F, _P, _I]),
                (self._add_norm, "add_rms_norm", [_P, _P, _I, _I, _P, _F, _P, _I]),
                (self._silu_mul, "silu_mul", [_P, _I, _I, _I, _P, _I]),
            ):
                fn = getattr(lib, f"baton_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                table[dtype] = fn
        self._rope = lib.baton_rope_bf16
        self._rope.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I]
        self._rope.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``model.rms_norm(x, weight, eps)`` of 2-D fp32 or bf16 ``x``."""
        fn = self._norm.get(x.dtype)
        if fn is None or not _rows(x) or weight.dtype is not x.dtype or weight.shape != x.shape[1:]:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype}: not rows of the weight's size and "
                             "dtype (fp32 or bf16)")  # fmt: skip
        rows, cols = x.shape
        out = _empty(rows, cols, x.dtype)
        fn(x.data_ptr(), rows, cols, x.stride(0), weight.contiguous().data_ptr(), eps,
           out.data_ptr(), parts(rows * cols))  # fmt: skip
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``hidden += delta`` in place, then ``model.rms_norm(hidden, weight, eps)``."""
        fn = self._add_norm.get(hidden.dtype)
        if fn is None or not (hidden.is_contiguous() and _rows(hidden)):
            raise ValueError(f"hidden {tuple(hidden.shape)}: not contiguous fp32 or bf16 rows")
        if delta.shape != hidden.shape or delta.dtype is not hidden.dtype:
            raise ValueError(f"delta must be {hidden.dtype} {tuple(hidden.shape)}")
        if weight.dtype is not hidden.dtype or weight.shape != hidden.shape[1:]:
            raise ValueError(f"weight must be {hidden.dtype} [{hidden.shape[1]}]")
        rows, cols = hidden.shape
        out = _empty(rows, cols, hidden.dtype)
        fn(hidden.data_ptr(), delta.contiguous().data_ptr(), rows, cols,
           weight.contiguous().data_ptr(), eps, out.data_ptr(), parts(rows * cols))  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, 2-D fp32 or bf16."""
        fn = self._silu_mul.get(gate_up.dtype)
        if fn is None or not _rows(gate_up) or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} {gate_up.dtype}: not rows of an "
                             "even width, fp32 or bf16")  # fmt: skip
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = _empty(rows, inter, gate_up.dtype)
        fn(gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(),
           parts(rows * inter))  # fmt: skip
        return out

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """``model.apply_rope`` in place if the inputs are bf16 ones the kernel takes
        (:func:`~kernels.cpu.rope.rope_takes`: True); else False."""
        return rope_in_place(self._rope, x, cos, sin, torch.bfloat16, parts(x.numel()))


def load_layer_ops(cache_dir: Path | None = None) -> LayerKernels | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's elementwise ops")
    return LayerKernels(*loaded) if loaded is not None else None
