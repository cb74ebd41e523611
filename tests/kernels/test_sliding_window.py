"""Sliding-window attention in the Triton kernels (TRITON_INTERPRET=1 on CPU; scripts/gpu_check.sh
runs them on CUDA) against the torch references, with the blocks before every query's window
replaced by a block of NaNs: a read of a released block would show."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.triton.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.triton.prefill_attention import prefill_attention, prefill_attention_ref
from tests.kernels._utils import DEVICE, ON_GPU, assert_close, int32, make_paged_kv

BS = 16


def _release_before_window(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    first_keys: list[int],
) -> None:
    """Point every table entry wholly before a sequence's first visible key at a block of NaNs
    (one nobody owns, standing for a freed block)."""
    nan_block = int(block_tables[0, -1])  # make_paged_kv's padding entries: nobody's block
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    for b, first in enumerate(first_keys):
        block_tables[b, : first // BS] = nan_block


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sees_the_last_window_positions(window: int, num_splits: int) -> None:
    lens = [1, 5, BS, BS + 1, 3 * BS + 5, 70] + ([700, 2000] if ON_GPU else [])
    gen = torch.Generator().manual_seed(window)
    k_cache, v_cache, tables = make_paged_kv(lens, BS, 2, 32, torch.float32, gen)
    _release_before_window(k_cache, v_cache, tables, [max(0, n - window) for n in lens])
    q = torch.randn(len(lens), 4, 32, generator=gen).to(DEVICE)
    scale = 1 / math.sqrt(32)
    args = (q, k_cache, v_cache, tables, int32(lens), scale)
    out = paged_decode_attention(*args, num_splits=num_splits, window=window)
    assert not out.isnan().any()
    assert_close(out, paged_decode_attention_ref(*args, window=window))
    if window < max(lens):  # the window changes the answer
        assert not torch.allclose(out, paged_decode_attention_ref(*args), atol=1e-3)


@pytest.mark.parametrize("window", [1, 9, 16, 48])
def test_prefill_chunks_see_their_own_windows(window: int) -> None:
    """Fresh prompts, chunks behind a cached prefix, a one-token chunk: query position p sees
    p - window + 1 .. p."""
    pairs = [(1, 1), (37, 37), (BS, 3 * BS), (5, 90), (1, 70), (100, 100)]
    gen = torch.Generator().manual_seed(window)
    q_lens, seq_lens = [q for q, _ in pairs], [s for _, s in pairs]
    k_cache, v_cache, tables = make_paged_kv(seq_lens, BS, 2, 32, torch.float32, gen)
    first = [max(0, s - q - window + 1) for q, s in pairs]  # each chunk's first query's window
    _release_before_window(k_cache, v_cache, tables, first)
    q = torch.randn(sum(q_lens), 4, 32, generator=gen).to(DEVICE)
    cu = int32([sum(q_lens[:i]) for i in range(len(q_lens) + 1)])
    args = (q, k_cache, v_cache, cu, int32(seq_lens), tables, 1 / math.sqrt(32))
    out = prefill_attention(*args, window=window)
    assert not out.isnan().any()
    assert_close(out, prefill_attention_ref(*args, window=window))


def test_a_window_of_at_least_one_key() -> None:
    q = torch.zeros(1, 2, 32, device=DEVICE)
    cache = torch.zeros(2, BS, 2, 32, device=DEVICE)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), int32([3])
    with pytest.raises(ValueError, match="at least one key"):
        paged_decode_attention(q, cache, cache, table, lens, 1.0, window=0)
