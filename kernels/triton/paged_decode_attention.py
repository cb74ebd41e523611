"""Paged decode attention: one query token per sequence against its paged KV cache.

One program per (sequence, kv head) computes all the query heads of that GQA group together, so
each K/V tile is read from HBM once per group. tl.dot needs at least 16 rows on GPU, so the group
is padded to GROUP_PAD >= 16 rows (the padded rows load zeros and are never stored).

Split-KV (flash-decoding): with few sequences and long contexts, batch * kv_heads programs
cannot fill the GPU, so the context is cut into `num_splits` chunks handled by separate
programs, each writing an unnormalised partial (max, sum, acc); a reduce kernel rescales and
combines them. The wrapper picks the split count from the grid size and a host-side bound on
the context length (never by reading context_lens, which would synchronise with the GPU).

Context length 0 yields zeros: the running sum stays 0 and is replaced by 1 before dividing.

Sliding window (``window`` > 0): the query, at position context_len - 1, sees the last
``window`` positions only; splits cover that range, and blocks before it are never read.

A full-precision window over an int8 cache (HAS_FP; shared/runtime/fp_window.py): positions
from ``fp_starts[b]`` on are read from a second, float paged cache (``fp_k``/``fp_v``, block
size FP_BLOCK, table ``fp_tables[b]`` relative to that position), the rest as int8; each split
takes its positions from whichever holds them, in one online softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton import _checks
from kernels.triton._bench_inputs import BENCH, BenchShape, DecodeInputs
from kernels.triton._paged_tile import attend_kv_tile

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] fp32 (int8 caches only)
    v_scale_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    fp_k_ptr,  # [slots, FP_BLOCK, Hkv, D] in q's dtype (HAS_FP only)
    fp_v_ptr,
    fp_tables_ptr,  # [B, max_slots] int32
    fp_starts_ptr,  # [B] int32: the window's first position
    out_ptr,  # [B, Hq, D] (single split) or fp32 acc partials [B, Hq, S, D]
    m_ptr,  # [B, Hq, S] fp32 partial max (split only)
    l_ptr,  # [B, Hq, S] fp32 partial sum (split only)
    qk_scale,
    tokens_per_split,
    window,  # a sliding window; 0: none
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache's, which v_cache shares
    stride_sb, stride_st, stride_sh,  # k_scale's, which v_scale shares
    stride_btb,
    stride_fb, stride_ft, stride_fh, stride_fbt,  # fp_k's (fp_v shares them), fp_tables'
    stride_ob, stride_oh, stride_os,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    HAS_FP: tl.constexpr,
    FP_BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = 0
    if window > 0:
        first = tl.maximum(context_len - window, 0)
    start = first + split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    mid = end  # positions [start, mid) from the cache, [mid, end) from the window
    fp_start = end
    if HAS_FP:
        fp_start = tl.load(fp_starts_ptr + seq)
        mid = tl.minimum(tl.maximum(fp_start, start), end)
    for n0 in range(start, mid, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < mid
        acc, l_i, m_i = attend_kv_tile(
            q, acc, l_i, m_i, offs_n, n_valid, n_valid[None, :],
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, qk_scale,
            BLOCK_SIZE, HEAD_DIM, KV_INT8,
        )  # fmt: skip
    if HAS_FP:
        fp_table_ptr = fp_tables_ptr + seq.to(tl.int64) * stride_fbt
        for n0 in range(mid, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_valid = offs_n < end
            acc, l_i, m_i = attend_kv_tile(
                q, acc, l_i, m_i, offs_n - fp_start, n_valid, n_valid[None, :],
                fp_k_ptr, fp_v_ptr, fp_k_ptr, fp_v_ptr, fp_table_ptr, kv_head,
                stride_fb, stride_ft, stride_fh, 0, 0, 0, qk_scale,
                FP_BLOCK, HEAD_DIM, False,
            )  # fmt: skip

    out_rows = seq.to(tl.int64) * stride_ob + heads * stride_oh
    if SPLIT_KV:
        num_splits = tl.num_programs(2)
        ml_offs = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(m_ptr + ml_offs, m_i, mask=g_mask)
        tl.store(l_ptr + ml_offs, l_i, mask=g_mask)
        o_ptrs = out_ptr + out_rows[:, None] + split * stride_os + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=g_mask[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + out_rows[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _split_kv_reduce_kernel(
    acc_ptr,  # [B, Hq, S, D] fp32
    m_ptr,  # [B, Hq, S] fp32
    l_ptr,  # [B, Hq, S] fp32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    m = tl.load(m_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    acc_ptrs = acc_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    # Every split empty (context 0): m_max is -inf; any finite value makes all weights 0.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_total == 0.0, 1.0, l_total)
    o_ptrs = out_ptr + tl.program_id(0) * stride_ob + tl.program_id(1) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class FullPrecisionWindow:
    """The full-precision window of an int8 cache, as the decode kernel reads it."""

    k: torch.Tensor  # [slots, FP_BLOCK, Hkv, D] in q's dtype (a strided view is fine)
    v: torch.Tensor
    tables: torch.Tensor  # int32 [B, max_slots]
    starts: torch.Tensor  # int32 [B]: each window's first position


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Split-KV only pays when batch * kv_heads programs leave SMs idle and each split still
    gets a long run of tokens; aim for about two programs per SM."""
    programs = batch * num_kv_heads
    if programs >= num_sms or max_context_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def _config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    if _checks.interpreting():
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


def check_decode_tables(
    q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> None:
    """q [B, Hq, D] (_checks.check_query), block_tables int32 [B, *] with dense rows and
    context_lens int32 [B]: what every decode launch reads besides its cache."""
    _checks.check_device(q=q, block_tables=block_tables, context_lens=context_lens)
    _checks.check_query(q)
    _checks.check_dtype("block_tables", block_tables, (torch.int32,))
    _checks.check_dtype("context_lens", context_lens, (torch.int32,))
    _checks.check_shape("block_tables", block_tables, (q.shape[0], None))
    _checks.check_shape("context_lens", context_lens, (q.shape[0],))
    _checks.check_unit_last_stride("block_tables", block_tables)
    _checks.check_contiguous("context_lens", context_lens)


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_dtypes: tuple[torch.dtype, ...],
) -> None:
    check_decode_tables(q, block_tables, context_lens)
    _checks.check_device(q=q, k_cache=k_cache, v_cache=v_cache)
    _checks.check_dtype("k_cache", k_cache, kv_dtypes)
    _checks.check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    _checks.check_paged_cache(q, k_cache, v_cache)


def launch_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    max_context_len: int | None,
    window: int | None = None,
    fp: FullPrecisionWindow | None = None,
) -> torch.Tensor:
    """Launches on already-checked arguments; k_scale/v_scale given means an int8 cache (whose
    strides are the scales', the head's included: packed rows keep them inside the values);
    ``fp``: its full-precision window."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    bound = block_tables.shape[1] * block_size
    max_len = bound if max_context_len is None else min(max_context_len, bound)
    if window is not None:
        if window < 1:
            raise ValueError(f"window={window}: at least one key")
        max_len = min(max_len, window)  # the positions a query reads
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, _checks.num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    cfg = _config(q.dtype, head_dim)
    block_n = cfg["BLOCK_N"]
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    split_kv = num_splits > 1
    if split_kv:
        acc = q.new_empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32)
        m_part = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        target, stride_os = acc, acc.stride(2)
    else:
        # The pointer arguments are unused on this path (SPLIT_KV is a constexpr).
        m_part = l_part = out
        target, stride_os = out, 0
    k_scale_arg = k_cache if k_scale is None else k_scale
    v_scale_arg = v_cache if v_scale is None else v_scale
    scale_strides = (0, 0, 0) if k_scale is None else k_scale.stride()
    if fp is None:  # the pointer arguments are unused (HAS_FP is a constexpr)
        fp_args: tuple[Any, ...] = (k_cache, v_cache, block_tables, context_lens)
        fp_strides: tuple[int, ...] = (0, 0, 0, 0)
        fp_block = 1
    else:
        fp_args = (fp.k, fp.v, fp.tables, fp.starts)
        fp_strides, fp_block = (*fp.k.stride()[:3], fp.tables.stride(0)), fp.k.shape[1]
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale_arg, v_scale_arg, block_tables, context_lens, *fp_args,
        target, m_part, l_part, scale * LOG2E, tokens_per_split, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *scale_strides, block_tables.stride(0), *fp_strides,
        target.stride(0), target.stride(1), stride_os,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, KV_INT8=k_scale is not None,
        SPLIT_KV=split_kv, HAS_FP=fp is not None, FP_BLOCK=fp_block,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_kv:
        _split_kv_reduce_kernel[(batch, num_q_heads)](
            acc, m_part, l_part, out, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, num_warps=4,
        )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] over each sequence's first context_lens[b] cached tokens
    (with ``window``: its last ``window`` of them).

    k_cache/v_cache: [num_blocks, block_size, Hkv, D] in q's dtype. Returns [B, Hq, D].
    num_splits: None picks split-KV automatically; 1 forces the single-pass kernel.
    max_context_len: an optional host-side bound on context_lens that sharpens the split
    choice (default: block_tables.shape[1] * block_size).
    block_tables rows must hold valid block ids for every position the query sees.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, (q.dtype,))
    return launch_paged_decode(
        q, k_cache, v_cache, None, None, block_tables, context_lens, scale, num_splits,
        max_context_len, window,
    )  # fmt: skip


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first context_len tokens of one sequence as a contiguous [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    return cache.flatten(0, 1)[slots]


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference (fp32 math): gather each sequence's KV, repeat heads, softmax."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for b, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        first = 0 if window is None else max(0, context_len - window)
        k = gather_kv(k_cache, block_tables[b], context_len)[first:]
        v = gather_kv(v_cache, block_tables[b], context_len)[first:]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def bench_paged_decode(
    batch: int, context_len: int, num_splits: int | None = None, shape: BenchShape = BENCH
) -> dict[str, float]:
    """Times the kernel and SDPA on pre-gathered contiguous KV (CUDA only)."""
    from triton.testing import do_bench

    d = DecodeInputs.random(shape, batch, context_len)

    def run() -> torch.Tensor:
        return paged_decode_attention(
            d.q, d.k_cache, d.v_cache, d.block_tables, d.context_lens, d.scale,
            num_splits=num_splits,
        )  # fmt: skip

    ms = do_bench(run)
    k, v = (
        torch.stack([gather_kv(cache, d.block_tables[b], context_len) for b in range(batch)])
        for cache in (d.k_cache, d.v_cache)
    )
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, T, D]
    q4 = d.q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = do_bench(lambda: sdpa(q4, k, v, scale=d.scale, enable_gqa=True))
    elem = d.q.element_size()
    nbytes = 2 * batch * context_len * shape.num_kv_heads * shape.head_dim * elem
    nbytes += 2 * d.q.numel() * elem
    max_err = run().float() - sdpa(q4, k, v, scale=d.scale, enable_gqa=True)[:, :, 0].float()
    return {
        "ms": ms,
        "gb_per_s": nbytes / ms / 1e6,
        "sdpa_ms": sdpa_ms,
        "sdpa_gb_per_s": nbytes / sdpa_ms / 1e6,
        "bytes": float(nbytes),
        "max_abs_err_vs_sdpa": max_err.abs().max().item(),
    }
