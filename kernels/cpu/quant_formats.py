"""GGML's Q8_0, Q4_0 and Q4_1 weight blocks in torch: the reference the C kernels of
``csrc/quant_linear.c`` answer to, and the path that serves without a C compiler.

A quantized weight is a uint8 tensor ``[N, K / 32 * block_bytes]`` exactly as gguf-py reads it
from a .gguf file: row n is output feature n, its blocks of 32 run along the input dim K.

- Q8_0, 34 bytes: fp16 ``d``, int8 ``qs[32]``; ``w_j = d * qs[j]``
- Q4_0, 18 bytes: fp16 ``d``, uint8 ``qs[16]``; ``w_j = d * (nib_j - 8)``
- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, uint8 ``qs[16]``; ``w_j = d * nib_j + m``

with ``nib_j = qs[j] & 15`` for j < 16 and ``qs[j - 16] >> 4`` for j >= 16 (the low nibbles are
the block's first half). :func:`dequantize` is bit-equal to gguf-py's numpy ``dequantize``: fp32
arithmetic, ``d``/``m`` widened from fp16 exactly, ``d * (q - 8)``, ``d * q``, ``(d * q) + m``
rounded twice (no FMA). :func:`quantize` is ggml's ``quantize_row_*_ref``, byte-equal to
gguf-py's ``quantize`` (tests/runtime/test_quant_linear.py checks both).
"""

from __future__ import annotations

from enum import IntEnum

import torch


class QuantType(IntEnum):
    """gguf's ``GGMLQuantizationType`` values of the supported block types."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8


# gguf's type names (``ReaderTensor.tensor_type.name``) of the types kept packed.
PACKED_TYPES = {t.name: t for t in (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1)}
BLOCK = 32  # weights per block, every supported type
_BLOCK_BYTES = {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q8_0: 34}


def block_bytes(qtype: int) -> int:
    """Bytes of one block of 32 weights of ``qtype``; ValueError for an unsupported type."""
    return _BLOCK_BYTES[as_qtype(qtype)]


def as_qtype(qtype: int) -> QuantType:
    """``qtype`` (a QuantType, gguf's enum or its integer) as a QuantType."""
    try:
        return QuantType(int(qtype))
    except ValueError:
        raise ValueError(f"unsupported GGML quantization type {qtype!r}") from None


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights; ValueError unless ``k`` is a positive multiple of 32."""
    if k <= 0 or k % BLOCK:
        raise ValueError(f"in_features {k} is not a positive multiple of {BLOCK}")
    return k // BLOCK * block_bytes(qtype)


def _blocks(raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """``raw`` checked and viewed as ``[N * K / 32, block_bytes]``."""
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"quantized weight must be a 2-D uint8 tensor, got {raw.dtype} "
                         f"{tuple(raw.shape)}")  # fmt: skip
    if raw.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype.name} rows of {k} weights take {row_bytes(qtype, k)} bytes, "
                         f"got {raw.shape[1]}")  # fmt: skip
    return raw.contiguous().view(-1, block_bytes(qtype))


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, widened to fp32 (exact), as ``[blocks, 1]``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[blocks, 16]`` bytes -> ``[blocks, 32]`` int16 nibbles: the low ones, then the high."""
    q = qs.to(torch.int16)
    return torch.cat([q & 0x0F, q >> 4], dim=1)


def dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """fp32 ``[N, k]`` weights of the blocks ``raw`` (uint8 ``[N, k / 32 * block_bytes]``)."""
    qt = as_qtype(qtype)
    blocks = _blocks(raw, qt, k)
    d = _f16(blocks, 0)
    if qt == QuantType.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        w = q * d
    elif qt == QuantType.Q4_0:
        w = d * (_nibbles(blocks[:, 2:]) - 8).float()
    else:
        w = (d * _nibbles(blocks[:, 4:]).float()) + _f16(blocks, 2)
    return w.view(raw.shape[0], k)


def dequantize_rows(raw: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*ids.shape, k]``: the rows ``ids`` of the weight (an embedding lookup)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be integer, got {ids.dtype}")
    rows = raw.index_select(0, ids.reshape(-1).long())
    return dequantize(rows, qtype, k).view(*ids.shape, k)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), as gguf-py's ``np_roundf`` computes it."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, 0 where ``d`` is 0 (ggml's ``id = d ? 1.0f / d : 0.0f``)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, 1.0, d))


def _pack(nib: torch.Tensor) -> torch.Tensor:
    """``[blocks, 32]`` nibbles 0..15 -> ``[blocks, 16]`` bytes, element j + 16 in the high half."""
    n = nib.to(torch.uint8)
    return n[:, :16] | (n[:, 16:] << 4)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """``[blocks, 1]`` fp32 -> ``[blocks, 2]`` bytes of its fp16 (round to nearest even)."""
    return v.half().view(torch.uint8).view(-1, 2)


def quantize(w: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 ``[N, K / 32 * block_bytes]`` blocks of the fp32 ``[N, K]`` weights ``w``: ggml's
    ``quantize_row_q8_0_ref`` / ``q4_0_ref`` / ``q4_1_ref`` (NaNs unsupported)."""
    qt = as_qtype(qtype)
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"weights must be a 2-D fp32 tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    row_bytes(qt, k)
    x = w.contiguous().view(-1, BLOCK)
    if qt == QuantType.Q8_0:
        d = x.abs().amax(dim=1, keepdim=True) / 127
        qs = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        out = torch.cat([_f16_bytes(d), qs], dim=1)
    elif qt == QuantType.Q4_0:
        # the value of largest magnitude, the first one on a tie, maps to -8
        top = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
        d = top / -8
        q = ((x * _inverse(d)) + 8.5).trunc().clamp(0, 15)
        out = torch.cat([_f16_bytes(d), _pack(q)], dim=1)
    else:
        lo = x.amin(dim=1, keepdim=True)
        d = (x.amax(dim=1, keepdim=True) - lo) / 15
        q = (((x - lo) * _inverse(d)) + 0.5).trunc().clamp(0, 15)
        out = torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack(q)], dim=1)
    return out.reshape(n, row_bytes(qt, k))
