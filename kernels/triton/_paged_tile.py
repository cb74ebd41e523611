"""One step of paged online-softmax attention, shared by the decode and prefill kernels.

A step takes BLOCK_N consecutive context positions of one sequence, finds each position's slot
through the block table (so the tile size is independent of the cache's block_size and a tile
may straddle blocks), gathers K and V for one kv head, and folds them into the running
(max, sum, acc) of the query rows. Scores live in the log2 domain: `qk_scale` already carries
log2(e), so exp2 replaces exp.

A step in which a row sees no position at all (a sliding window's first tile can lie wholly
before some rows' windows) leaves that row as it was: its max stays -inf, and the rescaling
uses 0 in its place, so exp2 never sees -inf - -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_kv_tile(
    q,  # [M, HEAD_DIM] in the cache's compute dtype
    acc,  # [M, HEAD_DIM] fp32
    l_i,  # [M] fp32 running sum of exp2
    m_i,  # [M] fp32 running max (log2 domain)
    offs_n,  # [BLOCK_N] absolute context positions
    n_valid,  # [BLOCK_N] position < its sequence's length: guards the loads
    score_mask,  # broadcastable to [M, BLOCK_N]: n_valid and any causal limit
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,  # this sequence's row of block_tables
    kv_head,
    stride_kb, stride_kt, stride_kh,  # the caches' (block, position in block, head)
    stride_sb, stride_st, stride_sh,  # the scales' (KV_INT8 only)
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_INT8: tl.constexpr,
):  # fmt: skip
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    # int64 before the multiply: block_id * stride overflows int32 on caches of a few GB.
    block_ids = block_ids.to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    kv_offs = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = kv_offs[:, None] + offs_d[None, :]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=n_valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=n_valid[:, None], other=0.0)
    if KV_INT8:
        # int8 values are exact in fp16/bf16/fp32, so the dots run on the integer values and
        # the per-(token, head) scales multiply the score columns and the probabilities.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if KV_INT8:
        scale_offs = block_ids * stride_sb + in_block * stride_st + kv_head * stride_sh
        s = s * tl.load(k_scale_ptr + scale_offs, mask=n_valid, other=0.0)[None, :]
    s = tl.where(score_mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_INT8:
        p = p * tl.load(v_scale_ptr + scale_offs, mask=n_valid, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_new
