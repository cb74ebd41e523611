"""Write new keys and values into one layer's paged KV cache at their slots.

k/v: [num_tokens, Hkv, D] (rows may be strided views, e.g. slices of a fused qkv projection);
k_cache/v_cache: [num_blocks, block_size, Hkv, D] contiguous, viewed as [num_slots, Hkv, D];
slot_mapping: int64 [num_tokens], slot = block_id * block_size + offset. One program per token
copies that token's K and V for all heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import _checks
from kernels.triton._bench_inputs import BENCH, BenchShape


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,  # cache stride between slots (= Hkv * D)
    stride_ch,  # cache stride between heads (= D)
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache.view(-1, Hkv, D)[slot_mapping] = k, and the same for v, in one launch.

    Every slot must lie inside the cache (not checked on the host: that would need a sync).
    """
    _checks.check_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _checks.check_dtype("k_cache", k_cache, _checks.FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        _checks.check_same_dtype(name, t, "k_cache", k_cache)
    _checks.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    _checks.check_shape("k_cache", k_cache, (None, None, None, None))
    _, _, num_kv_heads, head_dim = k_cache.shape
    _checks.check_shape("v_cache", v_cache, tuple(k_cache.shape))
    _checks.check_shape("k", k, (None, num_kv_heads, head_dim))
    _checks.check_shape("v", v, tuple(k.shape))
    _checks.check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    _checks.check_power_of_two("head_dim", head_dim)
    _checks.check_unit_last_stride("k", k)
    _checks.check_unit_last_stride("v", v)
    _checks.check_contiguous("k_cache", k_cache)
    _checks.check_contiguous("v_cache", v_cache)
    _checks.check_contiguous("slot_mapping", slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, num_warps=4,
    )  # fmt: skip


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch reference: an indexed copy into the flattened slot dimension."""
    k_cache.flatten(0, 1)[slot_mapping] = k
    v_cache.flatten(0, 1)[slot_mapping] = v


def bench_store_kv(
    num_tokens: int, num_blocks: int = 4096, shape: BenchShape = BENCH
) -> dict[str, float]:
    """Times the store against the torch indexed copy (CUDA only); bytes = read + written."""
    from triton.testing import do_bench

    k_cache, v_cache = shape.cache(num_blocks), shape.cache(num_blocks)
    k, v = (shape.randn(num_tokens, shape.num_kv_heads, shape.head_dim) for _ in range(2))
    slot_mapping = torch.randperm(num_blocks * shape.block_size, device=shape.device)
    slot_mapping = slot_mapping[:num_tokens]
    ms = do_bench(lambda: store_kv(k, v, k_cache, v_cache, slot_mapping))
    torch_ms = do_bench(lambda: store_kv_ref(k, v, k_cache, v_cache, slot_mapping))
    nbytes = 4 * k.numel() * k.element_size()
    return {
        "ms": ms,
        "gb_per_s": nbytes / ms / 1e6,
        "torch_ms": torch_ms,
        "torch_gb_per_s": nbytes / torch_ms / 1e6,
    }
