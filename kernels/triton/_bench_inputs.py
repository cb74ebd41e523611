"""What the kernel benchmarks (bench.py) time on: one attention shape and random paged caches.

Each kernel module's ``bench_*`` builds its inputs here, so every benchmark of a run times the
same heads, head size, block size and dtype (bench.py's table: 32 query / 8 KV heads of 128,
bf16, blocks of 16), and a sequence's blocks lie at random places in the pool, as a served
cache's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class BenchShape:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, device=self.device, dtype=self.dtype)

    def cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool of ``num_blocks`` blocks ``[num_blocks, block_size, Hkv, D]``."""
        size = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(size, device=self.device, dtype=self.dtype)

    def block_tables(self, batch: int, tokens: int) -> torch.Tensor:
        """int32 ``[batch, blocks]``: ``batch`` sequences of ``tokens`` in blocks of a pool of
        exactly their blocks, each at a random place."""
        blocks_per_seq = triton.cdiv(tokens, self.block_size)
        ids = torch.randperm(batch * blocks_per_seq, device=self.device, dtype=torch.int32)
        return ids.view(batch, blocks_per_seq)


@dataclass
class DecodeInputs:
    """One decode step: q ``[B, Hq, D]`` over random caches of ``context_len`` tokens each."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float

    @classmethod
    def random(cls, shape: BenchShape, batch: int, context_len: int) -> DecodeInputs:
        block_tables = shape.block_tables(batch, context_len)
        k_cache = shape.cache(block_tables.numel()).normal_()
        v_cache = torch.randn_like(k_cache)
        lens = torch.full((batch,), context_len, device=shape.device, dtype=torch.int32)
        q = shape.randn(batch, shape.num_q_heads, shape.head_dim)
        return cls(q, k_cache, v_cache, block_tables, lens, shape.scale)


BENCH = BenchShape()  # every benchmark's default
