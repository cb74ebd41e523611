"""Every C source a native loader compiles is where it looks (kernels/cpu/build.py ``CSRC``).

A missing source does not fail the kernels' own tests: they skip, and the services fall back to
torch with a warning. That is how the move of ``shared/engine/`` to ``shared/runtime/`` left every
C kernel unused without a red test; this one turns such a move red.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kernels.cpu

LOADERS = [
    importlib.import_module(f"kernels.cpu.{info.name}")
    for info in pkgutil.iter_modules(kernels.cpu.__path__)
]


@pytest.mark.parametrize("module", [m for m in LOADERS if hasattr(m, "SOURCE")], ids=str)
def test_c_source_exists(module: object) -> None:
    source = module.SOURCE  # type: ignore[attr-defined]
    assert source.is_file(), f"{module.__name__} compiles {source}, which is missing"


def test_every_c_source_has_a_loader() -> None:
    """The converse: no C file in kernels/cpu/csrc/ that no wrapper compiles (a dead kernel)."""
    from kernels.cpu.build import CSRC

    compiled = {
        getattr(m, attr).name for m in LOADERS for attr in dir(m) if attr.endswith("SOURCE")
    }
    assert {p.name for p in CSRC.glob("*.c")} - compiled == set()


def test_a_shared_header_is_part_of_each_librarys_key(tmp_path: object) -> None:
    """Both quantized-linear sources read ggml_blocks.h: a library built before a change to it
    must not be reused after (the cache key covers the headers a source includes)."""
    from kernels.cpu.build import source_texts
    from kernels.cpu.quant_linear import SOURCE, TILES_SOURCE

    header = (SOURCE.parent / "ggml_blocks.h").read_text()
    bf16 = (SOURCE.parent / "bf16.h").read_text()
    amx = [
        (SOURCE.parent / h).read_text()
        for h in ("amx.h", "quant_tiles_amx.h", "quant_tiles_bf16.h")
    ]
    assert source_texts(SOURCE)[1:] == [header]
    # and the bf16 rows' conversions, the tiles' AMX paths
    assert source_texts(TILES_SOURCE)[1:] == [bf16, header, *amx]
