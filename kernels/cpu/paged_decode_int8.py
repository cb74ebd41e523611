"""CPU decode attention over an int8 cache with a full-precision window, through the C kernel of
``csrc/paged_decode_int8.c`` (fp32 queries; built and loaded like paged_decode_attention.py).

Each row reads its int8 positions from the packed rows (values and scale) and its window's
positions from the full-precision slots (fp_window.py), in place, once each; the softmax
between the two passes is torch's. Same numbers as the torch path (TorchQuantDecodeMetadata)
up to summation order (tests/runtime/test_fp_window.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_threaded, split_parts
from kernels.cpu.paged_decode_attention import MIN_ROWS_PER_THREAD

SOURCE = CSRC / "paged_decode_int8.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Int8Batch:
    """One step's tables and each row's two ranges, checked once (every layer of a window reads
    them): what the C code assumes and cannot check itself."""

    tables: torch.Tensor  # int64 [B, blocks]: the int8 blocks
    fp_tables: torch.Tensor  # int64 [B, slots]: the window's slots (at least one column)
    bounds: torch.Tensor  # int64 [B, 4]: int8 positions [b0, b1), window positions [b2, b3)
    block_size: int
    sub_block: int

    def __post_init__(self) -> None:
        for name, t in (("tables", self.tables), ("fp_tables", self.fp_tables),
                        ("bounds", self.bounds)):  # fmt: skip
            if t.dtype != torch.int64 or not t.is_contiguous() or t.dim() != 2:
                raise ValueError(f"{name} must be a contiguous int64 matrix")
        batch = self.bounds.shape[0]
        if self.tables.shape[0] != batch or self.fp_tables.shape[0] != batch:
            raise ValueError("one block table, one slot table and one range pair per row")
        if self.bounds.shape[1] != 4 or self.fp_tables.shape[1] < 1 or batch == 0:
            raise ValueError("bounds [B, 4] and a slot table of at least one column")
        b = self.bounds
        if bool(((b[:, 1] < b[:, 0]) | (b[:, 3] < b[:, 2]) | (b < 0).any(1)).any()):
            raise ValueError("a range ends before it starts")
        if int(b[:, 1].max()) > self.tables.shape[1] * self.block_size:
            raise ValueError("an int8 range is longer than its block table")
        if int(b[:, 3].max()) > self.fp_tables.shape[1] * self.sub_block:
            raise ValueError("a window range is longer than its slot table")

    @property
    def width(self) -> int:
        """Score columns: the widest row."""
        b = self.bounds
        return max(1, int((b[:, 1] - b[:, 0] + b[:, 3] - b[:, 2]).max()))


class Int8DecodeKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path, max_threads: int) -> None:
        self.path = path
        self._fn = lib.baton_paged_decode_int8
        self._fn.argtypes = [_I, _P, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _I]
        self._fn.restype = None
        self._store = lib.baton_store_int8
        self._store.argtypes = [_P, _I, _I, _I, _I, _P, _P]
        self._store.restype = None
        self.max_threads = max(1, max_threads)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        """:meth:`store` of both pools of one layer; False: not taken (the caller's torch path
        stores instead; nothing was written)."""
        return self.store(k, kv_layer[0], slots, check_only=True) and (
            self.store(k, kv_layer[0], slots) and self.store(v, kv_layer[1], slots)
        )

    def store(
        self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, check_only: bool = False
    ) -> bool:
        """Quantise ``x [T, Hkv, D]`` (fp32; tokens may be strided) into packed rows of ``pool``
        (one layer's K or V, int8 ``[blocks, bs, Hkv, D + 4]``) at ``slots`` — the bytes of
        kv_codec.Int8KV.encode. False (nothing written) for inputs it does not take."""
        num_tokens, num_kv_heads, head_dim = x.shape
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.stride()[1:] != (head_dim, 1)
            or pool.dtype != torch.int8
            or not pool.is_contiguous()
            or pool.shape[-2:] != (num_kv_heads, head_dim + 4)
            or slots.dtype != torch.int64
            or not slots.is_contiguous()
            or slots.shape != (num_tokens,)
        ):
            return False
        if check_only:
            return True
        if num_tokens and not 0 <= int(slots.min()) <= int(slots.max()) < pool[..., 0, 0].numel():
            raise ValueError("a slot outside the pool")
        self._store(x.data_ptr(), x.stride(0), num_tokens, num_kv_heads, head_dim,
                    slots.data_ptr(), pool.data_ptr())  # fmt: skip
        return True

    def attend(
        self, q: torch.Tensor, kv_layer: torch.Tensor, rows: Int8Batch, scale: float
    ) -> torch.Tensor:
        """q ``[B, Hq, D]`` fp32 -> ``[B, Hq, D]``; ``kv_layer`` int8 ``[2, blocks, bs, Hkv,
        D + 4]``, its window slots fp32."""
        batch, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, width = kv_layer.shape
        if q.dtype != torch.float32 or kv_layer.dtype != torch.int8:
            raise ValueError(f"fp32 queries over an int8 cache (q {q.dtype}, {kv_layer.dtype})")
        if q.device.type != "cpu" or not kv_layer.is_contiguous():
            raise ValueError("a contiguous CPU cache is required")
        if width != head_dim + 4 or num_heads % num_kv_heads or block_size != rows.block_size:
            raise ValueError(f"q {tuple(q.shape)} does not match the pool {tuple(kv_layer.shape)}")
        if batch != rows.bounds.shape[0]:
            raise ValueError("one row of ranges per query")
        q = q.contiguous()
        stride = rows.width
        scores = torch.empty(batch, num_heads, stride)
        out = torch.empty_like(q)
        parts = self.parts(batch)
        common = (
            rows.tables.data_ptr(), rows.tables.shape[1], rows.fp_tables.data_ptr(),
            rows.fp_tables.shape[1], rows.bounds.data_ptr(), batch, parts, num_heads,
            num_kv_heads, head_dim, block_size, rows.sub_block, scale,
        )  # fmt: skip
        self._fn(0, q.data_ptr(), kv_layer[0].data_ptr(), *common, scores.data_ptr(), stride)
        probs = scores.softmax(-1)
        self._fn(1, probs.data_ptr(), kv_layer[1].data_ptr(), *common, out.data_ptr(), stride)
        return out

    def parts(self, batch: int) -> int:
        """The batch's row ranges, as paged_decode_attention.DecodeKernel splits them."""
        return split_parts(
            batch, MIN_ROWS_PER_THREAD, min(self.max_threads, torch.get_num_threads())
        )


def load_int8_kernel(
    cache_dir: Path | None = None, max_threads: int | None = None
) -> Int8DecodeKernel | None:
    """Build (once per machine and source) and load the kernel; None if it cannot be built.
    ``max_threads``: as :func:`~kernels.cpu.build.load_threaded` says."""
    return load_threaded(Int8DecodeKernel, SOURCE, FLAGS, cache_dir, "the torch path", max_threads)
