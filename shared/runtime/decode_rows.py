"""Which pool rows a decode step's torch paths read, per sliding window (torch_backend.py's
``TorchDecodeMetadata``, int8.py's ``TorchQuantDecodeMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def window_starts(context_lens: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The first key a decode query (at position ``len - 1``) sees: ``len - window``, or None
    (position 0) without a window."""
    return None if window is None else (context_lens - window).clamp_(min=0)


@dataclass
class DecodeRows:
    """Which pool rows a decode step reads for one window, as the torch paths index them.

    Column c of row b is position ``start[b] + c`` (start: the window's first key, else 0);
    ``L`` is the widest row of the batch; a shorter one's padding columns point at its last
    position and get probability exactly 0."""

    k_rows: torch.Tensor  # int64 [B, Hkv, L]: slot * Hkv + kv head
    mask: torch.Tensor  # fp32 [B * Hkv, 1, L] additive: 0 in the context, -inf in the padding
    # k_rows repeated for each query head of a group, [B * Hq, L]: built by the first layer
    # (the backend does not know the group), reused by the others.
    v_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,
        lens: torch.Tensor,
        starts: torch.Tensor | None,
        block_size: int,
        num_kv_heads: int,
    ) -> DecodeRows:
        """Positions ``starts .. lens - 1`` of each row (an empty range is all padding):
        ``tables`` int64 ``[B, blocks]``, ``lens`` int64 ``[B]`` (on the pool's device)."""
        batch, dev = lens.shape[0], lens.device
        spans = lens if starts is None else lens - starts
        width = int(spans.max())
        cols = torch.arange(width, device=dev)
        pos = cols if starts is None else starts[:, None] + cols
        pos = torch.minimum(pos.expand(batch, width), lens[:, None] - 1).clamp_(min=0)
        slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
        kv_heads = torch.arange(num_kv_heads, device=dev)[:, None]
        k_rows = slots[:, None, :] * num_kv_heads + kv_heads
        padding = cols >= spans[:, None]
        mask = torch.zeros(batch, width, device=dev).masked_fill_(padding, float("-inf"))
        mask = mask[:, None, None, :].expand(batch, num_kv_heads, 1, width).flatten(0, 1)
        return cls(k_rows, mask)

    def per_query_head(self, group: int) -> torch.Tensor:
        if self.v_rows is None:
            batch, num_kv_heads, width = self.k_rows.shape
            rows = self.k_rows[:, :, None, :].expand(batch, num_kv_heads, group, width)
            self.v_rows = rows.reshape(batch * num_kv_heads * group, width)
        return self.v_rows


@dataclass
class DecodeBatch:
    """One decode step's block tables and lengths, and each window's rows built from them on
    first use (every layer of that window reuses them)."""

    tables: torch.Tensor  # int64 [B, max_blocks]
    lens: torch.Tensor  # int64 [B]
    block_size: int
    num_kv_heads: int
    _rows: dict[int | None, DecodeRows] = field(default_factory=dict)

    def rows(self, window: int | None) -> DecodeRows:
        rows = self._rows.get(window)
        if rows is None:
            starts = window_starts(self.lens, window)
            rows = DecodeRows.build(
                self.tables, self.lens, starts, self.block_size, self.num_kv_heads
            )
            self._rows[window] = rows
        return rows
