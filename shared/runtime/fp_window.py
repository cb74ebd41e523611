"""int8 KV with a full-precision window (``BATON_KV_CACHE_DTYPE=int8``, ``BATON_KV_FP_WINDOW``).

Every token's K/V is stored as int8 with its per-(token, head) scale (kv_codec.py), and the last
``BATON_KV_FP_WINDOW`` tokens of each sequence (whole blocks) are *also* kept in the model's
dtype: attention reads the window from the full-precision copy and only older tokens as int8.
As a block ages out of the window its full-precision copy is released (block by block); its
int8 rows, written when the token was, are what attention reads from then on.

Where the full-precision copy lives: in the same int8 cache tensor, in extra blocks of the pool
(*slots*; the block manager hands them out with the blocks of the window and takes them back as
the blocks age). A block of ``block_size`` tokens in the model's dtype takes ``slots_per_block``
slots, each holding ``sub_block = block_size / slots_per_block`` of its tokens as
``[sub_block, Hkv, D]`` rows at the start of the slot: 4 slots in fp32, 2 in fp16/bf16 (a slot
is ``block_size * Hkv * (D + 4)`` bytes). Seen through :meth:`FpWindow.view`, the slots are a
paged cache of block size ``sub_block`` in the model's dtype, and a sequence's slots, in order,
are its block table from position ``fp_first_block * block_size`` on.

Why one tensor: every KV transport, swap and block copy moves block ids of the one cache tensor;
a handoff sends the window's slots after the int8 blocks (``KVDescriptor.fp_slots``) and nothing
below the engine knows. What it costs: the window's int8 blocks are written and held although
not read while the copy exists (``D + 4`` bytes per row beside ``itemsize * D``), and a slot is
``(D + 4) / (itemsize * D / slots_per_block)`` of what it holds (fp32, D=32: 144 bytes a row
for 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.runtime.kv_codec import SCALE_BYTES


@dataclass(frozen=True)
class FpWindow:
    tokens: int  # BATON_KV_FP_WINDOW
    block_size: int
    slots_per_block: int
    dtype: torch.dtype  # the model's

    @classmethod
    def plan(
        cls, tokens: int, block_size: int, head_dim: int, dtype: torch.dtype
    ) -> FpWindow | None:
        """The layout for an int8 cache of ``head_dim`` rows; None for ``tokens`` 0."""
        if tokens < 0:
            raise ValueError(f"BATON_KV_FP_WINDOW={tokens}: a number of tokens, 0 for none")
        if tokens == 0:
            return None
        slots = math.ceil(dtype.itemsize * head_dim / (head_dim + SCALE_BYTES))
        if block_size % slots:
            raise ValueError(
                f"BATON_KV_FP_WINDOW needs a block size divisible by {slots}, not {block_size}"
            )
        return cls(tokens, block_size, slots, dtype)

    @property
    def sub_block(self) -> int:
        return self.block_size // self.slots_per_block

    def view(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """One layer's int8 pools ``[2, blocks, bs, Hkv, D + 4]`` as slots of model-dtype rows
        ``[2, blocks, sub_block, Hkv, D]`` (strided: a slot's stride is the int8 block's)."""
        two, num_blocks, _, num_kv_heads, width = kv_layer.shape
        head_dim = width - SCALE_BYTES
        used = self.sub_block * num_kv_heads * head_dim * self.dtype.itemsize
        raw = kv_layer.view(two, num_blocks, -1)[:, :, :used]
        return raw.view(self.dtype).view(two, num_blocks, self.sub_block, num_kv_heads, head_dim)


@dataclass
class FpBatch:
    """One forward's full-precision windows: where each new token's copy goes, and each
    sequence's window (its first position and its slots as a ``sub_block`` block table)."""

    store_rows: torch.Tensor  # int64 [n]: rows of the forward's new tokens inside a window
    store_slots: torch.Tensor  # int64 [n]: their rows in the view, slot * sub_block + offset
    starts: list[int]  # per sequence: the first position read from the window
    tables: list[list[int]]  # per sequence: its slots

    def store(self, fp_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the new tokens of the window into their slots (``fp_layer``: :meth:`view`, whose
        slots are strided: indexed in place, never flattened, which would copy)."""
        if self.store_rows.numel():
            sub = fp_layer.shape[2]
            at = (self.store_slots // sub, self.store_slots % sub)
            fp_layer[0].index_put_(at, k.index_select(0, self.store_rows).to(fp_layer.dtype))
            fp_layer[1].index_put_(at, v.index_select(0, self.store_rows).to(fp_layer.dtype))


def fp_batch(
    window: FpWindow,
    spans: list[tuple[int, int]],
    firsts: list[int],
    tables: list[list[int]],
    device: torch.device,
) -> FpBatch:
    """``spans``: each sequence's new positions ``[start, end)`` in forward order; ``firsts``:
    its ``fp_first_block``; ``tables``: its slots."""
    bs, sub = window.block_size, window.sub_block
    rows: list[int] = []
    slots: list[int] = []
    offset = 0
    starts = []
    for (start, end), first, table in zip(spans, firsts, tables, strict=True):
        first_pos = first * bs
        starts.append(first_pos)
        for p in range(max(start, first_pos), end):
            rows.append(offset + p - start)
            slots.append(table[(p - first_pos) // sub] * sub + (p - first_pos) % sub)
        offset += end - start
    return FpBatch(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(slots, dtype=torch.int64, device=device),
        starts,
        tables,
    )
