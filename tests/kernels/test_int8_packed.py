"""The decode kernel over an int8 cache of packed rows (kv_codec.py's layout: D values, then
the fp32 scale) read in place, with and without a full-precision window in slots of a float
view (shared/runtime/fp_window.py) and a sliding window, against the torch reference
(TRITON_INTERPRET=1 on CPU; scripts/gpu_check.sh runs it on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.triton.int8_kv import (
    paged_decode_attention_packed,
    paged_decode_attention_packed_ref,
    quantize_kv_ref,
)
from kernels.triton.paged_decode_attention import FullPrecisionWindow
from tests.kernels._utils import DEVICE, assert_close, int32

BS, HKV, D, SUB = 16, 2, 32, 4


def _packed(num_blocks: int, g: torch.Generator) -> torch.Tensor:
    values, scale = quantize_kv_ref(torch.randn(num_blocks, BS, HKV, D, generator=g))
    return torch.cat((values, scale[..., None].view(torch.int8)), dim=-1).to(DEVICE)


@pytest.mark.parametrize("with_fp", [False, True])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_packed_rows_and_the_window_match_the_reference(
    with_fp: bool, window: int | None, num_splits: int
) -> None:
    g = torch.Generator().manual_seed(7)
    lens = [1, 9, BS + 5, 70]
    k_pool, v_pool = _packed(24, g), _packed(24, g)
    tables = int32([[1 + 5 * b + i for i in range(5)] for b in range(len(lens))])
    q = torch.randn(len(lens), 4, D, generator=g).to(DEVICE)
    fp = None
    if with_fp:  # each window: its last whole blocks, from a block boundary
        starts = [max(0, n - 24) // BS * BS for n in lens]
        fk = torch.randn(60, SUB, HKV, D, generator=g).to(DEVICE)
        fv = torch.randn(60, SUB, HKV, D, generator=g).to(DEVICE)
        fp_tables = int32([[12 * b + i for i in range(12)] for b in range(len(lens))])
        fp = FullPrecisionWindow(fk, fv, fp_tables, int32(starts))
    args = (q, k_pool, v_pool, tables, int32(lens), 1 / math.sqrt(D))
    out = paged_decode_attention_packed(*args, fp=fp, window=window, num_splits=num_splits)
    assert_close(out, paged_decode_attention_packed_ref(*args, fp=fp, window=window))
