"""What every attention backend shares: the metadata protocol each forward builds and every
layer calls, the KV store in torch, block gathering and block-table tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from shared.runtime.kv_codec import FloatKV, KVCodec


class AttentionMetadata(Protocol):
    @property
    def slot_mapping(self) -> torch.Tensor: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                window: int | None = None) -> torch.Tensor: ...  # fmt: skip


class StoreThenAttend:
    """The forward of every backend's metadata: the step's new K/V stored into the layer's pools
    (:meth:`store_new`), then attention over the cache, their own keys included
    (:meth:`attend`; ``k``/``v`` for the paths that read the new rows directly)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
        self.store_new(k, v, kv_layer)
        return self.attend(q, k, v, kv_layer, window)

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError


class LayerProgress:
    """Attention metadata that reports each layer once its KV is stored: layers call their
    attention in order, once per forward, so the n-th call has stored the first n layers."""

    def __init__(self, meta: AttentionMetadata, on_layer: Callable[[int], None]) -> None:
        self.meta, self.on_layer, self.layers = meta, on_layer, 0

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.meta.slot_mapping

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        out = self.meta.forward(q, k, v, kv_layer, window)
        self.stored()
        return out

    def stored(self) -> None:
        """One more layer's KV is in the cache (a forward that stores it another way, as the
        decode program does, says so here)."""
        self.layers += 1
        self.on_layer(self.layers)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (the new tokens) -> ``[T, Hq, D]``; ``window``:
    this layer's sliding window (None: every earlier key)."""
    return meta.forward(q, k, v, kv_layer, window)


def gather_blocks(kv_layer: torch.Tensor, kv_rows: torch.Tensor) -> torch.Tensor:
    """Blocks of both pools as ``[2, n, block_size, Hkv, D]``; ``kv_rows`` indexes the layer
    viewed as ``2 * num_blocks`` rows (K block b is row b, V block b row num_blocks + b).

    One index_select over whole-block rows: a parallel row memcpy, several times faster on CPU
    than advanced indexing of the 5-D pool.
    """
    num_rows = kv_rows.shape[0]
    rows = kv_layer.view(-1, kv_layer[0, 0].numel()).index_select(0, kv_rows)
    return rows.view(2, num_rows // 2, *kv_layer.shape[2:])


def block_rows(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return torch.cat((block_ids, block_ids + num_blocks))


FLOAT_KV = FloatKV()


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec: KVCodec = FLOAT_KV,
) -> None:
    flat = kv_layer.flatten(1, 2)  # [2, num_slots, Hkv, row width], a view
    flat[0].index_copy_(0, slot_mapping, codec.encode(k))
    flat[1].index_copy_(0, slot_mapping, codec.encode(v))


def block_table_tensor(
    block_tables: list[list[int]], width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[B, width]`` block tables, cut or padded with block 0 (padding is never read: every
    backend masks positions past a sequence's context length). A freed block's null entry
    (outside every sliding window: never read either) reads as block 0 too."""
    padded = [bt[:width] + [0] * (width - len(bt)) for bt in block_tables]
    return torch.tensor(padded, dtype=dtype, device=device).clamp_(min=0)
