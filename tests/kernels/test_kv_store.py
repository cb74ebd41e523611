import pytest
import torch

from kernels.triton.kv_store import store_kv, store_kv_ref
from tests.kernels._utils import DEVICE, HEAD_DIM, ON_GPU


def make_case(
    num_tokens: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = (64, 16) if ON_GPU else (8, 16)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return k, v, k_cache, v_cache, slot_mapping.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_matches_reference(dtype: torch.dtype, num_kv_heads: int) -> None:
    k, v, k_cache, v_cache, slot_mapping = make_case(37, num_kv_heads, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # and only the mapped slots changed
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping], k)


def test_strided_inputs_from_fused_qkv() -> None:
    k, v, k_cache, v_cache, slot_mapping = make_case(10, 2, torch.float16, seed=1)
    qkv = torch.cat([torch.zeros_like(k), torch.zeros_like(k), k, v], dim=1)  # [T, 8, D]
    k_view, v_view = qkv[:, 4:6], qkv[:, 6:8]
    assert not k_view.is_contiguous()
    store_kv(k_view, v_view, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping], k)
    assert torch.equal(v_cache.flatten(0, 1)[slot_mapping], v)


def test_no_tokens_is_a_no_op() -> None:
    k, v, k_cache, v_cache, slot_mapping = make_case(0, 2, torch.float32)
    before = k_cache.clone()
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    ("index", "change", "message"),
    [
        (0, lambda t: t.half(), "k has dtype"),
        (3, lambda t: t.half(), "v_cache has dtype"),
        (4, lambda t: t.int(), "slot_mapping has dtype"),
        (1, lambda t: t[:, :1].contiguous(), "v has shape"),
        (0, lambda t: t[..., :16].contiguous(), "k has shape"),
        (4, lambda t: t[:3], "slot_mapping has shape"),
        (0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous last"),
        (2, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "must be contig"),
    ],
)
def test_rejects_bad_arguments(index: int, change, message: str) -> None:
    args = list(make_case(5, 2, torch.float32))
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=message):
        store_kv(*args)
