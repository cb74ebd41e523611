"""Rotate-half RoPE in place through the C kernel of ``csrc/rope.c`` (CPU, fp32).

Bit-identical to the model's torch form (``model.apply_rope``: the same products and sum, each
rounded as torch's eager ops round them) without its four full-size temporaries. Built and loaded
like the attention kernels; without a compiler the torch form serves.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_library

SOURCE = CSRC / "rope.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
MAX_HEAD_DIM = 512  # the kernels' row buffer (this one's and layer_ops.c's bf16 RoPE)

_P, _I = ctypes.c_void_p, ctypes.c_int64


def rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a C RoPE kernel (this fp32 one, layer_ops.c's bf16 one) rotates these in place:
    ``x [T, H, D]`` CPU ``dtype`` with heads contiguous in a row (rows may be strided), D even and
    at most MAX_HEAD_DIM; ``cos``/``sin`` ``[T, 1, D]`` contiguous ``dtype``."""
    if x.dim() != 3 or x.dtype != dtype or x.device.type != "cpu":
        return False
    num_tokens, _, head_dim = x.shape
    table = (num_tokens, 1, head_dim)
    return (
        head_dim % 2 == 0
        and head_dim <= MAX_HEAD_DIM
        and x.stride()[1:] == (head_dim, 1)
        and all(t.shape == table and t.dtype == dtype and t.is_contiguous() for t in (cos, sin))
    )


def rope_in_place(
    fn: Callable[..., None], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    dtype: torch.dtype, *extra: int,
) -> bool:  # fmt: skip
    """``x`` rotated in place by the C RoPE entry point ``fn`` (whose arguments end in
    ``extra``) if :func:`rope_takes` the inputs (True); else untouched (False)."""
    if not rope_takes(x, cos, sin, dtype):
        return False
    num_tokens, num_heads, head_dim = x.shape
    fn(x.data_ptr(), num_tokens, num_heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr(),
       *extra)  # fmt: skip
    return True


class RopeKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._rope = lib.baton_rope_f32
        self._rope.argtypes = [_P, _I, _I, _I, _I, _P, _P]
        self._rope.restype = None

    @staticmethod
    def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """fp32 inputs :func:`rope_takes`."""
        return rope_takes(x, cos, sin, torch.float32)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """``x`` rotated in place if :meth:`takes` it (True); else untouched (False)."""
        return rope_in_place(self._rope, x, cos, sin, torch.float32)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` rotated in place (and returned); ValueError if :meth:`takes` says no."""
        if not self.rotate(x, cos, sin):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} strides {x.stride()}: not in place")
        return x


def load_rope(cache_dir: Path | None = None) -> RopeKernel | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's RoPE")
    return RopeKernel(*loaded) if loaded is not None else None
