"""Shapes, tolerances and paged-cache builders shared by the kernel tests.

Under the CPU interpreter every program runs in numpy, so shapes stay small; on CUDA the same
tests run at model-like sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (atol, rtol) against fp32-math references. Half-precision kernels round the softmax
# probabilities to the input dtype before the PV product, hence the looser bounds.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}

# Triton's interpreter evaluates tl.dot on numpy arrays, which have no bfloat16: bf16 dot
# products come back as garbage (seen with triton 3.9). Loads, stores and casts are fine.
BF16_DOT = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(INTERPRET, reason="triton interpreter computes bf16 tl.dot wrongly"),
)
ATTN_DTYPES = [torch.float32, torch.float16, BF16_DOT]

HEAD_DIM = 128 if ON_GPU else 32
# (num_q_heads, num_kv_heads): GQA ratios 1, 2 and 4.
HEAD_CONFIGS = [(8, 8), (16, 8), (32, 8)] if ON_GPU else [(2, 2), (4, 2), (8, 2)]

UNUSED_FILL = 30.0  # blocks no sequence owns: any leak into a result shows up loudly


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_paged_kv(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches and int32 block tables whose block ids are a random permutation.

    Each row has one padding entry past its last needed block (pointing at a real block), and
    a few blocks belong to nobody and hold UNUSED_FILL.
    """
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(needed, default=0) + 1
    block_tables = torch.empty(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        block_tables[b, :n] = perm[used : used + n].int()
        block_tables[b, n:] = perm[num_blocks - 1].int()
        tail = context_lens[b] % block_size
        if tail:  # positions past the context inside the sequence's last block
            k_cache[perm[used + n - 1], tail:] = UNUSED_FILL
            v_cache[perm[used + n - 1], tail:] = UNUSED_FILL
        used += n
    k_cache[perm[used:]] = UNUSED_FILL
    v_cache[perm[used:]] = UNUSED_FILL
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)
