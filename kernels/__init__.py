"""Triton kernels for the GPU path: paged decode/prefill attention, KV store, int8 KV.

The entry points below import their module (and so triton) on first call: `import kernels`
works on machines without triton, and kernels are decorated only when used, after a test
harness had the chance to set TRITON_INTERPRET. Shapes and layouts are those of
docs/engine.md: caches [num_blocks, block_size, num_kv_heads, head_dim], block_tables and
sequence lengths int32, slot_mapping int64.

Two submodules share their names with the functions they define (paged_decode_attention,
prefill_attention). Python binds an imported submodule as an attribute of its package, which
would replace the function here; the package's module class refuses that one rebinding, so
`kernels.paged_decode_attention` is always the function. Import such a module's other names
with `from kernels.paged_decode_attention import ...`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_packed",
    "prefill_attention",
    "store_kv",
    "triton_available",
]


def triton_available() -> bool:
    """True when triton is importable (the kernels still need CUDA tensors to launch)."""
    return importlib.util.find_spec("triton") is not None


def _impl(module: str, name: str) -> Any:
    if not triton_available():
        raise RuntimeError(f"kernels.{name} needs triton, which is not installed")
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] against each sequence's paged KV (its last ``window`` positions, if given);
    returns [B, Hq, D]. See kernels/paged_decode_attention.py."""
    fn = _impl("paged_decode_attention", "paged_decode_attention")
    return fn(  # type: ignore[no-any-return]
        q, k_cache, v_cache, block_tables, context_lens, scale,
        num_splits=num_splits, max_context_len=max_context_len, window=window,
    )  # fmt: skip


def paged_decode_attention_packed(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    fp: Any = None,
    window: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Decode over an int8 cache of packed rows and its full-precision window ``fp`` (a
    kernels.paged_decode_attention.FullPrecisionWindow). See kernels/int8_kv.py."""
    fn = _impl("int8_kv", "paged_decode_attention_packed")
    return fn(  # type: ignore[no-any-return]
        q, k_pool, v_pool, block_tables, context_lens, scale,
        fp=fp, window=window, max_context_len=max_context_len,
    )  # fmt: skip


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
    """Causal attention of packed new tokens q [total_q_tokens, Hq, D] over the paged cache
    (their own K/V already stored), within a sliding ``window`` if given. See
    kernels/prefill_attention.py."""
    fn = _impl("prefill_attention", "prefill_attention")
    return fn(  # type: ignore[no-any-return]
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
        max_seqlen_q=max_seqlen_q, window=window,
    )  # fmt: skip


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [num_tokens, Hkv, D] at slot_mapping into one layer's caches."""
    _impl("kv_store", "store_kv")(k, v, k_cache, v_cache, slot_mapping)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # keep the function, not the same-named submodule (see module docstring)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
