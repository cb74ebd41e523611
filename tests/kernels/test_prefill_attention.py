import math
from typing import Any

import pytest
import torch

from kernels.triton.paged_decode_attention import paged_decode_attention
from kernels.triton.prefill_attention import prefill_attention, prefill_attention_ref
from tests.kernels._utils import (
    ATTN_DTYPES,
    DEVICE,
    HEAD_CONFIGS,
    HEAD_DIM,
    ON_GPU,
    assert_close,
    int32,
    make_paged_kv,
)


def batch_for(block_size: int) -> list[tuple[int, int]]:
    """(q_len, seq_len) pairs: fresh prompts (q_len == seq_len) of odd, boundary and single
    lengths, prompts behind a cached prefix, and later chunks of a chunked prefill."""
    bs = block_size
    pairs = [(1, 1), (bs, bs), (2 * bs + 3, 2 * bs + 3), (1, bs + 1), (5, 37), (bs + 1, 3 * bs)]
    if ON_GPU:
        pairs += [(300, 300), (512, 1024), (129, 700)]
    return pairs


def run_case(
    pairs: list[tuple[int, int]],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in pairs]
    seq_lens = [s for _, s in pairs]
    k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    cu_seqlens_q = int32([sum(q_lens[:i]) for i in range(len(q_lens) + 1)])
    args = (q, k_cache, v_cache, cu_seqlens_q, int32(seq_lens), block_tables)
    scale = 1.0 / math.sqrt(head_dim)
    out = prefill_attention(*args, scale)
    ref = prefill_attention_ref(*args, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any()
    assert_close(out, ref)
    return out


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_matches_reference(dtype: torch.dtype, block_size: int, heads: tuple[int, int]) -> None:
    run_case(batch_for(block_size), block_size, *heads, HEAD_DIM, dtype)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_other_head_dims(head_dim: int) -> None:
    run_case([(7, 7), (20, 45)], 16, 4, 2, head_dim, torch.float32, seed=1)


def test_long_prompt_spans_many_tiles() -> None:
    length = 1500 if ON_GPU else 150
    run_case([(length, length), (length // 3, length)], 32, 4, 2, HEAD_DIM, torch.float32, 2)


def test_single_token_matches_decode() -> None:
    """A one-token chunk at the end of a cached context is a decode step."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [1, 17, 64, 90]
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, 16, 2, HEAD_DIM, torch.float32, gen)
    q = torch.randn(len(seq_lens), 4, HEAD_DIM, generator=gen).to(DEVICE)
    cu = int32(list(range(len(seq_lens) + 1)))
    lens = int32(seq_lens)
    prefill = prefill_attention(q, k_cache, v_cache, cu, lens, block_tables, 0.2, max_seqlen_q=1)
    decode = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.2)
    assert_close(prefill, decode)


def test_chunked_prefill_equals_whole_prompt() -> None:
    """Attending chunk by chunk over the same cache gives the whole-prompt result."""
    gen = torch.Generator().manual_seed(4)
    length = 77
    k_cache, v_cache, block_tables = make_paged_kv([length], 16, 2, HEAD_DIM, torch.float32, gen)
    q = torch.randn(length, 4, HEAD_DIM, generator=gen).to(DEVICE)
    whole = prefill_attention(
        q, k_cache, v_cache, int32([0, length]), int32([length]), block_tables, 0.2
    )
    for start, end in [(0, 30), (30, 31), (31, length)]:
        chunk = prefill_attention(
            q[start:end], k_cache, v_cache, int32([0, end - start]), int32([end]),
            block_tables, 0.2,
        )  # fmt: skip
        assert_close(chunk, whole[start:end])


def test_sequence_without_new_tokens_in_batch() -> None:
    run_case([(3, 3), (0, 16), (9, 40)], 16, 4, 2, HEAD_DIM, torch.float32, seed=5)


def _args() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, block_tables = make_paged_kv([3, 20], 16, 2, 32, torch.float32, gen)
    return {
        "q": torch.randn(8, 4, 32, generator=gen).to(DEVICE),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cu_seqlens_q": int32([0, 3, 8]),
        "seq_lens": int32([3, 20]),
        "block_tables": block_tables,
    }


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("q", lambda t: t.double(), "q has dtype"),
        ("q", lambda t: t.half(), "k_cache has dtype"),
        ("v_cache", lambda t: t.half(), "v_cache has dtype"),
        ("cu_seqlens_q", lambda t: t.long(), "cu_seqlens_q has dtype"),
        ("seq_lens", lambda t: t.long(), "seq_lens has dtype"),
        ("block_tables", lambda t: t.long(), "block_tables has dtype"),
        ("cu_seqlens_q", lambda t: t[:2], "cu_seqlens_q has shape"),
        ("block_tables", lambda t: t[:1], "block_tables has shape"),
        ("k_cache", lambda t: t[..., :16].contiguous(), "k_cache has shape"),
        ("q", lambda t: t[:, :3].contiguous(), "not a multiple"),
        ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous last"),
        ("v_cache", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "must be contig"),
        ("seq_lens", lambda t: t.repeat(2)[::2], "must be contig"),
    ],
)
def test_rejects_bad_arguments(field: str, change, message: str) -> None:
    args = _args()
    args[field] = change(args[field])
    with pytest.raises(ValueError, match=message):
        prefill_attention(**args, scale=0.1)
