"""fp32 linears on AMX's bf16 tiles, each operand split into two bf16s (``csrc/split_bf16.c``):
``F.linear(x, w, b)`` to ~4e-6 of the outputs' norm, three tile products a chunk.

The prefill engine's arithmetic for packed GGUF weights where the CPU has AMX
(``BATON_PACKED_PREFILL`` "bf16x3", what "auto" takes there; shared/runtime/linear_layout.py):
a wave's layer is dequantized to fp32 once, split into its tiles (:func:`pack`), and every
row of the wave runs through :func:`linear`. Why and the error: the C file's comment; the
speed: docs/perf-log.md, "Packed prefill on AMX".

:func:`reference` is the same arithmetic in torch (the three products in fp32), what the tests
sweep the kernel against. Builds: AMX-BF16 with AVX512-BF16; :func:`available` says whether
this machine runs it (the CPU, the build and the kernel's grant of the tile registers).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_library, split_parts

SOURCE = CSRC / "split_bf16.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11")
TILE_ROWS = 16
CHUNK = 32  # k of a tile: in_features must be a multiple of it
# Rows x output features a part of a call has at least (a part's tiles are 32 x 32 outputs).
MIN_PART_WORK = 1 << 14

_P, _I = ctypes.c_void_p, ctypes.c_int64


class SplitKernels:
    """The C library: the split tiles of a weight and the linear over them."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._pack = lib.baton_split_bf16_pack
        self._pack.argtypes, self._pack.restype = [_P, _I, _I, _P, _I], ctypes.c_int
        self._linear = lib.baton_split_bf16_linear
        self._linear.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I]
        self._linear.restype = ctypes.c_int
        ok = lib.baton_split_bf16_available
        ok.argtypes, ok.restype = [], ctypes.c_int
        self.available = bool(ok())


@functools.cache
def load_split_kernels(cache_dir: Path | None = None) -> SplitKernels | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="the packed prefill's other forms")
    return None if loaded is None else SplitKernels(*loaded)


def available() -> bool:
    """Whether this machine runs the split kernel (AMX-BF16, built and granted)."""
    kernels = load_split_kernels()
    return kernels is not None and kernels.available


def packed_elems(n: int, k: int) -> int:
    """bf16 elements of an ``n x k`` weight's split tiles."""
    return -(-n // TILE_ROWS) * TILE_ROWS * k * 2


def _kernels() -> SplitKernels:
    kernels = load_split_kernels()
    if kernels is None or not kernels.available:
        raise RuntimeError("the split-bf16 kernel needs AMX-BF16 (available() is False here)")
    return kernels


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The split tiles of an fp32 ``[n, k]`` weight (k a multiple of 32), into ``out`` (bf16,
    at least :func:`packed_elems` elements; a new tensor if None)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % CHUNK:
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)}: not fp32 [n, 32 j]")
    n, k = weight.shape
    w = weight.contiguous()
    need = packed_elems(n, k)
    if out is None:
        out = torch.empty(need, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or out.numel() < need or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 of at least {need} elements")
    parts = split_parts(n * k, 1 << 16, torch.get_num_threads())
    if _kernels()._pack(w.data_ptr(), n, k, out.data_ptr(), parts) != 0:
        raise ValueError(f"split_bf16 refused a weight of in_features {k}")
    return out


def linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` for fp32 ``x`` ``[m, k]`` (rows contiguous) over :func:`pack`'s tiles
    of an ``n``-row W; fp32 ``[m, n]``."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {x.dtype} {tuple(x.shape)}: not fp32 rows")
    m, k = x.shape
    if packed.dtype != torch.bfloat16 or packed.numel() < packed_elems(n, k):
        raise ValueError(f"packed: not the split tiles of {n} x {k}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"bias {tuple(bias.shape)}: not fp32 [{n}]")
    b = None if bias is None else bias.contiguous()
    y = torch.empty((m, n), dtype=torch.float32)
    parts = split_parts(m * n, MIN_PART_WORK, torch.get_num_threads())
    rc = _kernels()._linear(x.data_ptr(), m, x.stride(0), k, packed.data_ptr(), n,
                            None if b is None else b.data_ptr(), y.data_ptr(), parts)  # fmt: skip
    if rc == -2:
        raise MemoryError("split_bf16: no memory for the split activations")
    if rc != 0:
        raise ValueError(f"split_bf16 refused in_features {k}")
    return y


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``t`` as hi + lo, each bf16 (round to nearest even), as the kernel splits it."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in torch: xh.wh + xh.wl + xl.wh, products and sums in fp32."""
    xh, xl = (p.float() for p in split(x))
    wh, wl = (p.float() for p in split(weight))
    y = xh @ wh.T + xh @ wl.T + xl @ wh.T
    return y if bias is None else y + bias
