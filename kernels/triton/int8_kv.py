"""int8 KV cache: quantize, dequantize, and decode attention straight from int8 pages.

Scale granularity: one symmetric fp32 scale per (token, kv head), i.e. per row of D values.
- Per token: a token's KV is final once written, so a block can be compressed token by token
  (or all at once when it ages) without ever re-quantizing its neighbours; a per-block scale
  would have to be recomputed, and earlier tokens re-rounded, whenever a larger value arrives.
- Per head: heads differ in magnitude by an order of magnitude or more; one scale across heads
  would spend most of the 8 bits of the quiet heads on the loud head's range.
- Symmetric (no zero point): K and V are roughly zero-centred, and a zero point would add a
  correction term to every dot product inside the attention kernel.
- fp32 scales: 4 bytes next to D int8 bytes (3% at D=128) buys exact range, with no fp16
  overflow or subnormal corner cases for very large or tiny rows.
Error bound: |x - dequant(quant(x))| <= scale / 2 = max|row| / 254 per element.

Layout: caches int8 [num_blocks, block_size, Hkv, D] and scales fp32 [num_blocks, block_size,
Hkv], so `quantize_kv(kv_cache[l, 0][block_ids])` compresses whole blocks of one layer.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton import _checks
from kernels.triton._bench_inputs import BENCH, BenchShape, DecodeInputs
from kernels.triton.int8_ref import dequantize_kv_ref, quantize_kv_ref  # noqa: F401 (its API)
from kernels.triton.paged_decode_attention import (
    FullPrecisionWindow,
    check_decode_args,
    check_decode_tables,
    launch_paged_decode,
    paged_decode_attention,
)

ROWS_PER_PROGRAM = 16


@triton.jit
def _row_block(num_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's BLOCK_R rows of HEAD_DIM values: their indices, which exist, and the
    offsets of their elements."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    return rows, rows < num_rows, rows[:, None] * HEAD_DIM + offs_d[None, :]


@triton.jit
def _quantize_kernel(
    x_ptr, x_q_ptr, scale_ptr, num_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr
):
    rows, r_mask, ptrs = _row_block(num_rows, BLOCK_R, HEAD_DIM)
    x = tl.load(x_ptr + ptrs, mask=r_mask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    # Correctly rounded divisions (div_rn), so GPU, interpreter and torch agree bit for bit.
    safe_amax = tl.where(amax > 0.0, amax, 1.0)
    inv = tl.where(amax > 0.0, tl.div_rn(tl.zeros_like(amax) + 127.0, safe_amax), 0.0)
    x_q = tl.floor(x * inv[:, None] + 0.5)  # round half up; the torch reference does the same
    x_q = tl.minimum(tl.maximum(x_q, -127.0), 127.0)
    tl.store(x_q_ptr + ptrs, x_q.to(tl.int8), mask=r_mask[:, None])
    tl.store(scale_ptr + rows, tl.div_rn(amax, tl.zeros_like(amax) + 127.0), mask=r_mask)


@triton.jit
def _dequantize_kernel(
    x_q_ptr, scale_ptr, out_ptr, num_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr
):
    rows, r_mask, ptrs = _row_block(num_rows, BLOCK_R, HEAD_DIM)
    x_q = tl.load(x_q_ptr + ptrs, mask=r_mask[:, None], other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=r_mask, other=0.0)
    out = x_q * scale[:, None]
    tl.store(out_ptr + ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float, contiguous -> (int8 [..., D], fp32 scales [...]); one scale per row."""
    _checks.check_device(x=x)
    _checks.check_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.check_contiguous("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the head dim)")
    head_dim = x.shape[-1]
    _checks.check_power_of_two("head_dim", head_dim)
    x_q = torch.empty_like(x, dtype=torch.int8)
    scale = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    _launch_rows(_quantize_kernel, scale.numel(), head_dim, x, x_q, scale)
    return x_q, scale


def dequantize_kv(
    x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of quantize_kv: int8 [..., D] * fp32 scales [...] -> dtype [..., D]."""
    _checks.check_device(x_q=x_q, scale=scale)
    _checks.check_dtype("x_q", x_q, (torch.int8,))
    _checks.check_dtype("scale", scale, (torch.float32,))
    if dtype not in _checks.FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype} is not a float dtype")
    _checks.check_shape("scale", scale, tuple(x_q.shape[:-1]))
    _checks.check_contiguous("x_q", x_q)
    _checks.check_contiguous("scale", scale)
    head_dim = x_q.shape[-1]
    _checks.check_power_of_two("head_dim", head_dim)
    out = torch.empty(x_q.shape, device=x_q.device, dtype=dtype)
    _launch_rows(_dequantize_kernel, scale.numel(), head_dim, x_q, scale, out)
    return out


def _launch_rows(kernel: Any, num_rows: int, head_dim: int, *tensors: torch.Tensor) -> None:
    """``kernel`` over ``num_rows`` rows of ``head_dim`` values, ROWS_PER_PROGRAM a program."""
    if num_rows:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM),)
        kernel[grid](*tensors, num_rows, BLOCK_R=ROWS_PER_PROGRAM, HEAD_DIM=head_dim)


def paged_decode_attention_int8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """paged_decode_attention over int8 caches with fp32 scales [num_blocks, block_size, Hkv];
    dequantization happens inside the kernel (same kernel, KV_INT8 specialisation)."""
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, (torch.int8,))
    _checks.check_device(q=q, k_scale=k_scale, v_scale=v_scale)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _checks.check_dtype(name, s, (torch.float32,))
        _checks.check_shape(name, s, tuple(k_cache.shape[:3]))
        _checks.check_contiguous(name, s)
    return launch_paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, num_splits,
        max_context_len,
    )  # fmt: skip


def paged_decode_attention_int8_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: dequantize the whole cache to fp32, then exact attention on it."""
    from kernels.triton.paged_decode_attention import paged_decode_attention_ref

    k = dequantize_kv_ref(k_cache, k_scale, torch.float32)
    v = dequantize_kv_ref(v_cache, v_scale, torch.float32)
    out = paged_decode_attention_ref(q.float(), k, v, block_tables, context_lens, scale)
    return out.to(q.dtype)


def bench_int8_decode(batch: int, context_len: int, shape: BenchShape = BENCH) -> dict[str, float]:
    """Times int8 decode beside the bf16 kernel on the same (dequantized) KV (CUDA only)."""
    from triton.testing import do_bench

    d = DecodeInputs.random(shape, batch, context_len)
    k_q, k_s = quantize_kv(d.k_cache)
    v_q, v_s = quantize_kv(d.v_cache)
    k_cache, v_cache = dequantize_kv(k_q, k_s, shape.dtype), dequantize_kv(v_q, v_s, shape.dtype)
    q, args = d.q, (d.block_tables, d.context_lens, d.scale)
    ms = do_bench(lambda: paged_decode_attention_int8(q, k_q, v_q, k_s, v_s, *args))
    ref_ms = do_bench(lambda: paged_decode_attention(q, k_cache, v_cache, *args))
    err = paged_decode_attention_int8(q, k_q, v_q, k_s, v_s, *args).float()
    err -= paged_decode_attention(q, k_cache, v_cache, *args).float()
    tokens = batch * context_len * shape.num_kv_heads
    nbytes = 2 * tokens * (shape.head_dim + 4) + 2 * q.numel() * q.element_size()
    return {
        "ms": ms,
        "gb_per_s": nbytes / ms / 1e6,
        "bf16_ms": ref_ms,
        "max_abs_err_vs_bf16_kernel": err.abs().max().item(),
    }


def packed_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 pool of packed rows ``[blocks, bs, Hkv, D + 4]`` (D values, then the fp32 scale's
    bytes: shared/runtime/kv_codec.py) as strided views: values ``[blocks, bs, Hkv, D]`` and
    scales ``[blocks, bs, Hkv]``."""
    head_dim = pool.shape[-1] - 4
    return pool[..., :head_dim], pool.view(torch.float32)[..., head_dim // 4]


def paged_decode_attention_packed(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    fp: FullPrecisionWindow | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """paged_decode_attention over an int8 cache of packed rows (``[blocks, bs, Hkv, D + 4]``,
    contiguous), read in place; ``fp``: its full-precision window (positions from
    ``fp.starts[b]`` on come from there); ``window``: a sliding window."""
    check_decode_tables(q, block_tables, context_lens)
    _checks.check_device(q=q, k_pool=k_pool, v_pool=v_pool)
    _checks.check_dtype("k_pool", k_pool, (torch.int8,))
    _checks.check_same_dtype("v_pool", v_pool, "k_pool", k_pool)
    _checks.check_shape("k_pool", k_pool, (None, None, None, q.shape[2] + 4))
    _checks.check_shape("v_pool", v_pool, tuple(k_pool.shape))
    _checks.check_head_groups(q.shape[1], k_pool.shape[2])
    _checks.check_contiguous("k_pool", k_pool)
    _checks.check_contiguous("v_pool", v_pool)
    (k_vals, k_scale), (v_vals, v_scale) = packed_views(k_pool), packed_views(v_pool)
    if fp is not None:
        for name, t in (("fp.k", fp.k), ("fp.v", fp.v)):
            _checks.check_same_dtype(name, t, "q", q)
            _checks.check_shape(name, t, (None, None, k_vals.shape[2], q.shape[2]))
            _checks.check_unit_last_stride(name, t)
        _checks.check_dtype("fp.tables", fp.tables, (torch.int32,))
        _checks.check_dtype("fp.starts", fp.starts, (torch.int32,))
        _checks.check_shape("fp.starts", fp.starts, (q.shape[0],))
    return launch_paged_decode(
        q, k_vals, v_vals, k_scale, v_scale, block_tables, context_lens, scale, num_splits,
        max_context_len, window, fp,
    )  # fmt: skip


def paged_decode_attention_packed_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    fp: FullPrecisionWindow | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference: each sequence's keys dequantised, its window's taken from ``fp``."""
    from kernels.triton.paged_decode_attention import gather_kv

    group = q.shape[1] // k_pool.shape[2]
    out = torch.zeros_like(q)
    for b, n in enumerate(context_lens.tolist()):
        kv = []
        for pool, fp_pool in ((k_pool, None if fp is None else fp.k),
                              (v_pool, None if fp is None else fp.v)):  # fmt: skip
            rows = dequantize_kv_ref(*packed_views(pool), torch.float32)
            x = gather_kv(rows, block_tables[b], n)
            if fp is not None and fp_pool is not None:
                start = int(fp.starts[b])
                if start < n:
                    x[start:] = gather_kv(fp_pool, fp.tables[b], n - start).float()
            first = 0 if window is None else max(0, n - window)
            kv.append(x[first:].repeat_interleave(group, 1))
        if not n:
            continue
        scores = torch.einsum("hd,thd->ht", q[b].float(), kv[0]) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), kv[1]).to(q.dtype)
    return out
