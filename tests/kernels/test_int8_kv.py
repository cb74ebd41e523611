import math
from typing import Any

import pytest
import torch

from kernels.triton.int8_kv import (
    dequantize_kv,
    dequantize_kv_ref,
    paged_decode_attention_int8,
    paged_decode_attention_int8_ref,
    quantize_kv,
    quantize_kv_ref,
)
from kernels.triton.paged_decode_attention import paged_decode_attention_ref
from tests.kernels._utils import (
    ATTN_DTYPES,
    DEVICE,
    HEAD_CONFIGS,
    HEAD_DIM,
    INTERPRET,
    ON_GPU,
    assert_close,
    int32,
    make_paged_kv,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_matches_reference_and_bounds_error(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 16, 4, HEAD_DIM, generator=gen) * 5).to(DEVICE, dtype)
    x[0, 0, 0] = 0  # an all-zero row gets scale 0, not NaN
    x[1, 2, 3] *= 100  # a loud row next to quiet ones keeps its own scale
    x_q, scale = quantize_kv(x)
    ref_q, ref_scale = quantize_kv_ref(x)
    assert x_q.dtype == torch.int8 and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    # Identical math; a GPU may fuse x * inv + 0.5 into one FMA and round a tie the other way.
    assert (x_q.int() - ref_q.int()).abs().max() <= 1
    assert x_q.abs().max() <= 127
    assert scale[0, 0, 0] == 0 and (x_q[0, 0, 0] == 0).all()
    back = dequantize_kv(x_q, scale, torch.float32)
    err = (back - x.float()).abs()
    assert (err <= scale[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x_q = torch.randint(-127, 128, (5, 16, 2, HEAD_DIM), generator=gen, dtype=torch.int8)
    scale = torch.rand(5, 16, 2, generator=gen) / 10
    x_q, scale = x_q.to(DEVICE), scale.to(DEVICE)
    out = dequantize_kv(x_q, scale, dtype)
    assert out.dtype == dtype
    ref = dequantize_kv_ref(x_q, scale, dtype)
    if dtype == torch.bfloat16 and INTERPRET:
        # The interpreter truncates fp32 -> bf16 instead of rounding to nearest: one ulp off.
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, ref)


def make_int8_case(
    context_lens: list[int], num_q_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged_kv(
        context_lens, 16, num_kv_heads, HEAD_DIM, torch.float32, gen
    )
    k_q, k_scale = quantize_kv(k_cache)
    v_q, v_scale = quantize_kv(v_cache)
    q = torch.randn(len(context_lens), num_q_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    return q, k_q, v_q, k_scale, v_scale, block_tables, int32(context_lens), k_cache, v_cache


CONTEXT_LENS = [0, 1, 16, 33, 70] + ([600, 2048] if ON_GPU else [])


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("heads", [HEAD_CONFIGS[0], HEAD_CONFIGS[2]])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_int8_decode_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], num_splits: int
) -> None:
    case = make_int8_case(CONTEXT_LENS, *heads, dtype, seed=2)
    q, k_q, v_q, k_scale, v_scale, block_tables, lens, k_cache, v_cache = case
    scale = 1.0 / math.sqrt(HEAD_DIM)
    args = (q, k_q, v_q, k_scale, v_scale, block_tables, lens, scale)
    out = paged_decode_attention_int8(*args, num_splits=num_splits)
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, paged_decode_attention_int8_ref(*args))
    assert (out[0] == 0).all()  # context 0
    # Against the unquantized cache the int8 error stays small (max|row| / 254 per element).
    exact = paged_decode_attention_ref(q.float(), k_cache, v_cache, block_tables, lens, scale)
    assert (out.float() - exact).abs().max() < 0.05


@pytest.mark.parametrize(
    ("index", "change", "message"),
    [
        (1, lambda t: t.float(), "k_cache has dtype"),
        (3, lambda t: t.half(), "k_scale has dtype"),
        (4, lambda t: t[:, :8].contiguous(), "v_scale has shape"),
        (3, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "must be contig"),
    ],
)
def test_int8_decode_rejects_bad_arguments(index: int, change, message: str) -> None:
    args: list[Any] = list(make_int8_case([3, 20], 4, 2, torch.float32, seed=3)[:7])
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=message):
        q, k_q, v_q, k_scale, v_scale, block_tables, lens = args
        paged_decode_attention_int8(q, k_q, v_q, k_scale, v_scale, block_tables, lens, 0.1)


def test_quantize_rejects_bad_arguments() -> None:
    x = torch.randn(4, 8, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="x has dtype"):
        quantize_kv(x.double())
    with pytest.raises(ValueError, match="must be contiguous"):
        quantize_kv(x.transpose(1, 2))
    x_q, scale = quantize_kv(x)
    with pytest.raises(ValueError, match="scale has shape"):
        dequantize_kv(x_q, scale[:, :4])
    with pytest.raises(ValueError, match="x_q has dtype"):
        dequantize_kv(x_q.int(), scale)
