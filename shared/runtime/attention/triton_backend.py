"""Attention backend over the Triton kernels of ``kernels/`` (CUDA): paged, in place.

Same metadata protocol as the torch backend (torch_backend.py). Block tables and lengths are int32
as the kernels expect; the host-side bounds (``max_context_len``, ``max_seqlen_q``) are passed
so the kernels never sync with the device to size their grids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.runtime.attention.common import StoreThenAttend, block_table_tensor
from shared.runtime.attention.int8 import Store, StoredByStore
from shared.runtime.fp_window import FpBatch, FpWindow


@dataclass
class _TritonFloatMetadata(StoreThenAttend):
    """A float cache: the new rows stored by the store_kv kernel."""

    slot_mapping: torch.Tensor
    scale: float
    ops: Any

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        self.ops.store_kv(k, v, kv_layer[0], kv_layer[1], self.slot_mapping)


@dataclass
class TritonDecodeMetadata(_TritonFloatMetadata):
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    max_context_len: int  # host-side bound: no device sync to size the grid

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        return self.ops.paged_decode_attention(
            q, kv_layer[0], kv_layer[1], self.block_tables, self.context_lens, self.scale,
            max_context_len=self.max_context_len, window=window,
        )  # fmt: skip


@dataclass
class TritonPrefillMetadata(_TritonFloatMetadata):
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], context length after this chunk
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_seqlen_q: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        return self.ops.prefill_attention(
            q, kv_layer[0], kv_layer[1], self.cu_seqlens_q, self.seq_lens, self.block_tables,
            self.scale, max_seqlen_q=self.max_seqlen_q, window=window,
        )  # fmt: skip


@dataclass
class TritonInt8DecodeMetadata(StoredByStore):
    """An int8 cache: the packed rows read in place by the int8 specialisation of the decode
    kernel, its full-precision window (fp_window.py) from the slots, in one pass."""

    store: Store  # int8 rows and the window's copies, written by torch ops
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    max_context_len: int
    scale: float
    ops: Any
    fp_window: FpWindow | None
    fp_tables: torch.Tensor | None  # int32 [B, max_slots]
    fp_starts: torch.Tensor | None  # int32 [B]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        fp = None
        if self.fp_window is not None and self.fp_tables is not None and self.fp_starts is not None:
            from kernels.triton.paged_decode_attention import FullPrecisionWindow

            view = self.fp_window.view(kv_layer)
            fp = FullPrecisionWindow(view[0], view[1], self.fp_tables, self.fp_starts)
        return self.ops.paged_decode_attention_packed(
            q,
            kv_layer[0],
            kv_layer[1],
            self.block_tables,
            self.context_lens,
            self.scale,
            fp=fp,
            window=window,
            max_context_len=self.max_context_len,
        )


class TritonAttentionBackend:
    name = "triton"

    def __init__(
        self,
        ops: Any,
        block_size: int,
        scale: float,
        device: torch.device,
        int8_prefill: Any = None,
        fp_window: FpWindow | None = None,
    ):
        """``int8_prefill``: for an int8 cache, the torch backend its prefill goes through (the
        Triton prefill kernel reads float caches); decode runs the packed-row kernel."""
        self.ops = ops
        self.block_size = block_size
        self.scale = scale
        self.device = device
        self.int8_prefill = int8_prefill
        self.fp_window = fp_window
        if int8_prefill is not None:
            self.name = "triton-int8"

    def _tables(self, block_tables: list[list[int]]) -> torch.Tensor:
        width = max(len(bt) for bt in block_tables)
        return block_table_tensor(block_tables, width, torch.int32, self.device)

    def decode_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        fp: FpBatch | None = None,
    ) -> TritonDecodeMetadata | TritonInt8DecodeMetadata:
        if self.int8_prefill is not None:
            return self._int8_decode(slot_mapping, block_tables, context_lens, fp)
        return TritonDecodeMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            block_tables=self._tables(block_tables),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            max_context_len=max(context_lens),
            scale=self.scale,
            ops=self.ops,
        )

    def _int8_decode(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        fp: FpBatch | None,
    ) -> TritonInt8DecodeMetadata:

        dev = self.device
        slots = torch.tensor(slot_mapping, dtype=torch.int64, device=dev)
        fp_tables = fp_starts = None
        if fp is not None:
            width = max(1, max(len(t) for t in fp.tables))
            fp_tables = block_table_tensor(fp.tables, width, torch.int32, dev)
            fp_starts = torch.tensor(fp.starts, dtype=torch.int32, device=dev)
        return TritonInt8DecodeMetadata(
            Store(slots, self.int8_prefill.codec, fp, self.fp_window),
            self._tables(block_tables),
            torch.tensor(context_lens, dtype=torch.int32, device=dev),
            max(context_lens),
            self.scale,
            self.ops,
            self.fp_window,
            fp_tables,
            fp_starts,
        )

    def prefill_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        fp: FpBatch | None = None,
    ) -> Any:
        if self.int8_prefill is not None:
            return self.int8_prefill.prefill_metadata(
                slot_mapping, block_tables, query_lens, context_lens, fp
            )
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        return TritonPrefillMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            block_tables=self._tables(block_tables),
            max_seqlen_q=max(query_lens),
            scale=self.scale,
            ops=self.ops,
        )
