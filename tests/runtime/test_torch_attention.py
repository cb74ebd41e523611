"""The torch decode attention (K gathered per KV head, V summed in place by embedding_bag)
against plain per-sequence attention over each sequence's own tokens."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.attention import TorchAttentionBackend

BS, D, NUM_BLOCKS = 16, 32, 24


def reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_tables: list[list[int]],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Softmax attention of each sequence's query over its first ``n`` cached tokens, in fp64,
    with KV heads repeated for their query heads (transformers' repeat_kv order)."""
    out = []
    group = q.shape[1] // pool.shape[-2]
    for i, (bt, n) in enumerate(zip(block_tables, context_lens, strict=True)):
        slots = [bt[p // BS] * BS + p % BS for p in range(n)]
        k = pool[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = pool[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def decode_inputs(
    num_kv_heads: int, num_heads: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, NUM_BLOCKS, BS, num_kv_heads, D, generator=g).to(dtype)
    q = torch.randn(5, num_heads, D, generator=g).to(dtype)
    k = torch.randn(5, num_kv_heads, D, generator=g).to(dtype)
    v = torch.randn(5, num_kv_heads, D, generator=g).to(dtype)
    return pool, q, k, v


# Lengths: one token; a full block; one past it; the longest (others padded to it); a table
# that holds more blocks than its context uses.
BLOCK_TABLES = [[3], [7], [1, 9], [2, 5, 11, 4], [8, 6, 13]]
CONTEXT_LENS = [1, 16, 17, 61, 20]
# Where each sequence's new token (position n - 1) goes.
SLOTS = [
    bt[(n - 1) // BS] * BS + (n - 1) % BS for bt, n in zip(BLOCK_TABLES, CONTEXT_LENS, strict=True)
]


@pytest.mark.parametrize(("num_kv_heads", "num_heads"), [(2, 4), (4, 4), (1, 4), (2, 8)])
def test_decode_matches_reference_and_stores_the_new_token(
    num_kv_heads: int, num_heads: int
) -> None:
    pool, q, k, v = decode_inputs(num_kv_heads, num_heads, torch.float32)
    backend = TorchAttentionBackend(NUM_BLOCKS, BS, num_kv_heads, D**-0.5, torch.device("cpu"))
    meta = backend.decode_metadata(SLOTS, BLOCK_TABLES, CONTEXT_LENS)
    got = meta.forward(q, k, v, pool)
    flat = pool.flatten(1, 2)
    assert torch.equal(flat[0, SLOTS], k) and torch.equal(flat[1, SLOTS], v)
    want = reference(q, pool, BLOCK_TABLES, CONTEXT_LENS, D**-0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_metadata_serves_every_layer() -> None:
    """One metadata object per step, used by each layer with its own pool and queries (the
    query-head rows are built by the first layer and reused)."""
    backend = TorchAttentionBackend(NUM_BLOCKS, BS, 2, D**-0.5, torch.device("cpu"))
    meta = backend.decode_metadata(SLOTS, BLOCK_TABLES, CONTEXT_LENS)
    for layer in range(3):
        pool, q, k, v = decode_inputs(2, 4, torch.float32, seed=layer)
        got = meta.forward(q, k, v, pool)
        want = reference(q, pool, BLOCK_TABLES, CONTEXT_LENS, D**-0.5)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_in_bfloat16() -> None:
    pool, q, k, v = decode_inputs(2, 4, torch.bfloat16)
    backend = TorchAttentionBackend(NUM_BLOCKS, BS, 2, D**-0.5, torch.device("cpu"))
    got = backend.decode_metadata(SLOTS, BLOCK_TABLES, CONTEXT_LENS).forward(q, k, v, pool)
    assert got.dtype == torch.bfloat16
    want = reference(q, pool, BLOCK_TABLES, CONTEXT_LENS, D**-0.5)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
