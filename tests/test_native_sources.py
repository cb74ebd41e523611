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


def test_a_shared_header_is_part_of_each_librarys_key(tmp_path: object) -> None:
    """Both quantized-linear sources read ggml_blocks.h: a library built before a change to it
    must not be reused after (the cache key covers the headers a source includes)."""
    from shared.native.build import source_texts
    from shared.runtime.cpu_quant_linear import SOURCE, TILES_SOURCE

    header = (SOURCE.parent / "ggml_blocks.h").read_text()
    for source in (SOURCE, TILES_SOURCE):
        assert source_texts(source)[1:] == [header], source
