"""Attention backend over the Triton kernels of ``kernels/`` (CUDA): paged, in place.

Same metadata protocol as the torch backend in attention.py. Block tables and lengths are int32
as the kernels expect; the host-side bounds (``max_context_len``, ``max_seqlen_q``) are passed
so the kernels never sync with the device to size their grids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def block_table_tensor(
    block_tables: list[list[int]], width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[B, width]`` block tables, cut or padded with block 0 (padding is never read: every
    backend masks positions past a sequence's context length). A freed block's null entry
    (outside every sliding window: never read either) reads as block 0 too."""
    padded = [bt[:width] + [0] * (width - len(bt)) for bt in block_tables]
    return torch.tensor(padded, dtype=dtype, device=device).clamp_(min=0)


@dataclass
class TritonDecodeMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    max_context_len: int  # host-side bound: no device sync to size the grid
    scale: float
    ops: Any

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        self.ops.store_kv(k, v, kv_layer[0], kv_layer[1], self.slot_mapping)
        return self.ops.paged_decode_attention(
            q,
            kv_layer[0],
            kv_layer[1],
            self.block_tables,
            self.context_lens,
            self.scale,
            max_context_len=self.max_context_len,
            window=window,
        )


@dataclass
class TritonPrefillMetadata:
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], context length after this chunk
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_seqlen_q: int
    scale: float
    ops: Any

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        self.ops.store_kv(k, v, kv_layer[0], kv_layer[1], self.slot_mapping)
        return self.ops.prefill_attention(
            q,
            kv_layer[0],
            kv_layer[1],
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
            self.scale,
            max_seqlen_q=self.max_seqlen_q,
            window=window,
        )


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, ops: Any, block_size: int, scale: float, device: torch.device):
        self.ops = ops
        self.block_size = block_size
        self.scale = scale
        self.device = device

    def _tables(self, block_tables: list[list[int]]) -> torch.Tensor:
        width = max(len(bt) for bt in block_tables)
        return block_table_tensor(block_tables, width, torch.int32, self.device)

    def decode_metadata(
        self, slot_mapping: list[int], block_tables: list[list[int]], context_lens: list[int]
    ) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            block_tables=self._tables(block_tables),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            max_context_len=max(context_lens),
            scale=self.scale,
            ops=self.ops,
        )

    def prefill_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
    ) -> TritonPrefillMetadata:
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
