"""Metadata of the torch backend's C-kernel paths on CPU: decode attention read in place
(kernels/cpu/paged_decode_attention.py) and fresh prompts' prefill
(kernels/cpu/prefill_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.cpu.paged_decode_attention import DecodeKernel, KernelBatch
from kernels.cpu.prefill_attention import FreshPrompts, PrefillKernel
from shared.runtime.attention.common import StoreThenAttend, store_kv_torch
from shared.runtime.decode_rows import window_starts
from shared.runtime.kv_codec import KVCodec


@dataclass
class CpuKernelDecodeMetadata(StoreThenAttend):
    """Decode attention through the C kernel (kernels/cpu/paged_decode_attention.py): K and V
    read in place, once; the same numbers as :class:`TorchDecodeMetadata` up to summation order."""

    slot_mapping: torch.Tensor  # int64 [B]
    rows: KernelBatch  # block tables and context lengths, checked once per step
    scale: float
    kernel: DecodeKernel
    codec: KVCodec  # how the new rows are stored (a float cache: the model's dtype, or bf16)
    _windowed: dict[int, KernelBatch] = field(default_factory=dict)

    def store_new(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> None:
        store_kv_torch(k, v, kv_layer, self.slot_mapping, self.codec)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
               window: int | None) -> torch.Tensor:  # fmt: skip
        return self.kernel.attend(q, kv_layer, self.window_rows(window), self.scale)

    def window_rows(self, window: int | None) -> KernelBatch:
        if window is None:
            return self.rows
        rows = self._windowed.get(window)
        if rows is None:
            r = self.rows
            rows = KernelBatch(
                r.block_tables,
                r.context_lens,
                min(window, r.max_context_len),
                r.block_size,
                window_starts(r.context_lens, window),
            )
            self._windowed[window] = rows
        return rows


@dataclass
class KernelPrompts:
    """The fresh prompts the C prefill kernel computes (the other sequences take SDPA)."""

    kernel: PrefillKernel
    prompts: FreshPrompts
