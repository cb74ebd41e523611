"""Causal prefill attention over variable-length prompts whose KV sits in the paged cache.

Store first, then attend: the new tokens' K/V are already in the cache, so a sequence's keys are
positions [0, seq_len) of its block table, and the q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]
new queries are positions [seq_len - q_len, seq_len). Query i attends to positions
<= seq_len - q_len + i. One code path covers a plain prompt, a prompt behind a cached prefix,
and any chunk of a chunked prefill.

Flash-attention layout: one program per (q head, BLOCK_M query tile, sequence). Keys below the
tile's first query position need no causal mask (phase 1); the rest, up to the tile's last
query position, are masked (phase 2). The q head is grid axis 0 so the heads of one GQA group
run side by side and share K/V tiles through L2; query tiles run longest-first for balance.

Sliding window (``window`` > 0): query position p sees keys p - window + 1 .. p only; a tile's
keys start at its first query's window, every tile masks by window, and blocks before are never
read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import _checks
from kernels.triton._bench_inputs import BENCH, BenchShape
from kernels.triton._paged_tile import attend_kv_tile

LOG2E = 1.4426950408889634


@triton.jit
def _attend_span(
    q, acc, l_i, m_i, lo, hi, pos_m, seq_len, window,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, stride_kb, stride_kt, stride_kh,
    qk_scale, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Positions [lo, hi) of the sequence, BLOCK_N at a time, folded into the query rows at
    positions pos_m: those past seq_len never seen, with CAUSAL those past each row's own
    position, with HAS_WINDOW those before each row's window."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_len
        visible = n_valid[None, :]
        if CAUSAL:
            visible = (offs_n[None, :] <= pos_m[:, None]) & n_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        acc, l_i, m_i = attend_kv_tile(
            q, acc, l_i, m_i, offs_n, n_valid, visible,
            k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, 0, 0, 0, qk_scale,
            BLOCK_SIZE, HEAD_DIM, False,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr,  # [total_q_tokens, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [total_q_tokens, Hq, D]
    qk_scale,
    window,  # a sliding window (used when HAS_WINDOW)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache's, which v_cache shares
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    q_head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = q_head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + q_head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    pos_m = prefix_len + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb

    # Phase 1: every position < prefix_len + m0 is causally visible to every row of the tile
    # (prefix_len + m0 < seq_len, so these positions are all inside the sequence); a window
    # starts it at the first row's window and masks each row's own.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix_len + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = (prefix_len + m0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend_span(
        q, acc, l_i, m_i, lo, full_end, pos_m, seq_len, window,
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, stride_kb, stride_kt, stride_kh,
        qk_scale, BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, HAS_WINDOW,
    )  # fmt: skip
    # Phase 2: the diagonal. Its first tile starts at or below every row's own position, so
    # each row (padding rows too) sees at least one key by its end.
    causal_end = tl.minimum(seq_len, prefix_len + m0 + BLOCK_M)
    acc, l_i, m_i = _attend_span(
        q, acc, l_i, m_i, full_end, causal_end, pos_m, seq_len, window,
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, stride_kb, stride_kt, stride_kh,
        qk_scale, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, HAS_WINDOW,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + q_head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    if _checks.interpreting():
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        # ieee fp32 dots run on FMA units (no tensor cores): small tiles keep spills low.
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    # Q tile 32 KiB + 3 stages of K and V tiles (16 KiB each) at D=128 bf16: fits Hopper smem.
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8 if head_dim > 64 else 4, "num_stages": 3}


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries q [total_q_tokens, Hq, D]; returns the same shape.

    Sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and has seq_lens[b] cached
    tokens (its new tokens included, already stored). max_seqlen_q, the longest q_len, sizes
    the grid; pass it when known on the host, else it is read from cu_seqlens_q (a GPU sync).
    window: a sliding window (query position p sees keys p - window + 1 .. p).
    """
    if window is not None and window < 1:
        raise ValueError(f"window={window}: at least one key")
    _checks.check_device(
        q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
        block_tables=block_tables,
    )  # fmt: skip
    _checks.check_query(q)
    _checks.check_same_dtype("k_cache", k_cache, "q", q)
    _checks.check_same_dtype("v_cache", v_cache, "q", q)
    _checks.check_paged_cache(q, k_cache, v_cache)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        _checks.check_dtype(name, t, (torch.int32,))
        _checks.check_contiguous(name, t)
    _checks.check_dtype("block_tables", block_tables, (torch.int32,))
    _checks.check_shape("seq_lens", seq_lens, (None,))
    batch = seq_lens.shape[0]
    _checks.check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _checks.check_shape("block_tables", block_tables, (batch, None))
    _checks.check_unit_last_stride("block_tables", block_tables)
    total_q, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if batch else 0
    if total_q == 0 or max_seqlen_q == 0:
        return out
    cfg = _config(q.dtype, head_dim)
    grid = (num_q_heads, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale * LOG2E,
        window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=window is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference in fp32 with the causal diagonal aligned to the sequence's end
    (with a window: only the keys from the first query's window on are read)."""
    from kernels.triton.paged_decode_attention import gather_kv

    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_b = q[cu[b] : cu[b + 1]].float()
        q_len = q_b.shape[0]
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        k = gather_kv(k_cache, block_tables[b], seq_len)[first:]
        v = gather_kv(v_cache, block_tables[b], seq_len)[first:]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
        pos_k = torch.arange(first, seq_len, device=q.device)[None, :]
        visible = pos_k <= pos_q[:, None]
        if window is not None:
            visible &= pos_k > pos_q[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def bench_prefill(q_lens: list[int], shape: BenchShape = BENCH) -> dict[str, float]:
    """Times a from-scratch causal prefill of equal-length prompts against SDPA is_causal on
    contiguous [B, H, L, D] tensors (CUDA only). Both do the same causal FLOPs."""
    from triton.testing import do_bench

    if len(set(q_lens)) != 1:
        raise ValueError("the SDPA baseline needs equal prompt lengths")
    batch, q_len = len(q_lens), q_lens[0]
    k, v = (shape.randn(batch, q_len, shape.num_kv_heads, shape.head_dim) for _ in range(2))
    block_tables = shape.block_tables(batch, q_len)
    k_cache, v_cache = shape.cache(block_tables.numel()), shape.cache(block_tables.numel())
    pos = torch.arange(q_len, device=shape.device)
    slots = block_tables.long()[:, pos // shape.block_size] * shape.block_size
    slots = (slots + pos % shape.block_size).flatten()
    k_cache.flatten(0, 1)[slots] = k.flatten(0, 1)
    v_cache.flatten(0, 1)[slots] = v.flatten(0, 1)
    q = shape.randn(batch * q_len, shape.num_q_heads, shape.head_dim)
    cu_seqlens_q = torch.arange(0, batch + 1, device=shape.device, dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), q_len, device=shape.device, dtype=torch.int32)

    def run() -> torch.Tensor:
        return prefill_attention(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, shape.scale,
            max_seqlen_q=q_len,
        )  # fmt: skip

    ms = do_bench(run)
    q4 = q.view(batch, q_len, shape.num_q_heads, shape.head_dim).transpose(1, 2).contiguous()
    k4, v4 = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run_sdpa() -> torch.Tensor:
        return sdpa(q4, k4, v4, is_causal=True, scale=shape.scale, enable_gqa=True)

    sdpa_ms = do_bench(run_sdpa)
    err = run().float() - run_sdpa().transpose(1, 2).flatten(0, 1).float()
    # QK^T and PV: 2 matmuls x 2 FLOP per multiply-add over the visible (query, key) pairs.
    pairs = batch * q_len * (q_len + 1) / 2
    flops = 4 * pairs * shape.num_q_heads * shape.head_dim
    return {
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": flops / sdpa_ms / 1e9,
        "flops": flops,
        "max_abs_err_vs_sdpa": err.abs().max().item(),
    }
