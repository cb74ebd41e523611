"""Paged attention: store the new K/V at ``slot_mapping``, then attend over each sequence's KV.

The runner builds one metadata object per forward (tensors, masks, gather indices) through an
:class:`AttentionBackend`; every layer then calls :func:`attention` with it. Two backends:
- torch (any device, the CPU path): decode gathers each sequence's blocks into a padded
  ``[B, L, Hkv, D]`` view and runs one masked SDPA; prefill runs one SDPA per sequence, causal
  (``is_causal``) when it has no cached prefix, else with a causal-with-offset mask.
- triton (CUDA, when ``kernels`` imports; see attention_triton.py): the paged kernels read the
  pools in place.

Layer pools: ``kv_layer [2, num_blocks, block_size, Hkv, D]`` (0 = K, 1 = V), see ENGINE.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import structlog
import torch
import torch.nn.functional as F

from shared.engine.attention_triton import TritonAttentionBackend

log = structlog.get_logger(__name__)


class AttentionMetadata(Protocol):
    slot_mapping: torch.Tensor

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (the new tokens) -> ``[T, Hq, D]``."""
    return meta.forward(q, k, v, kv_layer)


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


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    flat = kv_layer.flatten(1, 2)  # [2, num_slots, Hkv, D], a view
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


@dataclass
class TorchDecodeMetadata:
    slot_mapping: torch.Tensor  # int64 [B]
    # int64 [2 * B * max_blocks]: the block tables padded with block 0, see gather_blocks.
    kv_rows: torch.Tensor
    mask: torch.Tensor  # bool [B, 1, 1, max_blocks * block_size]
    num_kv_heads: int
    scale: float

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        store_kv_torch(k, v, kv_layer, self.slot_mapping)
        batch, num_heads, head_dim = q.shape
        kv = gather_blocks(kv_layer, self.kv_rows).view(2, batch, -1, *kv_layer.shape[3:])
        # Grouped-query attention without repeating K/V: each KV head sees its group of query
        # heads as a short query sequence (q head h uses KV head h // group, as in repeat_kv).
        group = num_heads // self.num_kv_heads
        qg = q.view(batch, self.num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            qg, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=self.mask, scale=self.scale
        )
        return out.view(batch, num_heads, head_dim)


@dataclass
class _CachedPrefix:
    """A chunk that continues a computed prefix attends over the cache, not just itself."""

    kv_rows: torch.Tensor  # its blocks, see gather_blocks
    context_len: int  # prefix + this chunk
    mask: torch.Tensor  # bool [n, context_len]: causal, offset by the prefix


@dataclass
class _PrefillSeq:
    query_start: int
    query_end: int
    prefix: _CachedPrefix | None  # None: the chunk is the whole context (plain causal)


@dataclass
class TorchPrefillMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    seqs: list[_PrefillSeq]
    scale: float

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        store_kv_torch(k, v, kv_layer, self.slot_mapping)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for s in self.seqs:
            rows = slice(s.query_start, s.query_end)
            mask = None
            if s.prefix is None:
                ks, vs = k[rows], v[rows]
            else:
                kv = gather_blocks(kv_layer, s.prefix.kv_rows).flatten(1, 2)
                ks, vs = kv[0, : s.prefix.context_len], kv[1, : s.prefix.context_len]
                mask = s.prefix.mask
            # Repeating K/V per query head lets SDPA take its fused CPU kernel (~2x faster
            # than its enable_gqa path, which falls back to unfused math on CPU).
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                _per_query_head(ks, group),
                _per_query_head(vs, group),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
            )
            out[rows] = o[0].transpose(0, 1)
        return out


def _per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[n, Hkv, D]`` -> ``[1, Hkv * group, n, D]``, KV head h serving query heads
    ``h * group .. h * group + group - 1`` (transformers' repeat_kv order)."""
    n, num_kv_heads, head_dim = x.shape
    if group > 1:
        x = x[:, :, None].expand(n, num_kv_heads, group, head_dim).reshape(n, -1, head_dim)
    return x.transpose(0, 1)[None]


class TorchAttentionBackend:
    name = "torch"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        scale: float,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.device = device

    def decode_metadata(
        self, slot_mapping: list[int], block_tables: list[list[int]], context_lens: list[int]
    ) -> TorchDecodeMetadata:
        dev = self.device
        max_blocks = (max(context_lens) + self.block_size - 1) // self.block_size
        padded = [bt[:max_blocks] + [0] * (max_blocks - len(bt)) for bt in block_tables]
        lens = torch.tensor(context_lens, dtype=torch.int64, device=dev)
        span = torch.arange(max_blocks * self.block_size, device=dev)
        return TorchDecodeMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            kv_rows=block_rows(torch.tensor(padded, device=dev).flatten(), self.num_blocks),
            mask=(span[None, :] < lens[:, None])[:, None, None, :],
            num_kv_heads=self.num_kv_heads,
            scale=self.scale,
        )

    def prefill_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
    ) -> TorchPrefillMetadata:
        dev, bs = self.device, self.block_size
        seqs: list[_PrefillSeq] = []
        start = 0
        for bt, n, ctx in zip(block_tables, query_lens, context_lens, strict=True):
            if n == ctx:
                seqs.append(_PrefillSeq(start, start + n, None))
            else:
                nblk = (ctx + bs - 1) // bs
                kv_rows = block_rows(torch.tensor(bt[:nblk], device=dev), self.num_blocks)
                # Query i sits at position ctx - n + i and sees keys 0..ctx - n + i.
                q_pos = torch.arange(ctx - n, ctx, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
                seqs.append(_PrefillSeq(start, start + n, _CachedPrefix(kv_rows, ctx, mask)))
            start += n
        return TorchPrefillMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            seqs=seqs,
            scale=self.scale,
        )


AttentionBackend = TorchAttentionBackend | TritonAttentionBackend


def select_backend(
    device: torch.device, num_blocks: int, block_size: int, num_kv_heads: int, scale: float
) -> AttentionBackend:
    """Triton kernels on CUDA when the ``kernels`` package provides them, else pure torch."""
    if device.type == "cuda":
        try:
            import kernels

            needed = ("paged_decode_attention", "prefill_attention", "store_kv")
            # kernels imports lazily: the package loads without triton, its ops would not run.
            has_triton = getattr(kernels, "triton_available", lambda: True)()
            if has_triton and all(hasattr(kernels, name) for name in needed):
                return TritonAttentionBackend(kernels, block_size, scale, device)
            log.warning("triton kernels unavailable; using torch attention")
        except ImportError as exc:  # triton missing or broken on this host
            log.warning("triton kernels unavailable; using torch attention", error=str(exc))
    return TorchAttentionBackend(num_blocks, block_size, num_kv_heads, scale, device)
