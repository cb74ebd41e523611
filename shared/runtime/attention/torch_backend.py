"""The torch backend (any device; the CPU path): decode and prefill metadata, and the backend that
builds them, with the C kernels of cpu_kernels.py and the int8 paths of int8.py where they apply."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch
import torch.nn.functional as F

from kernels.cpu.paged_decode_attention import DecodeKernel, KernelBatch
from kernels.cpu.paged_decode_int8 import Int8DecodeKernel
from kernels.cpu.prefill_attention import FreshPrompts, PrefillKernel
from shared.runtime.attention.common import (
    FLOAT_KV,
    AttentionMetadata,
    StoreThenAttend,
    block_rows,
    block_table_tensor,
    gather_blocks,
    store_kv_torch,
)
from shared.runtime.attention.cpu_kernels import CpuKernelDecodeMetadata, KernelPrompts
from shared.runtime.attention.int8 import (
    Int8DecodeBatch,
    Int8KernelDecodeMetadata,
    Store,
    TorchQuantDecodeMetadata,
)
from shared.runtime.decode_rows import DecodeBatch
from shared.runtime.fp_window import FpBatch, FpWindow
from shared.runtime.kv_codec import Int8KV, KVCodec

log = structlog.get_logger(__name__)


@dataclass
class TorchDecodeMetadata(StoreThenAttend):
    """Decode attention read off the pools, shared by every layer of one step.

    K: one index_select of the ``(slot, kv head)`` rows of the pool viewed as ``[slots * Hkv,
    D]``, straight into ``[B * Hkv, L, D]``, the layout of one batched ``q @ Kᵀ`` (each KV head
    with its group of query heads; q head h uses KV head h // group, as in repeat_kv). V is never
    copied: ``embedding_bag`` sums each query head's V rows weighted by its probabilities, in
    place (see :class:`DecodeRows` for the columns).

    On CPU a decode step streams every running sequence's KV from memory; this reads it once
    and writes one K copy, where gathering K and V for SDPA wrote both and read them twice.
    """

    slot_mapping: torch.Tensor  # int64 [B]
    batch: DecodeBatch
    scale: float
    codec: KVCodec  # a float cache: the model's dtype, or bf16 (widened as it is read)

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        store_kv_torch(k, v, kv_layer, self.slot_mapping, self.codec)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        rows = self.batch.rows(window)
        batch, num_heads, head_dim = q.shape
        _, num_kv_heads, context = rows.k_rows.shape
        group = num_heads // num_kv_heads
        keys = kv_layer[0].view(-1, head_dim).index_select(0, rows.k_rows.view(-1))
        keys = self.codec.decode(keys, q.dtype)
        scores = torch.baddbmm(
            rows.mask.to(q.dtype),
            q.reshape(batch * num_kv_heads, group, head_dim),
            keys.view(batch * num_kv_heads, context, head_dim).transpose(1, 2),
            alpha=self.scale,
        )
        probs = scores.float().softmax(-1).to(q.dtype)  # fp32 softmax; no-op casts in fp32
        if kv_layer.dtype != q.dtype:  # a bf16 cache under an fp32 model: V widened as read
            values = kv_layer[1].view(-1, head_dim).index_select(0, rows.k_rows.view(-1))
            values = self.codec.decode(values, q.dtype).view(batch * num_kv_heads, context, -1)
            return torch.bmm(probs, values).view(batch, num_heads, head_dim)
        v_rows = rows.per_query_head(group)
        out = F.embedding_bag(
            v_rows,
            kv_layer[1].view(-1, head_dim),
            mode="sum",
            per_sample_weights=probs.view(v_rows.shape),
        )
        return out.view(batch, num_heads, head_dim)


@dataclass
class _Context:
    """The keys one prefill sequence's queries read from the cache under one window."""

    kv_rows: torch.Tensor  # its blocks from the window's first one, see gather_blocks
    first: int  # the position of the first row gathered (a block boundary)
    mask: torch.Tensor  # bool [n, context_len - first]: causal (and windowed), offset


@dataclass
class _PrefillSeq:
    query_start: int
    query_end: int
    context_len: int  # prefix + this chunk
    block_table: list[int]
    cached: bool  # the chunk continues a computed prefix: keys come from the cache
    # int8 with a full-precision window (fp_window.py): its first position and its slots.
    fp_start: int | None = None
    fp_table: list[int] = field(default_factory=list)
    _contexts: dict[int | None, _Context] = field(default_factory=dict)
    _fresh_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def context(
        self, window: int | None, num_blocks: int, block_size: int, device: torch.device
    ) -> _Context:
        """Blocks and mask for a chunk after a cached prefix: query i sits at position
        ``ctx - n + i`` and sees keys ``max(0, pos - window + 1) .. pos``."""
        got = self._contexts.get(window)
        if got is None:
            n, ctx = self.query_end - self.query_start, self.context_len
            first = 0 if window is None else max(0, ctx - n - window + 1) // block_size
            nblk = (ctx + block_size - 1) // block_size
            ids = torch.tensor(self.block_table[first:nblk], device=device)
            q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
            k_pos = torch.arange(first * block_size, ctx, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            got = _Context(block_rows(ids, num_blocks), first * block_size, mask)
            self._contexts[window] = got
        return got

    def read_window(
        self, kv: torch.Tensor, first: int, fp: FpWindow, kv_layer: torch.Tensor
    ) -> None:
        """Overwrite the rows of ``kv`` (positions ``first ..``, read as int8) that the
        full-precision window holds with its copies."""
        if self.fp_start is None or self.context_len <= max(first, self.fp_start):
            return
        lo = max(first, self.fp_start)
        rel = torch.arange(lo - self.fp_start, self.context_len - self.fp_start)
        slots = torch.tensor(self.fp_table, device=kv.device)[(rel // fp.sub_block).to(kv.device)]
        rows = fp.view(kv_layer)[:, slots, (rel % fp.sub_block).to(kv.device)]
        kv[:, lo - first : self.context_len - first] = rows.to(kv.dtype)

    def fresh_mask(self, window: int, device: torch.device) -> torch.Tensor:
        """A fresh prompt's causal mask within ``window`` (SDPA has no windowed is_causal)."""
        mask = self._fresh_masks.get(window)
        if mask is None:
            pos = torch.arange(self.query_end - self.query_start, device=device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            self._fresh_masks[window] = mask
        return mask


@dataclass
class TorchPrefillMetadata(StoreThenAttend):
    slot_mapping: torch.Tensor  # int64 [T]
    seqs: list[_PrefillSeq]  # those SDPA computes
    scale: float
    codec: KVCodec  # how the cache stores rows: a cached prefix is read back through it
    fresh: KernelPrompts | None = None
    fp: FpBatch | None = None  # int8's full-precision window: stored, and read back
    fp_window: FpWindow | None = None
    int8_kernel: Int8DecodeKernel | None = None  # quantises the new rows in C (same bytes)

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        kernel = self.int8_kernel
        if kernel is None or not kernel.store_kv(k, v, kv_layer, self.slot_mapping):
            store_kv_torch(k, v, kv_layer, self.slot_mapping, self.codec)
        if self.fp is not None and self.fp_window is not None:
            self.fp.store(self.fp_window.view(kv_layer), k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        if self.fresh is not None:
            self.fresh.kernel.attend(q, k, v, self.fresh.prompts, self.scale, out, window)
        num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
        for s in self.seqs:
            rows = slice(s.query_start, s.query_end)
            mask = None
            if not s.cached:
                ks, vs = k[rows], v[rows]
                if window is not None and s.query_end - s.query_start > window:
                    mask = s.fresh_mask(window, q.device)
            else:
                ctx = s.context(window, num_blocks, block_size, q.device)
                blocks = gather_blocks(kv_layer, ctx.kv_rows)
                kv = self.codec.decode(blocks, q.dtype).flatten(1, 2)
                if self.fp_window is not None:
                    s.read_window(kv, ctx.first, self.fp_window, kv_layer)
                span = s.context_len - ctx.first
                ks, vs = kv[0, :span], kv[1, :span]
                mask = ctx.mask
            # Repeating K/V per query head lets SDPA take its fused CPU kernel (its enable_gqa
            # path falls back to unfused math on CPU).
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
        codec: KVCodec = FLOAT_KV,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
        fp_window: FpWindow | None = None,
        int8_kernel: Int8DecodeKernel | None = None,
    ):
        """``decode_kernel`` / ``prefill_kernel``: decode attention / fresh prompts' prefill
        attention through the C kernels (fp32 on CPU, a float cache); None = the torch path.
        ``fp_window``: an int8 cache's full-precision window; ``int8_kernel``: its decode
        attention through C (fp32 on CPU)."""
        self.codec = codec
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.fp_window = fp_window
        self.int8_kernel = int8_kernel
        kernels = [
            n
            for n, k in (
                ("decode", decode_kernel),
                ("prefill", prefill_kernel),
                ("int8", int8_kernel),
            )
            if k
        ]
        if kernels:
            self.name = "torch+c-" + "+".join(kernels)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.device = device

    def decode_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        fp: FpBatch | None = None,
    ) -> AttentionMetadata:
        """``fp``: the step's full-precision windows (an int8 cache with BATON_KV_FP_WINDOW)."""
        dev, bs = self.device, self.block_size
        context = max(context_lens)
        max_blocks = (context + bs - 1) // bs
        tables = block_table_tensor(block_tables, max_blocks, torch.int64, dev)
        if self.decode_kernel is not None:
            lens_tensor = torch.tensor(context_lens, dtype=torch.int64)
            return CpuKernelDecodeMetadata(
                torch.tensor(slot_mapping, dtype=torch.int64),
                KernelBatch(tables, lens_tensor, context, bs),
                self.scale,
                self.decode_kernel,
                self.codec,
            )
        slot_tensor = torch.tensor(slot_mapping, dtype=torch.int64, device=dev)
        if isinstance(self.codec, Int8KV):
            store = Store(slot_tensor, self.codec, fp, self.fp_window, self.int8_kernel)
            batch8 = Int8DecodeBatch.build(tables, context_lens, fp, self.fp_window, bs, dev)
            if self.int8_kernel is not None:
                return Int8KernelDecodeMetadata(store, batch8, self.scale, self.int8_kernel)
            return TorchQuantDecodeMetadata(store, batch8, self.scale, self.num_kv_heads)
        lens = torch.tensor(context_lens, dtype=torch.int64, device=dev)
        batch = DecodeBatch(tables, lens, bs, self.num_kv_heads)
        return TorchDecodeMetadata(slot_tensor, batch, self.scale, self.codec)

    def prefill_metadata(
        self,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        fp: FpBatch | None = None,
    ) -> TorchPrefillMetadata:
        seqs: list[_PrefillSeq] = []
        fresh: list[tuple[int, int]] = []
        start = 0
        for i, (bt, n, ctx) in enumerate(zip(block_tables, query_lens, context_lens, strict=True)):
            if n == ctx and self.prefill_kernel is not None:
                fresh.append((start, start + n))
            else:
                seq = _PrefillSeq(start, start + n, ctx, bt, cached=n != ctx)
                if fp is not None:
                    seq.fp_start, seq.fp_table = fp.starts[i], fp.tables[i]
                seqs.append(seq)
            start += n
        kernel_prompts = None
        if fresh and self.prefill_kernel is not None:
            prompts = FreshPrompts.of(fresh, start)
            kernel_prompts = KernelPrompts(self.prefill_kernel, prompts)
        return TorchPrefillMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            seqs=seqs,
            scale=self.scale,
            codec=self.codec,
            fresh=kernel_prompts,
            fp=fp,
            fp_window=self.fp_window,
            int8_kernel=self.int8_kernel,
        )
