"""The bf16 decoder layer's elementwise ops through the C kernels of ``csrc/bf16_ops.c`` (CPU).

RMSNorm (optionally after the residual add, in place), SiLU(gate) * up over the fused gate_up
output, and rotate-half RoPE in place: each one pass over its rows, fp32 inside, no temporaries.
Used for bf16 models only: fp32 keeps torch's ops, whose bits the parity contract pins. Built and
loaded like the other kernels; without a compiler torch's ops serve. What each rounds, and the
figures that chose it: the C file. Each call splits its rows on torch's OpenMP team, into
``torch.get_num_threads()`` parts (read at each call, as the engine's CPU share moves it), fewer
for a small call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from shared.native.build import CSRC, load_library, split_parts

SOURCE = CSRC / "bf16_ops.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared",
         "-std=c11")  # fmt: skip
MAX_HEAD_DIM = 512  # the RoPE kernel's row buffer
# Output elements a part has at least: a decode step's SiLU * up (16 x 4864 outputs) took 73 us
# on one thread and 43 us split in two (2-core Xeon); much smaller calls stay whole.
MIN_PART_ELEMS = 1 << 14


def parts(elems: int) -> int:
    """How many row ranges a call over ``elems`` output elements splits into."""
    return split_parts(elems, MIN_PART_ELEMS, torch.get_num_threads())


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _rows(x: torch.Tensor) -> bool:
    """2-D bf16 CPU with contiguous rows (the row stride may be larger)."""
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and (x.stride(1) == 1 or x.shape[1] <= 1)
    )


class Bf16Kernels:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._norm = lib.baton_rms_norm_bf16
        self._norm.argtypes = [_P, _I, _I, _I, _P, _F, _P, _I]
        self._add_norm = lib.baton_add_rms_norm_bf16
        self._add_norm.argtypes = [_P, _P, _I, _I, _P, _F, _P, _I]
        self._silu_mul = lib.baton_silu_mul_bf16
        self._silu_mul.argtypes = [_P, _I, _I, _I, _P, _I]
        self._rope = lib.baton_rope_bf16
        self._rope.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I]
        for fn in (self._norm, self._add_norm, self._silu_mul, self._rope):
            fn.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``model.rms_norm(x, weight, eps)`` of 2-D bf16 ``x``."""
        if not _rows(x) or weight.dtype != torch.bfloat16 or weight.shape != x.shape[1:]:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype}: not bf16 rows of the weight's size")
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                   weight.contiguous().data_ptr(), eps, out.data_ptr(),
                   parts(out.numel()))  # fmt: skip
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``hidden += delta`` in place, then ``model.rms_norm(hidden, weight, eps)``."""
        if not (hidden.is_contiguous() and _rows(hidden)) or delta.shape != hidden.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)}: not contiguous bf16 rows")
        if delta.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise ValueError("delta and weight must be bf16")
        delta = delta.contiguous()
        out = torch.empty(hidden.shape, dtype=torch.bfloat16)
        self._add_norm(hidden.data_ptr(), delta.data_ptr(), hidden.shape[0], hidden.shape[1],
                       weight.contiguous().data_ptr(), eps, out.data_ptr(),
                       parts(out.numel()))  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, 2-D bf16."""
        if not _rows(gate_up) or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} {gate_up.dtype}: not bf16 rows")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(),
                       parts(out.numel()))  # fmt: skip
        return out

    @staticmethod
    def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """RoPE's inputs: ``x [T, H, D]`` bf16 CPU, heads contiguous in a row (rows may be
        strided); ``cos``/``sin`` ``[T, 1, D]`` contiguous bf16."""
        if x.dim() != 3 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return False
        num_tokens, _, head_dim = x.shape
        table = (num_tokens, 1, head_dim)
        return (
            head_dim % 2 == 0
            and head_dim <= MAX_HEAD_DIM
            and x.stride()[1:] == (head_dim, 1)
            and all(
                t.shape == table and t.dtype == torch.bfloat16 and t.is_contiguous()
                for t in (cos, sin)
            )
        )

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """``model.apply_rope`` in place if :meth:`takes` the inputs (True); else False."""
        if not self.takes(x, cos, sin):
            return False
        num_tokens, num_heads, head_dim = x.shape
        self._rope(x.data_ptr(), num_tokens, num_heads, head_dim, x.stride(0), cos.data_ptr(),
                   sin.data_ptr(), parts(num_tokens * num_heads * head_dim))  # fmt: skip
        return True


def load_bf16_ops(cache_dir: Path | None = None) -> Bf16Kernels | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="torch's bf16 ops")
    return Bf16Kernels(*loaded) if loaded is not None else None
