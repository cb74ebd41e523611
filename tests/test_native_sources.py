"""Every C source a native loader compiles is where it looks (shared/native/build.py ``CSRC``).

A missing source does not fail the kernels' own tests: they skip, and the services fall back to
torch with a warning. That is how the move of ``shared/engine/`` to ``shared/runtime/`` left every
C kernel unused without a red test; this one turns such a move red.
"""

from __future__ import annotations

import pytest

from shared.native import mkl_dispatch
from shared.runtime import cpu_argmax, cpu_attention, cpu_prefill_attention, cpu_rope


@pytest.mark.parametrize(
    "module", [cpu_argmax, cpu_attention, cpu_prefill_attention, cpu_rope, mkl_dispatch]
)
def test_c_source_exists(module: object) -> None:
    source = module.SOURCE  # type: ignore[attr-defined]
    assert source.is_file(), f"{module.__name__} compiles {source}, which is missing"
