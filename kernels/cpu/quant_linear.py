"""Linear layers over GGUF weights kept in GGML's Q8_0 / Q4_0 / Q4_1 block bytes, CPU, through the
C kernels of ``csrc/quant_linear.c`` (the formats and the torch reference: quant_formats.py).

:meth:`QuantWeight.linear` of ``M`` rows:

- ``M <= small_max_rows`` (default INT8_MAX_ROWS), ``small_mode`` "int8": llama.cpp's method.
  x is quantized per block of 32 to int8 (fp32 scale), each (weight block, x block) pair is
  an integer dot product (AVX-512 VNNI / AVX2 / portable C), scaled and summed in fp32. The
  packed bytes are read once (4.5-8.5 bits a weight) and no fp32 weight is made. Error: x's
  rounding to int8, at most ``amax_block / 254`` per element; ~5e-3 of the outputs' norm for
  Gaussian x (tests/runtime/test_quant_linear.py). A weight the decode engine holds is
  regrouped once into tiles of 16 rows (:meth:`QuantWeight.tile`, csrc/quant_tiles.c) where
  the build has their kernel (AVX-512 VNNI or AVX2): a vector's lane is then a weight row, so
  the fp32 work per block is paid once per sixteen (AVX2: eight) rows, not per four (two); the
  same rounding of x, the same bound.
- ``small_mode`` "int16", on a tiled weight only: x in two bytes a value per block of 32 (a
  high byte, the int8 kernel's rounding, and a low byte for what it left), two integer dots a
  (weight block, x block) pair combined exactly in int32: the int8 kernel's float work, twice
  its integer work, an error 1/256 of its (~4e-5 of the outputs' norm). About half the int8
  kernel's speed and twice SGEMM's at a prompt's rows (AVX-512 VNNI): the prefill engine's
  form (shared/runtime/linear_layout.py, ``packed_form``). From 16 rows it runs on AMX's int8
  tiles where the CPU has them (csrc/quant_tiles_amx.h), the same bits. An untiled weight takes
  dequantize + SGEMM instead.
- ``small_mode`` "bf16", on a tiled weight (the decode engine's form where the CPU has AMX):
  from :attr:`QuantKernels.bf16_rows` rows, a bf16 model's arithmetic on AMX's bf16 tiles
  (csrc/quant_tiles_bf16.h: each weight dequantized as the reference does and rounded once to
  bf16, x rounded to bf16, fp32 sums; ~2.4e-3 of the outputs' norm for Gaussian x, int8's
  ~5e-3); fewer rows, and CPUs without AMX, the int8 kernel. Its dequantize, once a call,
  costs what the int8 kernel spends on ~30 rows; above that the tile unit sums all of k where
  the int8 kernel pays float work per block and row: ~1.6x its pace at 64 rows.
- ``small_mode`` "f32" (up to F32_MAX_ROWS by default): the fp32 kernel, below.
- more rows: the weight is dequantized whole to fp32 (C, threaded, bit-equal to the reference)
  into a per-thread scratch and multiplied by MKL's SGEMM: exactly
  ``F.linear(x, dequantize(W), b)``; or, where ``many_rows`` is "split" and the CPU has AMX,
  by the split-bf16 kernel (kernels/cpu/split_bf16.py: x and w each two bf16s, three tile
  products; ~4e-6 of the outputs' norm), the prefill engine's "bf16x3". (An LM head meets
  it only when logits of many positions are asked for; its fp32 copy, hundreds of MB for a
  large vocabulary, is then made per call, not kept.)

Without a C compiler every call is ``F.linear(x, quant_formats.dequantize(W), b)``.

The int8 kernel keeps pace with SGEMM per row from a few rows on, so dequantizing the whole
weight pays only once its cost spreads over many rows: INT8_MAX_ROWS = 128 is where the two
paths meet, and the exact path runs above it (``python -m loadtest.engine.quant_linear_bench``; the
tables: docs/perf-log.md, "Quantized linear kernels"). That is the row layout's limit: the tiled
kernel stays ahead of SGEMM at every row count, and the engines that tile a weight lift it
(shared/runtime/linear_layout.py, ``packed_form``).

The fp32 kernel (``small_mode="f32"``, a constructor keyword and attribute; "int8" is the
default): each weight block is dequantized in registers (bit-equal to the reference) and
multiplied into fp32 accumulators by FMA, x kept fp32, so the result is ``F.linear(x,
dequantize(W), b)`` up to the fp32 sums' order. It is about half the int8 kernel's speed at
every row count, bound by one execution port (the nibble expansion, two vpermps, the fp16 scale
converts and broadcasts per row), so "int8" stays the default (speed, at the cost of x's
rounding); "f32" is there for exactness (e.g. parity with Hugging Face). Its threshold,
F32_MAX_ROWS = 16: it beats dequantize + SGEMM at 16 rows and loses at 64. ``small_max_rows`` (a
keyword and attribute) overrides either threshold per weight; 0: always dequantize + SGEMM.

Each call splits its work into ``torch.get_num_threads()`` parts (read at each call), fewer for a
small call (:data:`MIN_PART_WORK`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu import cpu_isa, onednn_pack, split_bf16
from kernels.cpu.build import CSRC, load_library, split_parts
from kernels.cpu.quant_formats import (
    BLOCK,
    QuantType,
    as_qtype,
    dequantize,
    row_bytes,
)

SOURCE = CSRC / "quant_linear.c"
TILES_SOURCE = CSRC / "quant_tiles.c"  # the tiled layout and its int8 kernel
# -ffp-contract=off: the dequantize entry's (d * q) + m must round twice, as gguf-py does.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-fPIC",
         "-shared", "-std=c11")  # fmt: skip
# Rows up to which the int8 kernel runs; above it dequantize + SGEMM (the module docstring).
INT8_MAX_ROWS = 128
# The small-M kernels: "f32" (dequantize in registers, fp32 FMA) or "int8" (x rounded to int8).
SMALL_MODES = ("f32", "int8", "int16", "bf16")
SMALL_MODE = "int8"  # the fp32 kernel is about half its speed (the module docstring)
# What fp32 calls above small_max_rows run: "sgemm" (dequantize + SGEMM, exact up to the sums'
# order) or "split" (dequantize, split into bf16 pairs, AMX: kernels/cpu/split_bf16.py).
# "bf16": x and the dequantized weight rounded to bf16, a bf16 GEMM (where the CPU has one; else
# sgemm), the result widened back: a bf16 model's arithmetic.
MANY_ROWS = ("sgemm", "split", "bf16")
# Rows up to which the fp32 kernel runs by default: it beats dequantize + SGEMM at 16 rows, loses
# at 64 (the module docstring).
F32_MAX_ROWS = 16
# Work a part of an int8 call has at least (linear_parts' units): about where two threads break
# even with one (a one-row call over a 128 x 576 weight); smaller calls stay whole.
MIN_PART_WORK = 1 << 11
# Elements a part of a dequantize has at least: enough work to outweigh waking a thread.
MIN_PART_ELEMS = 1 << 16
# The dequantize path keeps its fp32 scratch per thread up to this size; larger weights take a
# fresh buffer each call (held memory over allocation cost, e.g. a large vocabulary's head).
SCRATCH_MAX_BYTES = 64 << 20

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def bf16_gemm() -> bool:
    """Whether a bf16 GEMM runs natively here (oneDNN's bf16: AMX or AVX512-BF16, and the
    process's ISA setting allows it); else bf16 calls compute in fp32."""
    return cpu_isa.computes_bf16() and onednn_pack.available(torch.bfloat16)


def row_ids(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``ids`` flat, contiguous int64, checked to name rows of a ``num_rows``-row weight: what a
    C gather (an embedding's lookup) needs and cannot check itself."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be integer, got {ids.dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < num_rows):
        raise IndexError(f"row ids out of range for {num_rows} rows")
    return flat


def linear_parts(m: int, n: int, k: int) -> int:
    """How many ranges an int8 call of ``m`` rows over an ``n x k`` weight splits into: its
    work counted in (weight row x 8 x rows x 32 inputs) steps, as the kernel's tiles run."""
    return split_parts(n * ((m + 7) // 8) * (k // BLOCK), MIN_PART_WORK, torch.get_num_threads())


def dequant_parts(n: int, k: int) -> int:
    return split_parts(n * k, MIN_PART_ELEMS, torch.get_num_threads())


class QuantKernels:
    """The C library: the int8 and fp32 linears and the dequantize."""

    def __init__(
        self, lib: ctypes.CDLL, path: Path, tiles: tuple[ctypes.CDLL, Path] | None = None
    ) -> None:
        self.path = path
        self._linear = lib.baton_quant_linear
        self._linear.argtypes = [_P, _I, _I, _I, _P, _I, _I, _P, _P, _I]
        self._linear.restype = ctypes.c_int
        self._linear_f32 = lib.baton_quant_linear_f32
        self._linear_f32.argtypes = self._linear.argtypes
        self._linear_f32.restype = ctypes.c_int
        self._dequant = lib.baton_quant_dequantize
        self._dequant.argtypes = [_P, _I, _I, _I, _P, _I]
        self._dequant.restype = ctypes.c_int
        isa = lib.baton_quant_path
        isa.argtypes, isa.restype = [], ctypes.c_char_p
        self.isa: str = isa().decode()  # "avx512-vnni", "avx2-vnni", "avx2" or "portable"
        f32_isa = lib.baton_quant_f32_path
        f32_isa.argtypes, f32_isa.restype = [], ctypes.c_char_p
        self.f32_isa: str = f32_isa().decode()  # "avx512", "avx2" or "portable"
        # The tiled layout (csrc/quant_tiles.c): rows a tile holds, 0 where this build has no
        # kernel for it (or its library did not build): weights then keep their row layout.
        self.tile_rows = 0
        self.bf16_rows = 0
        self.tiles_isa = "none"
        if tiles is not None:
            self._attach_tiles(tiles[0])

    def _attach_tiles(self, lib: ctypes.CDLL) -> None:
        self._tiles_linear = lib.baton_quant_tiles_linear
        self._tiles_linear_wide = lib.baton_quant_tiles_linear_wide
        # the wide kernel on vpdpbusd whatever the CPU (what AMX's tiles are checked against)
        self._tiles_linear_wide_vnni = lib.baton_quant_tiles_linear_wide_vnni
        # a bf16 model's arithmetic on AMX's bf16 tiles (csrc/quant_tiles_bf16.h) at every row
        # count (-3 without AMX), and small_mode "bf16"'s kernel: those tiles from bf16_rows rows
        self._tiles_linear_bf16 = lib.baton_quant_tiles_linear_bf16
        self._tiles_linear_amx_bf16 = lib.baton_quant_tiles_linear_amx_bf16
        # the int8 kernel and small_mode "bf16"'s, x and y bf16: a bf16 model's decode program
        self._tiles_linear_io16 = lib.baton_quant_tiles_linear_io16
        self._tiles_linear_amx_bf16_io16 = lib.baton_quant_tiles_linear_amx_bf16_io16
        for fn in (
            self._tiles_linear,
            self._tiles_linear_wide,
            self._tiles_linear_wide_vnni,
            self._tiles_linear_bf16,
            self._tiles_linear_amx_bf16,
            self._tiles_linear_io16,
            self._tiles_linear_amx_bf16_io16,
        ):
            fn.argtypes, fn.restype = self._linear.argtypes, ctypes.c_int
        self._tiles_pack = lib.baton_quant_tiles_pack
        self._tiles_pack.argtypes = [_P, _I, _I, _I, _P]
        self._tiles_unpack = lib.baton_quant_tiles_unpack
        self._tiles_unpack.argtypes = [_P, _I, _I, _P, _I, _P]
        self._tiles_dequant = lib.baton_quant_tiles_dequantize
        self._tiles_dequant.argtypes = [_P, _I, _I, _P, _I, _P, _I]
        for fn in (self._tiles_pack, self._tiles_unpack, self._tiles_dequant):
            fn.restype = ctypes.c_int
        rows = lib.baton_quant_tile_rows
        rows.argtypes, rows.restype = [], ctypes.c_int64
        isa = lib.baton_quant_tiles_path
        isa.argtypes, isa.restype = [], ctypes.c_char_p
        wide_isa = lib.baton_quant_tiles_wide_path
        wide_isa.argtypes, wide_isa.restype = [], ctypes.c_char_p
        self.tile_rows = int(rows())
        bf16_rows = lib.baton_quant_tiles_bf16_rows
        bf16_rows.argtypes, bf16_rows.restype = [], ctypes.c_int64
        # rows from which small_mode "bf16" runs on AMX's bf16 tiles; 0: no AMX here
        self.bf16_rows = int(bf16_rows())
        self.tiles_isa = isa().decode()  # "avx512-vnni", "avx2" or "none"
        # the wide kernel's unit from 16 rows: "amx-int8" (the same result), else tiles_isa
        self.wide_isa: str = wide_isa().decode()

    def io16_twin(self, fn: Callable[..., int]) -> Callable[..., int] | None:
        """The entry that runs the tiled small kernel ``fn`` on bf16 x and y, the bits of
        widening x, ``fn`` and torch's rounding of y (but where ``fn`` runs the bf16 tiles: a
        denormal y flushed to zero); None where ``fn`` has none."""
        if fn is self._tiles_linear:
            return self._tiles_linear_io16
        if fn is self._tiles_linear_amx_bf16:
            return self._tiles_linear_amx_bf16_io16
        return None

    def linear(
        self, raw: torch.Tensor, qtype: int, k: int, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ dequantize(raw).T + bias`` by the int8 kernel: ``raw`` contiguous uint8,
        ``x`` fp32 ``[M, k]`` with contiguous rows, ``bias`` None or contiguous fp32 ``[N]``
        (unchecked: QuantWeight.linear checks)."""
        return self._run(self._linear, raw.data_ptr(), int(qtype), raw.shape[0], k, x, bias)

    def linear_f32(
        self, raw: torch.Tensor, qtype: int, k: int, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """As :meth:`linear` by the fp32 kernel: ``F.linear(x, dequantize(raw), bias)`` up to
        the order of the fp32 sums."""
        return self._run(self._linear_f32, raw.data_ptr(), int(qtype), raw.shape[0], k, x, bias)

    def linear_tiles(
        self,
        tiles: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        wide: bool = False,
        amx: bool = True,
    ) -> torch.Tensor:
        """As :meth:`linear` over the :meth:`pack_tiles` form of an ``n``-row weight (the same
        rounding of x; the fp32 sums in another order); ``wide``: x in two bytes a value
        (small_mode "int16"), from 16 rows on AMX's tiles where :attr:`wide_isa` says so, unless
        ``amx`` is False (the same result)."""
        fn = self._tiles_linear
        if wide:
            fn = self._tiles_linear_wide if amx else self._tiles_linear_wide_vnni
        return self._run(fn, tiles.data_ptr(), int(qtype), n, k, x, bias)

    def linear_tiles_bf16(
        self,
        tiles: torch.Tensor,
        qtype: int,
        n: int,
        k: int,
        x: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """As :meth:`linear_tiles` in a bf16 model's arithmetic on AMX's bf16 tiles at every row
        count (csrc/quant_tiles_bf16.h): ``F.linear`` over x and the dequantized weight each
        rounded to bf16, up to the fp32 sums' order. Where :attr:`bf16_rows` is 0 (no AMX) it
        raises."""
        return self._run(self._tiles_linear_bf16, tiles.data_ptr(), int(qtype), n, k, x, bias)

    def _run(
        self,
        fn: Callable[..., int],
        raw: int,
        qtype: int,
        n: int,
        k: int,
        x: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        m = x.shape[0]
        if x.dtype is torch.bfloat16:  # an io16 entry's rows (io16_twin)
            out = torch.empty((m, n), dtype=torch.bfloat16)
        else:
            out = torch.empty(m, n)  # the short form: half the call's cost of the dtype= one
            if out.dtype is not torch.float32:  # a process that changed torch's default dtype
                out = torch.empty((m, n), dtype=torch.float32)
        rc = fn(raw, qtype, n, k, x.data_ptr(), m, x.stride(0),
                None if bias is None else bias.data_ptr(), out.data_ptr(),
                linear_parts(m, n, k))  # fmt: skip
        if rc != 0:
            if rc == -2:
                raise MemoryError("quant_linear: no memory for the quantized activations")
            if rc == -3:
                raise RuntimeError("quant_linear: this build or CPU has no such kernel")
            raise ValueError(f"quant_linear refused type {qtype} with in_features {k}")
        return out

    def dequantize(self, raw: torch.Tensor, qtype: QuantType, k: int, out: torch.Tensor) -> None:
        """``out`` (contiguous fp32, ``raw.shape[0] * k`` elements) = dequantize(raw)."""
        n = raw.shape[0]
        rc = self._dequant(raw.data_ptr(), int(qtype), n, k, out.data_ptr(), dequant_parts(n, k))
        if rc != 0:
            raise ValueError(f"quant_dequantize refused {qtype!r} with in_features {k}")

    def pack_tiles(self, raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
        """The rows of ``raw`` (contiguous, GGML's layout) regrouped into tiles of
        :attr:`tile_rows` (csrc/quant_tiles.c), padded with zero rows to a multiple of it."""
        n, tr = raw.shape[0], self.tile_rows
        if tr == 0:
            raise ValueError(f"this build ({self.tiles_isa}) has no tiled kernel")
        tiles = torch.empty(-(-n // tr) * tr, raw.shape[1], dtype=torch.uint8)
        if self._tiles_pack(raw.data_ptr(), int(qtype), n, k, tiles.data_ptr()) != 0:
            raise ValueError(f"quant_tiles refused {qtype!r} with in_features {k}")
        return tiles

    def unpack_tiles(
        self, tiles: torch.Tensor, qtype: QuantType, k: int, n: int, ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows ``ids`` (contiguous int64, in range; None: the first ``n``) of a tiled weight
        in GGML's row layout."""
        count = n if ids is None else ids.numel()
        out = torch.empty(count, tiles.shape[1], dtype=torch.uint8)
        rc = self._tiles_unpack(tiles.data_ptr(), int(qtype), k,
                                None if ids is None else ids.data_ptr(), count,
                                out.data_ptr())  # fmt: skip
        if rc != 0:
            raise ValueError(f"quant_tiles refused {qtype!r} with in_features {k}")
        return out

    def dequantize_tiles(
        self,
        tiles: torch.Tensor,
        qtype: QuantType,
        k: int,
        out: torch.Tensor,
        n: int,
        ids: torch.Tensor | None,
    ) -> None:
        """``out`` (contiguous fp32) = dequantize of rows ``ids`` (contiguous int64, in range;
        None: the first ``n``) of a tiled weight, bit-equal to :meth:`dequantize`."""
        count = n if ids is None else ids.numel()
        rc = self._tiles_dequant(tiles.data_ptr(), int(qtype), k,
                                 None if ids is None else ids.data_ptr(), count, out.data_ptr(),
                                 dequant_parts(count, k))  # fmt: skip
        if rc != 0:
            raise ValueError(f"quant_tiles refused {qtype!r} with in_features {k}")


@functools.cache
def load_quant_kernels(cache_dir: Path | None = None) -> QuantKernels | None:
    """The kernels, built (once per machine and source) and loaded once per process; None
    without a compiler (the torch reference serves)."""
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's dequantize + F.linear")
    if loaded is None:
        return None
    tiles = load_library(TILES_SOURCE, FLAGS, cache_dir, fallback="the row layout's kernel")
    return QuantKernels(*loaded, tiles)


_DEFAULT = object()  # a QuantWeight built without kernels: the process's, loaded at first use
_scratch = threading.local()


def _scratch_for(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of ``numel`` elements of ``dtype``, this thread's (reused) up to
    SCRATCH_MAX_BYTES."""
    if numel * dtype.itemsize > SCRATCH_MAX_BYTES:
        return torch.empty(numel, dtype=dtype)
    buf: torch.Tensor | None = getattr(_scratch, str(dtype), None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, str(dtype), buf)
    return buf[:numel]


class QuantWeight:
    """A ``[out_features, in_features]`` weight in GGML's block bytes (``raw``: uint8
    ``[out_features, in_features / 32 * block_bytes]``, contiguous), and its linear.

    ``kernels``: the C kernels to run (None: the torch reference); by default the process's,
    loaded at first use. ``small_mode`` (:data:`SMALL_MODES`): the kernel for calls of up to
    ``small_max_rows`` rows (default :data:`F32_MAX_ROWS` for "f32", :data:`INT8_MAX_ROWS`
    for "int8"); more rows take dequantize + SGEMM (or the split-bf16 kernel where
    ``many_rows``, :data:`MANY_ROWS`, is "split" and the CPU has AMX; a bf16 GEMM where it is
    "bf16" and the CPU has one). All three are
    attributes a caller may set (e.g. ``small_max_rows = 0``: always dequantize + SGEMM);
    ``select_rows`` and ``cat`` keep them.

    :meth:`tile` regroups ``raw`` in place into tiles of 16 rows (csrc/quant_tiles.c) where the
    build has their int8 kernel (AVX-512 VNNI or AVX2): the decode engine's form. ``raw`` then
    holds the tiles (its rows padded to a multiple of 16) and every method serves as before; the
    int8 kernel's results equal the row layout's up to the order of the fp32 sums, a tiled
    weight's "f32" small mode is dequantize + SGEMM."""

    # Projection.project hands every row count to linear (int8 kernel or dequantize + SGEMM).
    min_rows = 1
    max_rows = 1 << 62

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: int,
        in_features: int,
        kernels: QuantKernels | None | object = _DEFAULT,
        *,
        small_mode: str = SMALL_MODE,
        small_max_rows: int | None = None,
        many_rows: str = "sgemm",
    ) -> None:
        self.qtype = as_qtype(qtype)
        if many_rows not in MANY_ROWS:
            raise ValueError(f"many_rows must be one of {MANY_ROWS}, got {many_rows!r}")
        self.many_rows = many_rows
        if small_mode not in SMALL_MODES:
            raise ValueError(f"small_mode must be one of {SMALL_MODES}, got {small_mode!r}")
        self.small_mode = small_mode
        if small_max_rows is None:
            small_max_rows = F32_MAX_ROWS if small_mode == "f32" else INT8_MAX_ROWS
        self.small_max_rows = small_max_rows
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.device.type != "cpu":
            raise ValueError(f"packed weight must be a 2-D uint8 CPU tensor, got {raw.dtype} "
                             f"{tuple(raw.shape)} on {raw.device}")  # fmt: skip
        if raw.shape[1] != row_bytes(self.qtype, in_features):
            raise ValueError(
                f"{self.qtype.name} rows of {in_features} weights take "
                f"{row_bytes(self.qtype, in_features)} bytes, got {raw.shape[1]}"
            )
        self.raw = raw.contiguous()
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.tiled = False  # raw holds tiles (tile), not rows
        self._kernels = kernels
        self._raw_ptr = self.raw.data_ptr()  # raw is never written: the address is fixed
        self._qtype = int(self.qtype)
        self._bias_shape = torch.Size([self.out_features])

    @property
    def kernels(self) -> QuantKernels | None:
        if self._kernels is _DEFAULT:
            self._kernels = load_quant_kernels()
        return self._kernels  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def __repr__(self) -> str:
        tiled = ", tiled" if self.tiled else ""
        return f"QuantWeight({self.qtype.name}, {self.out_features} x {self.in_features}{tiled})"

    def tile(self) -> bool:
        """Regroup ``raw`` into the tiled layout if the kernels have it (True; already tiled:
        True); else leave it (False). The row bytes are freed unless someone else holds them."""
        kernels = self.kernels
        if self.tiled or kernels is None or kernels.tile_rows == 0:
            return self.tiled
        self.raw = kernels.pack_tiles(self.raw, self.qtype, self.in_features)
        self._raw_ptr = self.raw.data_ptr()
        self.tiled = True
        return True

    def _row_bytes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (None: all) in GGML's row layout, whatever ``raw`` holds."""
        if not self.tiled:
            return self.raw if ids is None else self.raw.index_select(0, ids)
        kernels = self.kernels
        assert kernels is not None  # a weight is tiled only by its kernels
        return kernels.unpack_tiles(self.raw, self.qtype, self.in_features, self.out_features,
                                    ids)  # fmt: skip

    def _like(self, raw: torch.Tensor) -> QuantWeight:
        return QuantWeight(raw, self.qtype, self.in_features, self._kernels,
                           small_mode=self.small_mode, small_max_rows=self.small_max_rows,
                           many_rows=self.many_rows)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out_features, in_features]``, bit-equal to gguf-py's dequantize."""
        return self._dequantize()

    def _dequantize(
        self, out: torch.Tensor | None = None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``ids`` (contiguous int64, checked in range; None: all) dequantized, into
        ``out`` if given."""
        kernels = self.kernels
        n = self.out_features if ids is None else ids.numel()
        if kernels is None:
            return dequantize(self._row_bytes(ids), self.qtype, self.in_features)
        if out is None:
            out = torch.empty(n, self.in_features, dtype=torch.float32)
        if self.tiled:
            kernels.dequantize_tiles(self.raw, self.qtype, self.in_features, out, n, ids)
        else:
            kernels.dequantize(self._row_bytes(ids), self.qtype, self.in_features, out)
        return out.view(n, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``[*ids.shape, in_features]``: rows ``ids`` dequantized (an embedding lookup)."""
        flat = row_ids(ids, self.out_features)
        return self._dequantize(ids=flat).view(*ids.shape, self.in_features)

    def select_rows(self, order: torch.Tensor) -> QuantWeight:
        """The weight of rows ``order`` (a permutation or selection of output features), in the
        row layout."""
        return self._like(self._row_bytes(order.long().contiguous()))

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """The rows of ``parts`` (one type, one in_features) stacked: a fused projection, in the
        row layout."""
        if not parts:
            raise ValueError("nothing to concatenate")
        first = parts[0]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            raise ValueError("packed weights to fuse must share a type and in_features")
        return first._like(torch.cat([p._row_bytes() for p in parts]))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, self.dequantize(), bias)`` for 2-D fp32 or bf16 CPU ``x``, in x's
        dtype: up to the fp32 sums' order, but for the int8 kernel's rounding of x in
        small_mode "int8" (up to small_max_rows rows). bf16 computes in fp32, except above
        small_max_rows where the CPU has a native bf16 GEMM (:meth:`linear_dequantized_bf16`:
        the weight rounded to bf16)."""
        kernels = self.kernels
        if (
            x.dtype is torch.float32
            and x.is_cpu
            and x.dim() == 2
            and x.stride()[1] == 1
            and x.shape[1] == self.in_features
            and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()
                                  and bias.shape == self._bias_shape))
            and kernels is not None
            and 0 < x.shape[0] <= self.small_max_rows
        ):  # fmt: skip
            # the decode step's case, checked in as few torch calls as possible
            fn = self._small_kernel(kernels)
            if fn is not None:
                return kernels._run(fn, self._raw_ptr, self._qtype, self.out_features,
                                    self.in_features, x, bias)  # fmt: skip
        return self._linear(x, bias)

    def _small_kernel(self, kernels: QuantKernels) -> Callable[..., int] | None:
        """The C linear of calls up to small_max_rows rows; None: dequantize + SGEMM."""
        if self.small_mode == "f32":
            return None if self.tiled else kernels._linear_f32
        if self.small_mode == "int16":
            return kernels._tiles_linear_wide if self.tiled else None
        if self.small_mode == "bf16" and self.tiled:
            return kernels._tiles_linear_amx_bf16
        return kernels._tiles_linear if self.tiled else kernels._linear

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or not x.is_cpu:
            raise ValueError(f"x {tuple(x.shape)} on {x.device}: not CPU rows of "
                             f"{self.in_features} features")  # fmt: skip
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x must be fp32 or bf16, got {x.dtype}")
        if bias is not None and bias.shape != self._bias_shape:
            raise ValueError(f"bias {tuple(bias.shape)}: not [{self.out_features}]")
        dtype = x.dtype
        bf16 = dtype is torch.bfloat16 or self.many_rows == "bf16"
        if bf16 and x.shape[0] > self.small_max_rows and bf16_gemm():
            y = self.linear_dequantized_bf16(x.to(torch.bfloat16), bias)
            return y if dtype is torch.bfloat16 else y.float()
        b = None if bias is None else bias.to(torch.float32).contiguous()
        kernels = self.kernels
        m = x.shape[0]
        small = None if kernels is None or m > self.small_max_rows else self._small_kernel(kernels)
        if small is not None and kernels is not None and dtype is torch.bfloat16 and m:
            io16 = kernels.io16_twin(small)  # bf16 rows as they are: the same bits
            if io16 is not None and x.stride(1) == 1:
                return kernels._run(io16, self._raw_ptr, self._qtype, self.out_features,
                                    self.in_features, x, b)  # fmt: skip
        xf = x.float() if dtype != torch.float32 else x
        if xf.stride(1) != 1:
            xf = xf.contiguous()
        if kernels is None:
            y = F.linear(xf, dequantize(self.raw, self.qtype, self.in_features), b)
        elif m == 0:
            y = xf.new_zeros(0, self.out_features)
        elif small is not None:
            y = kernels._run(small, self._raw_ptr, self._qtype, self.out_features,
                             self.in_features, xf, b)  # fmt: skip
        elif self.many_rows == "split" and split_bf16.available():
            y = self.linear_split(xf, b)
        else:
            y = self.linear_dequantized(xf, b)
        return y if dtype == torch.float32 else y.to(dtype)

    def linear_dequantized_bf16(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The path above small_max_rows for bf16 ``x`` where the CPU computes bf16 natively
        (AMX / AVX512-BF16): the weight dequantized (fp32, exact) and rounded once to bf16, then
        a bf16 GEMM, as a bf16 model of the dequantized weights computes. A prompt's forward
        runs several times faster than in fp32 (docs/perf-log.md, "Dense tiles for decode's
        projections")."""
        scratch = _scratch_for(self.out_features * self.in_features)
        w = self._dequantize(scratch).to(torch.bfloat16)
        b = None if bias is None else bias.to(torch.bfloat16)
        return F.linear(x if x.stride(1) == 1 else x.contiguous(), w, b)

    def linear_split(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The path above small_max_rows where ``many_rows`` is "split" (and the CPU has AMX):
        the weight dequantized (fp32, exact) into this thread's scratch, split into bf16 pairs
        (kernels/cpu/split_bf16.py), three tile products a chunk: ``F.linear(x,
        self.dequantize(), bias)`` to ~4e-6 of the outputs' norm."""
        n, k = self.out_features, self.in_features
        w = self._dequantize(_scratch_for(n * k))
        packed = split_bf16.pack(w, _scratch_for(split_bf16.packed_elems(n, k), torch.bfloat16))
        return split_bf16.linear(x, packed, n, bias)

    def linear_dequantized(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The path above small_max_rows for any fp32 ``x``: the weight dequantized into this
        thread's scratch, then ``F.linear`` (exactly ``F.linear(x, self.dequantize(), bias)``)."""
        scratch = _scratch_for(self.out_features * self.in_features)
        return F.linear(x, self._dequantize(scratch), bias)
