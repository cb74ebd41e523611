"""fp32 / bf16 projections over weights regrouped into tiles of 16 rows (``csrc/dense_tiles.c``):
the decode engine's form of an unquantized weight where the build has the kernel.

:meth:`DenseTileWeight.linear` is ``F.linear(x, weight, bias)`` for any row count, summed in
another order: one accumulation chain along k per output (bf16: ``vdpbf16ps`` pairs or AMX's
``tdpbf16ps``, fp32 sums, one rounding to bf16 after the bias), so a row's result does not
depend on the batch it came in. It reads the weight once per call at a decode step's row counts
(four tiles at once for up to 3 rows, two tiles against blocks of 12 for more) and runs at the
memory's pace there, where oneDNN's and MKL's small-M paths do not (docs/perf-log.md, "Dense
tiles for decode's projections"). The layouts: the C file.

Builds: fp32 on AVX-512F or AVX2 + FMA; bf16 on AVX512-BF16, through AMX where the CPU has it.
:func:`available` says whether a dtype has its kernel here. Each call splits the weight's
groups of 16 rows into ``torch.get_num_threads()`` parts (read at each call), fewer for a small
call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu.build import CSRC, load_library, split_parts
from kernels.cpu.quant_linear import row_ids

SOURCE = CSRC / "dense_tiles.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11")
TILE_ROWS = 16
DTYPES = (torch.float32, torch.bfloat16)
# Weight elements x rows a part of a call has at least: about where two threads beat one on a
# 576 x 576 weight at one row (waking the team costs a few microseconds).
MIN_PART_WORK = 1 << 17

_P, _I = ctypes.c_void_p, ctypes.c_int64


def padded_rows(n: int) -> int:
    return (n + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS


def linear_parts(m: int, n: int, k: int) -> int:
    """How many ranges a call of ``m`` rows over an ``n x k`` weight splits into."""
    return split_parts(padded_rows(n) * k * m, MIN_PART_WORK, torch.get_num_threads())


def tile_bias(bias: torch.Tensor, n: int) -> torch.Tensor:
    """The bias as the kernel reads it: 16 at a time, the last group's padding too."""
    return F.pad(bias, (0, padded_rows(n) - n)) if n % TILE_ROWS else bias.contiguous()


class DenseTileKernels:
    """The C library: regroup into tiles, gather rows back, the fp32 and bf16 linears."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._pack = lib.baton_dense_tiles_pack
        self._pack.argtypes, self._pack.restype = [_P, _I, _I, _I, _P], ctypes.c_int
        self._rows = lib.baton_dense_tiles_rows
        self._rows.argtypes, self._rows.restype = [_P, _I, _I, _P, _I, _P], ctypes.c_int
        self._linear = {}
        self.isa: dict[torch.dtype, str] = {}  # the kernel's path per dtype; "" = none
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            isa = getattr(lib, f"baton_dense_tiles_{suffix}_isa")
            isa.argtypes, isa.restype = [], ctypes.c_char_p
            self.isa[dtype] = isa().decode()
            if self.isa[dtype]:
                fn = getattr(lib, f"baton_dense_tiles_linear_{suffix}")
                fn.argtypes, fn.restype = [_P, _I, _I, _I, _P, _P, _P, _I], ctypes.c_int
                self._linear[dtype] = fn

    def has(self, dtype: torch.dtype) -> bool:
        return dtype in self._linear

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The tiles of a 2-D ``[n, k]`` weight: ``[padded_rows(n), k]`` of its dtype."""
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(padded_rows(n), k, dtype=w.dtype)
        if self._pack(w.data_ptr(), w.dtype is torch.bfloat16, n, k, out.data_ptr()):
            raise ValueError(f"cannot tile a {tuple(w.shape)} {w.dtype} weight")
        return out

    def rows(self, tiles: torch.Tensor, ids: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rows ``ids`` (None: the first ``n``) of the weight ``tiles`` holds, ``[len, k]``."""
        k = tiles.shape[1]
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            n = ids.numel()
        out = torch.empty(n, k, dtype=tiles.dtype)
        ptr = None if ids is None else ids.data_ptr()
        if self._rows(tiles.data_ptr(), tiles.dtype is torch.bfloat16, k, ptr, n, out.data_ptr()):
            raise ValueError(f"cannot read rows of {tiles.dtype} tiles of width {k}")
        return out

    def linear(
        self, x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear(x, W, bias)`` of contiguous 2-D ``x`` over the tiles of ``W [n, k]``."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=x.dtype)
        bias = None if bias is None else tile_bias(bias, n)
        rc = self._linear[x.dtype](
            x.data_ptr(), m, n, k, tiles.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), linear_parts(m, n, k),
        )  # fmt: skip
        if rc:
            raise ValueError(f"no {x.dtype} tile kernel for width {k}")
        return y


@functools.cache
def load_dense_tile_kernels(cache_dir: Path | None = None) -> DenseTileKernels | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="oneDNN's or MKL's forms")
    return DenseTileKernels(*loaded) if loaded is not None else None


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this build has the tile kernel of ``dtype`` (fp32: AVX-512F or AVX2 + FMA; bf16:
    AVX512-BF16)."""
    kernels = load_dense_tile_kernels()
    return kernels is not None and kernels.has(dtype)


class DenseTileWeight:
    """A ``[out, in]`` fp32 or bf16 weight in tiles of 16 rows; :meth:`linear` is
    ``F.linear(x, weight, bias)`` for 2-D ``x`` of any row count."""

    min_rows = 1
    max_rows = 1 << 62

    def __init__(self, weight: torch.Tensor, kernels: DenseTileKernels | None = None) -> None:
        if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
            raise ValueError(f"a 2-D fp32/bf16 CPU weight is required, got {weight.dtype}")
        loaded = kernels or load_dense_tile_kernels()
        if loaded is None or not loaded.has(weight.dtype):
            raise ValueError(f"no {weight.dtype} tile kernel in this build")
        self.kernels = loaded
        if weight.dtype is torch.bfloat16 and weight.shape[1] % 2:
            raise ValueError("a bf16 weight's rows must have an even length")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.tiles = self.kernels.pack(weight)
        self.nbytes = self.tiles.numel() * self.tiles.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != self.dtype:
            raise ValueError(f"x must be [rows, {self.in_features}] {self.dtype}, got {x.shape}")
        if bias is not None and (bias.shape != (self.out_features,) or bias.dtype != self.dtype):
            raise ValueError(f"bias must be [{self.out_features}] {self.dtype}")
        return self.kernels.linear(x.contiguous(), self.tiles, self.out_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[*ids.shape, in_features]``: rows ``ids`` of the weight (a tied embedding's
        lookup)."""
        flat = row_ids(ids, self.out_features)
        return self.kernels.rows(self.tiles, flat, 0).view(*ids.shape, self.in_features)

    def weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight, read back from the tiles."""
        return self.kernels.rows(self.tiles, None, self.out_features)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What :meth:`DenseTileWeight.linear` computes, in torch: fp32 sums, bf16 rounded once."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)
