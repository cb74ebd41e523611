import math
from typing import Any

import pytest
import torch

from kernels.triton.paged_decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
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


def context_lens_for(block_size: int) -> list[int]:
    """Empty, single-token, exact block boundaries, one past and one short of them, odd."""
    lens = [0, 1, block_size, block_size + 1, 2 * block_size - 1, 37]
    return lens + ([300, 1000, 2 * 512] if ON_GPU else [70])


def run_case(
    context_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | None,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged_kv(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = int32(context_lens)
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_decode_attention(
        q, k_cache, v_cache, block_tables, lens, scale, num_splits=num_splits
    )
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any()
    assert_close(out, ref)
    empty = torch.tensor(context_lens, device=DEVICE) == 0
    assert (out[empty] == 0).all()


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_matches_reference(dtype: torch.dtype, block_size: int, heads: tuple[int, int]) -> None:
    run_case(context_lens_for(block_size), block_size, *heads, HEAD_DIM, dtype, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_split_kv_matches_reference(num_splits: int, dtype: torch.dtype) -> None:
    # Splits longer than some contexts leave empty splits, which the reduce must ignore.
    run_case(context_lens_for(16), 16, *HEAD_CONFIGS[2], HEAD_DIM, dtype, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_other_head_dims(head_dim: int) -> None:
    run_case([5, 33], 16, 4, 2, head_dim, torch.float32, num_splits=None, seed=1)


def test_block_size_larger_than_tile() -> None:
    run_case([0, 70, 129, 200], 128, 4, 2, HEAD_DIM, torch.float32, num_splits=None, seed=2)


def test_automatic_split_kv_on_long_context() -> None:
    """One sequence with a long context: the wrapper picks several splits by itself."""
    context_len = 4096 if ON_GPU else 600
    assert choose_num_splits(1, 2, context_len, num_sms=4) > 1
    run_case([context_len], 16, 8, 2, HEAD_DIM, torch.float32, num_splits=None, seed=3)


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 8, 2048, num_sms=132) == 1  # grid already fills the GPU
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1  # context too short to split
    splits = choose_num_splits(1, 8, 32768, num_sms=132)
    assert 1 < splits <= 64
    assert choose_num_splits(2, 8, 1024, num_sms=132) == 4  # capped by tokens per split


def test_strided_query_view() -> None:
    """q may be a view with strided rows (e.g. a slice of a fused qkv tensor)."""
    gen = torch.Generator().manual_seed(4)
    lens = [9, 40]
    k_cache, v_cache, block_tables = make_paged_kv(lens, 16, 2, HEAD_DIM, torch.float32, gen)
    qkv = torch.randn(2, 8, HEAD_DIM, generator=gen).to(DEVICE)
    q = qkv[:, 2:6]
    assert not q.is_contiguous()
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, int32(lens), 0.1)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, int32(lens), 0.1)
    assert_close(out, ref)


def _args() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, block_tables = make_paged_kv([3, 20], 16, 2, 32, torch.float32, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": int32([3, 20]),
    }


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("q", lambda t: t.double(), "q has dtype"),
        ("k_cache", lambda t: t.half(), "k_cache has dtype"),
        ("block_tables", lambda t: t.long(), "block_tables has dtype"),
        ("context_lens", lambda t: t.long(), "context_lens has dtype"),
        ("k_cache", lambda t: t[..., :16].contiguous(), "k_cache has shape"),
        ("v_cache", lambda t: t[:-1].contiguous(), "v_cache has shape"),
        ("context_lens", lambda t: t[:1], "context_lens has shape"),
        ("block_tables", lambda t: t[:1], "block_tables has shape"),
        ("q", lambda t: t[:, :3].contiguous(), "not a multiple"),
        ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous last"),
        ("k_cache", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "must be contig"),
    ],
)
def test_rejects_bad_arguments(field: str, change, message: str) -> None:
    args = _args()
    args[field] = change(args[field])
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, scale=0.1)


@pytest.mark.parametrize(
    ("dim", "message"), [(1, "block_size=12"), (3, "head_dim=12")], ids=["block", "head"]
)
def test_rejects_non_power_of_two_sizes(dim: int, message: str) -> None:
    args = _args()
    for name in ("k_cache", "v_cache") if dim == 1 else ("q", "k_cache", "v_cache"):
        args[name] = args[name].narrow(dim if name != "q" else 2, 0, 12).contiguous()
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, scale=0.1)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = {name: t.cpu() for name, t in _args().items()}
    with pytest.raises(ValueError, match="need CUDA tensors"):
        paged_decode_attention(**args, scale=0.1)


@pytest.mark.skipif(not ON_GPU, reason="needs two devices")
def test_rejects_mixed_devices() -> None:
    args = _args()
    args["context_lens"] = args["context_lens"].cpu()
    with pytest.raises(ValueError, match="context_lens is on cpu"):
        paged_decode_attention(**args, scale=0.1)
