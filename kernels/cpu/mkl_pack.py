"""MKL's packed GEMM for fp32 projections on CPU: a weight packed once, at start-up.

``F.linear`` hands MKL a plain weight, and MKL copies it into its kernel's panel layout on
every call: at a decode step's few rows that copy is most of the call (the weight is read twice
and written once for a handful of output rows). ``cblas_sgemm_pack`` does that copy once and
``cblas_sgemm_compute`` runs on the packed panels: faster at decode's row counts, the most
for the widest weights (the LM head); equal at prefill's (docs/perf-log.md, "MKL packed
projections"). One or two rows stay on the plain weight: MKL's GEMV beats the packed kernel
there (shared/runtime/linear_layout.py).

The functions are MKL's own, exported by torch's CPU library where torch is built with MKL (the
x86 wheels); elsewhere :func:`available` is False and the weights stay plain. A packed weight is
at least MKL's minimum buffer (a few MB), and padded by panel for the others (packed_bytes;
linear_layout.py packs only where that stays small). Results equal
``F.linear``'s up to the last bits (a different kernel may sum in a different order).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

# CBLAS enums (mkl_cblas.h).
ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162
_I, _P, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float  # MKL_INT: torch's MKL is LP64


class _Mkl:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.get_size = lib.cblas_sgemm_pack_get_size
        self.get_size.argtypes = [_I, _I, _I, _I]
        self.get_size.restype = ctypes.c_size_t
        self.pack = lib.cblas_sgemm_pack
        self.pack.argtypes = [_I, _I, _I, _I, _I, _I, _F, _P, _I, _P]
        self.pack.restype = None
        self.compute = lib.cblas_sgemm_compute
        self.compute.argtypes = [_I, _I, _I, _I, _I, _I, _P, _I, _P, _I, _F, _P, _I]
        self.compute.restype = None


@functools.cache
def _mkl() -> _Mkl | None:
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return _Mkl(ctypes.CDLL(str(path)))  # already loaded by torch: the same handle
    except (OSError, AttributeError):  # no such library, or built without MKL
        return None


def available() -> bool:
    return torch.backends.mkl.is_available() and _mkl() is not None


def packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes MKL's packed form of an ``[out, in]`` fp32 weight takes (0 without MKL)."""
    mkl = _mkl()
    return int(mkl.get_size(B_MATRIX, 1, out_features, in_features)) if mkl else 0


class PackedWeight:
    """A ``[out, in]`` fp32 weight in MKL's packed panel layout; :meth:`linear` is
    ``F.linear(x, weight, bias)`` for 2-D ``x``; :class:`Projection` takes it from ``min_rows``
    rows (MKL's GEMV on the plain weight wins below)."""

    min_rows, max_rows = 4, 1 << 62

    def __init__(self, weight: torch.Tensor) -> None:
        mkl = _mkl()
        if mkl is None:
            raise RuntimeError("MKL's packed GEMM is not available in this torch build")
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"a 2-D fp32 CPU weight is required, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        w = weight.detach().contiguous()
        n, k = self.out_features, self.in_features
        size = mkl.get_size(B_MATRIX, 1, n, k)  # bytes; the same whatever the row count
        # Allocated by torch, so it lives exactly as long as this object.
        self._buffer = torch.empty(size, dtype=torch.uint8)
        self.nbytes = int(size)
        # C[m, n] = A[m, k] @ W.T: W is stored [n, k], so B = W transposed.
        mkl.pack(ROW_MAJOR, B_MATRIX, TRANS, 1, n, k, 1.0, w.data_ptr(), k,
                 self._buffer.data_ptr())  # fmt: skip
        self._compute = mkl.compute

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"x must be [rows, {self.in_features}] fp32, got {tuple(x.shape)}")
        x = x.contiguous()
        rows, n, k = x.shape[0], self.out_features, self.in_features
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            self._compute(ROW_MAJOR, NO_TRANS, PACKED, rows, n, k, x.data_ptr(), k,
                          self._buffer.data_ptr(), n, 0.0, out.data_ptr(), n)  # fmt: skip
        if bias is not None:
            out += bias
        return out
