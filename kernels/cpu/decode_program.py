"""A list of kernel calls run in one call (``csrc/decode_program.c``): a decode step's layers
recorded once and replayed each step without Python between the kernels.

:class:`Program` holds the ops (``struct op``: a kind, the kernel's address, one float, the
integer and pointer arguments) and the step array the ops read their per-step values from
(:meth:`Program.step_arg`). The op kinds and their arguments are the C file's; the kernels are
the other libraries' own entry points, called with the arguments their wrappers give them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from kernels.cpu.build import CSRC, load_library

SOURCE = CSRC / "decode_program.c"
# -O3: GCC vectorises the program's own loops (the bf16 <-> fp32 conversions around the kernels,
# the residual adds, the KV store's rounding) only from -O3; at -O2 they ran an element at a time
# and took a third of a bf16 model's step (docs/perf-log.md, "The decode program's own loops").
# Each element is computed as before: no contraction, no reassociation.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
MAX_ARGS = 18
STEP_ARG = 1 << 62

# op kinds (the C enum)
(RMS_NORM, ADD_RMS_NORM, SILU_MUL, ROPE, DENSE_LINEAR, QUANT_LINEAR, ATTEND, STORE_KV, ADD,
 ROPE_PARTS, TO_F32, TO_BF16, ADD_BF16) = range(1, 14)  # fmt: skip


class Op(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("fn", ctypes.c_void_p),
        ("f", ctypes.c_float),
        ("a", ctypes.c_int64 * MAX_ARGS),
    ]


def address(fn: Any) -> int:
    """A loaded entry point's address, for an op."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value


class Program:
    """Ops appended once (:meth:`add`), then :meth:`run` each step with the step array set."""

    def __init__(self, lib: ctypes.CDLL, step: ctypes.Array[ctypes.c_int64]) -> None:
        """``step``: the array the ops' step arguments read (:func:`step_array`; several
        programs over the same buffers may share one)."""
        self._run = lib.baton_run_program
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._run.restype = ctypes.c_int64
        self._ops: list[Op] = []
        self._array: ctypes.Array[Op] | None = None  # the ops, once run (the list is dropped)
        self.step = step
        # Where the recorder's parts begin (a decode step's layers), and the end: a caller may
        # run one part a call (run(layers[i], layers[i + 1])).
        self.layers: list[int] = []

    @staticmethod
    def step_arg(i: int) -> int:
        """An argument that reads the step array's element ``i`` when the op runs."""
        return STEP_ARG | i

    def add(self, kind: int, fn: int | None, args: list[int], f: float = 0.0) -> None:
        if self._array is not None:
            raise RuntimeError("a program that has run takes no more ops")
        if len(args) > MAX_ARGS:
            raise ValueError(f"an op takes {MAX_ARGS} arguments at most")
        op = Op(kind, fn, f)
        for i, value in enumerate(args):
            op.a[i] = value
        self._ops.append(op)

    def __len__(self) -> int:
        return len(self._ops) if self._array is None else len(self._array)

    def run(self, start: int = 0, end: int | None = None) -> None:
        """Ops ``start`` to ``end`` (default: all), in order."""
        if self._array is None:  # one C array (~170 bytes an op), not an object an op
            self._array = (Op * len(self._ops))(*self._ops)
            self._ops = []
        n = len(self._array)
        end = n if end is None else end
        first = ctypes.addressof(self._array) + start * ctypes.sizeof(Op)
        rc = self._run(first, end - start, self.step)
        if rc:
            raise ValueError(f"decode program: op {start - rc - 1} of {n} refused its inputs")


def step_array(slots: int) -> ctypes.Array[ctypes.c_int64]:
    return (ctypes.c_int64 * slots)()


@functools.cache
def load_program_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    loaded = load_library(SOURCE, FLAGS, cache_dir, fallback="the layers' own calls")
    return None if loaded is None else loaded[0]
