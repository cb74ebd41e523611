"""Rotate-half RoPE in place through the C kernel of ``csrc/rope.c`` (CPU, fp32).

Bit-identical to the model's torch form (``model.apply_rope``: the same products and sum, each
rounded as torch's eager ops round them) without its four full-size temporaries. Built and loaded
like the attention kernels; without a compiler the torch form serves.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import CSRC, load_library

SOURCE = CSRC / "rope.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
MAX_HEAD_DIM = 512  # the kernel's row buffer

_P, _I = ctypes.c_void_p, ctypes.c_int64


class RopeKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._rope = lib.baton_rope_f32
        self._rope.argtypes = [_P, _I, _I, _I, _I, _P, _P]
        self._rope.restype = None

    @staticmethod
    def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """``x [T, H, D]`` fp32 CPU with heads contiguous in a row (rows may be strided);
        ``cos``/``sin`` ``[T, 1, D]`` contiguous fp32."""
        if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu":
            return False
        num_tokens, _, head_dim = x.shape
        table = (num_tokens, 1, head_dim)
        return (
            head_dim % 2 == 0
            and head_dim <= MAX_HEAD_DIM
            and x.stride()[1:] == (head_dim, 1)
            and all(
                t.shape == table and t.dtype == torch.float32 and t.is_contiguous()
                for t in (cos, sin)
            )
        )

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """``x`` rotated in place if :meth:`takes` it (True); else untouched (False)."""
        if not self.takes(x, cos, sin):
            return False
        num_tokens, num_heads, head_dim = x.shape
        self._rope(x.data_ptr(), num_tokens, num_heads, head_dim, x.stride(0), cos.data_ptr(),
                   sin.data_ptr())  # fmt: skip
        return True

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` rotated in place (and returned); ValueError if :meth:`takes` says no."""
        if not self.rotate(x, cos, sin):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} strides {x.stride()}: not in place")
        return x


def load_rope(cache_dir: Path | None = None) -> RopeKernel | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's RoPE")
    return RopeKernel(*loaded) if loaded is not None else None
