"""Decode attention over an int8 cache (``BATON_KV_CACHE_DTYPE=int8``) and its full-precision
window (fp_window.py): each row reads its older positions as int8 rows (values, then the row's
scale) and its window's positions from the full-precision slots; one softmax over both.

Two paths, one metadata protocol (common.py): the C kernel of kernels/cpu/paged_decode_int8.py
on CPU in fp32 (:class:`Int8KernelDecodeMetadata`), torch elsewhere
(:class:`TorchQuantDecodeMetadata`).
Per window (sliding windows: the package docstring) each row's ranges are built once per step:
``bounds [B, 4]``: int8 positions ``[b0, b1)`` and window positions ``[b2, b3)``, the latter
relative to the window's first position (its slots' block table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.cpu.paged_decode_int8 import Int8Batch, Int8DecodeKernel
from shared.runtime.attention.common import StoreThenAttend, store_kv_torch
from shared.runtime.decode_rows import DecodeRows, window_starts
from shared.runtime.fp_window import FpBatch, FpWindow
from shared.runtime.kv_codec import Int8KV


def int8_bounds(
    lens: torch.Tensor, starts: torch.Tensor | None, fp_starts: torch.Tensor
) -> torch.Tensor:
    """``[B, 4]``: positions ``[start, min(fp_start, len))`` as int8 (none before ``start``) and
    ``[max(start, fp_start), len)`` from the window, relative to ``fp_start``."""
    first = torch.zeros_like(lens) if starts is None else starts
    int8_end = torch.minimum(torch.maximum(fp_starts, first), lens)
    window_start = (first - fp_starts).clamp(min=0)
    window_end = torch.maximum((lens - fp_starts).clamp(min=0), window_start)
    return torch.stack((first, int8_end, window_start, window_end), dim=1).contiguous()


@dataclass
class Int8DecodeBatch:
    """One step's tables, lengths and windows; each sliding window's ranges on first use."""

    tables: torch.Tensor  # int64 [B, blocks]
    lens: torch.Tensor  # int64 [B]
    fp_tables: torch.Tensor  # int64 [B, slots] (at least one column)
    fp_starts: torch.Tensor  # int64 [B]: each window's first position (lens: no window)
    block_size: int
    sub_block: int
    _bounds: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,
        context_lens: list[int],
        fp: FpBatch | None,
        fp_window: FpWindow | None,
        block_size: int,
        device: torch.device,
    ) -> Int8DecodeBatch:
        lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
        if fp is None or fp_window is None:
            fp_tables = torch.zeros(len(context_lens), 1, dtype=torch.int64, device=device)
            return cls(tables, lens, fp_tables, lens, block_size, block_size)
        width = max(1, max(len(t) for t in fp.tables))
        padded = [t + [0] * (width - len(t)) for t in fp.tables]
        fp_tables = torch.tensor(padded, dtype=torch.int64, device=device)
        starts = torch.tensor(fp.starts, dtype=torch.int64, device=device)
        return cls(tables, lens, fp_tables, starts, block_size, fp_window.sub_block)

    def bounds(self, window: int | None) -> torch.Tensor:
        got = self._bounds.get(window)
        if got is None:
            got = int8_bounds(self.lens, window_starts(self.lens, window), self.fp_starts)
            self._bounds[window] = got
        return got


@dataclass
class Store:
    """Writes a step's new K/V: int8 rows for every token, and the window's copies."""

    slot_mapping: torch.Tensor  # int64 [B]
    codec: Int8KV
    fp: FpBatch | None
    fp_window: FpWindow | None
    kernel: Int8DecodeKernel | None = None  # quantises in C (the same bytes)

    def __call__(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        if self.kernel is None or not self.kernel.store_kv(k, v, kv_layer, self.slot_mapping):
            store_kv_torch(k, v, kv_layer, self.slot_mapping, self.codec)
        if self.fp is not None and self.fp_window is not None:
            self.fp.store(self.fp_window.view(kv_layer), k, v)


class StoredByStore(StoreThenAttend):
    """Metadata of an int8 cache: its new rows go through its :class:`Store`."""

    store: Store

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.store.slot_mapping

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        self.store(k, v, kv_layer)


@dataclass
class Int8KernelDecodeMetadata(StoredByStore):
    """Through the C kernel: int8 rows and window slots read in place, once."""

    store: Store
    batch: Int8DecodeBatch
    scale: float
    kernel: Int8DecodeKernel
    _rows: dict[int | None, Int8Batch] = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        rows = self._rows.get(window)
        if rows is None:
            b = self.batch
            rows = Int8Batch(b.tables, b.fp_tables, b.bounds(window), b.block_size, b.sub_block)
            self._rows[window] = rows
        return self.kernel.attend(q, kv_layer, rows, self.scale)


@dataclass
class TorchQuantDecodeMetadata(StoredByStore):
    """Through torch: the batch's int8 K rows and V rows are each read with one index_select (as
    K is in TorchDecodeMetadata), then batched matmuls on the int8 values, the per-row scales
    folded in where they cost least: K's into the scores (``q . (s k) = s (q . k)``), V's into
    the probabilities. The window's rows are gathered from the slots and join the same softmax."""

    store: Store
    batch: Int8DecodeBatch
    scale: float
    num_kv_heads: int
    _rows: dict[int | None, tuple[DecodeRows, DecodeRows]] = field(default_factory=dict)

    def _window_rows(self, window: int | None) -> tuple[DecodeRows, DecodeRows]:
        """(int8 rows into the pool, window rows into the slots as a ``sub_block`` cache)."""
        got = self._rows.get(window)
        if got is None:
            b, hkv = self.batch, self.num_kv_heads
            bounds = b.bounds(window)
            int8 = DecodeRows.build(b.tables, bounds[:, 1], bounds[:, 0], b.block_size, hkv)
            fp = DecodeRows.build(b.fp_tables, bounds[:, 3], bounds[:, 2], b.sub_block, hkv)
            got = self._rows[window] = (int8, fp)
        return got

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        int8_rows, fp_rows = self._window_rows(window)
        batch, num_heads, head_dim = q.shape
        num_kv_heads = self.num_kv_heads
        qg = q.reshape(batch * num_kv_heads, num_heads // num_kv_heads, head_dim)
        codec, width = self.store.codec, kv_layer.shape[-1]
        n8, nf = int8_rows.k_rows.shape[-1], fp_rows.k_rows.shape[-1]
        shape8 = (batch * num_kv_heads, n8, head_dim)
        k_vals, k_scale = codec.split(
            kv_layer[0].view(-1, width).index_select(0, int8_rows.k_rows.view(-1))
        )
        scores8 = torch.bmm(qg, k_vals.to(q.dtype).view(shape8).transpose(1, 2))
        k_scale = k_scale.view(shape8[0], 1, n8)
        scores8 = torch.addcmul(int8_rows.mask, scores8, k_scale, value=self.scale)
        kf, vf = self._window_kv(kv_layer, fp_rows, q.dtype)
        scoresf = torch.baddbmm(fp_rows.mask.to(q.dtype), qg, kf.transpose(1, 2), alpha=self.scale)
        probs = torch.cat((scores8.float(), scoresf.float()), dim=-1).softmax(-1)
        v_vals, v_scale = codec.split(
            kv_layer[1].view(-1, width).index_select(0, int8_rows.k_rows.view(-1))
        )
        p8 = (probs[..., :n8] * v_scale.view(shape8[0], 1, n8)).to(q.dtype)
        out = torch.bmm(p8, v_vals.to(q.dtype).view(shape8))
        if nf:
            out += torch.bmm(probs[..., n8:].to(q.dtype), vf)
        return out.view(batch, num_heads, head_dim)

    def _window_kv(
        self, kv_layer: torch.Tensor, rows: DecodeRows, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's K and V rows ``[B * Hkv, L, D]`` out of the slots."""
        num_rows = rows.k_rows.shape[0] * rows.k_rows.shape[1]
        length = rows.k_rows.shape[-1]
        window = self.store.fp_window
        if window is None or not length:
            empty = torch.zeros(num_rows, length, kv_layer.shape[-1] - 4, dtype=dtype)
            return empty.to(kv_layer.device), empty.to(kv_layer.device)
        view = window.view(kv_layer)  # [2, slots, sub_block, Hkv, D], strided
        hkv = self.num_kv_heads
        flat = rows.k_rows.view(-1)
        slot, rest = flat // (window.sub_block * hkv), flat % (window.sub_block * hkv)
        offset, head = rest // hkv, rest % hkv
        k = view[0][slot, offset, head].view(num_rows, length, -1)
        v = view[1][slot, offset, head].view(num_rows, length, -1)
        return k.to(dtype), v.to(dtype)
