"""The int8 KV codec's reference in plain torch (layout and error bound: int8_kv.py).

Apart from the Triton kernels so that the CPU engines, which quantize through these functions
(shared/runtime/kv_codec.py), never import triton: it may not be installed there.
"""

from __future__ import annotations

import torch


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    x_q = torch.floor(xf * inv[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return x_q, amax / 127.0


def dequantize_kv_ref(
    x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (x_q.float() * scale[..., None]).to(dtype)
