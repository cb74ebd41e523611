"""How the paged KV cache stores each (token, KV head) row: as the model's float dtype, or int8.

``BATON_KV_CACHE_DTYPE`` (vLLM's ``kv_cache_dtype``): ``auto`` keeps K/V in the model's dtype,
exact; ``int8`` stores each row as D int8 values and one fp32 scale (per (token, head),
symmetric, round half up: the rule of ``kernels/triton/int8_kv.py``, whose torch reference this
module calls, so the serving path and the kernels quantise identically).

Packed layout: the int8 cache is ``[layers, 2, num_blocks, block_size, Hkv, D + 4]``; each row
holds its D values and then its scale's 4 bytes. Why one packed tensor and not a separate scale
tensor: a block stays one slab of the one cache tensor, so every KV transport (spill store,
shared pool, CUDA IPC, Mooncake), prefix caching and block copies move the scales with the
values without knowing they exist, and a receiver whose cache differs (int8 against float) is
refused by the shape and dtype checks the transports already make.

Cost per row: D + 4 bytes against 4D (fp32) or 2D (fp16/bf16): 28% of fp32 at D=32, 26% at
D=128. Attention reads the rows it needs and dequantises them into the model's dtype. A prompt
prefilled in one chunk attends over its own K/V unquantised (as vLLM's quantised caches do);
a chunk after a cached prefix, and every decode step, read K/V back from the cache, rounded.
"""

from __future__ import annotations

from typing import Protocol

import torch

SCALE_BYTES = 4  # one fp32 scale per row


class KVCodec(Protocol):
    name: str
    quantized: bool

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype: ...

    def row_width(self, head_dim: int) -> int:
        """Elements of ``cache_dtype`` per (token, KV head) row."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` in the model's dtype -> cache rows ``[..., row_width]``."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows ``[..., row_width]`` -> ``[..., D]`` in ``dtype``."""
        ...


class FloatKV:
    """Rows stored as floats: the model's own dtype ("auto", exact), or bf16 ("bfloat16": half
    of fp32's bytes, each value rounded once as it is stored, to nearest even)."""

    quantized = False

    def __init__(self, name: str = "auto", dtype: torch.dtype | None = None) -> None:
        self.name, self.dtype = name, dtype

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype or model_dtype

    def row_width(self, head_dim: int) -> int:
        return head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.dtype is None else x.to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows if rows.dtype == dtype else rows.to(dtype)


class Int8KV:
    """int8 values + an fp32 scale per row, packed (see the module docstring)."""

    name = "int8"
    quantized = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def row_width(self, head_dim: int) -> int:
        if head_dim % SCALE_BYTES:
            raise ValueError(f"int8 KV needs a head_dim divisible by {SCALE_BYTES}, not {head_dim}")
        return head_dim + SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.triton.int8_ref import quantize_kv_ref

        values, scale = quantize_kv_ref(x)
        return torch.cat((values, scale[..., None].view(torch.int8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from kernels.triton.int8_ref import dequantize_kv_ref

        return dequantize_kv_ref(*self.split(rows), dtype)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows -> (int8 values ``[..., D]``, fp32 scales ``[...]``), both views: the
        scale's bytes sit 4-aligned in every row (head_dim % 4 == 0)."""
        return rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].view(torch.float32)[..., 0]


KV_CODECS: dict[str, KVCodec] = {
    "auto": FloatKV(),
    "bfloat16": FloatKV("bfloat16", torch.bfloat16),
    "float32": FloatKV("float32", torch.float32),
    "int8": Int8KV(),
}


def make_kv_codec(kv_cache_dtype: str, packed_weights: bool = False) -> KVCodec:
    """The codec ``kv_cache_dtype`` names; "auto" under GGUF weights kept packed (int8
    activations at every decode step: the step is approximate already) is bf16, as llama.cpp
    keeps its cache in 16 bits by default: half of fp32's bytes for attention to read, each
    value within 2^-9 of fp32's, far inside the int8 rounding of the projections' inputs."""
    if kv_cache_dtype == "auto" and packed_weights:
        kv_cache_dtype = "bfloat16"
    try:
        return KV_CODECS[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"BATON_KV_CACHE_DTYPE={kv_cache_dtype!r}: one of {sorted(KV_CODECS)}"
        ) from None
