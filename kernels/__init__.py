"""Baton's kernels, one folder per backend, each op beside its reference and its test's target.

- ``kernels/triton/``: the GPU path's Triton kernels (paged decode and prefill attention, the KV
  store, int8 KV) with their pure-torch references; they run on CPU under TRITON_INTERPRET=1.
- ``kernels/cpu/``: the CPU path's C kernels (``kernels/cpu/csrc/``), each with its ctypes wrapper
and torch
  reference, the compiler driver (``build.py``), the ISA choice (``cpu_isa.py``) and the
  MKL / oneDNN weight packing.

The Triton entry points are reached as ``kernels.<name>`` and import their module (and so
triton) on first use (PEP 562): ``import kernels`` works without triton, and a kernel is
decorated only after a test harness had the chance to set TRITON_INTERPRET. Shapes and layouts
are those of docs/engine.md: caches [num_blocks, block_size, num_kv_heads, head_dim],
block_tables and sequence lengths int32, slot_mapping int64.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# Entry point -> its module under kernels/triton/.
_TRITON_ENTRY_POINTS = {
    "paged_decode_attention": "paged_decode_attention",
    "paged_decode_attention_packed": "int8_kv",
    "prefill_attention": "prefill_attention",
    "store_kv": "kv_store",
}

__all__ = [*_TRITON_ENTRY_POINTS, "triton_available"]


def triton_available() -> bool:
    """True when triton is importable (the kernels still need CUDA tensors to launch)."""
    return importlib.util.find_spec("triton") is not None


def __getattr__(name: str) -> Any:
    module = _TRITON_ENTRY_POINTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    if not triton_available():
        raise RuntimeError(f"kernels.{name} needs triton, which is not installed")
    return getattr(importlib.import_module(f"kernels.triton.{module}"), name)
