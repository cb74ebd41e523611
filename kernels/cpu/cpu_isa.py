"""Which x86 instruction sets the native code of a process may use: ``BATON_CPU_ISA``.

``native`` (the default) compiles the C kernels for this CPU (``-march=native``) and leaves MKL,
oneDNN and ATen to pick their own paths. ``avx2`` holds every one of them to AVX2 + FMA (the C
kernels at ``-march=x86-64-v3``; ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``), and ``portable`` to the x86-64 baseline: so the paths a laptop or an
older server (AMD Zen 2/3, Intel before Skylake-SP) runs are served, tested and measured on a
machine with AVX-512. Below ``native`` the CPU counts as having no bf16 instructions.

The libraries read their variables when they load: :func:`apply` runs before torch is imported
(services/__main__.py, tests/conftest.py, the benchmarks), and its children inherit the result.
Torch-free.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

ENV = "BATON_CPU_ISA"
ISAS = ("native", "avx2", "portable")
_MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}
_LIBRARY_ENV = {
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "ATEN_CPU_CAPABILITY": "avx2"},
    "portable": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "ATEN_CPU_CAPABILITY": "default"},
}  # fmt: skip
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 or AMX; Arm's BF16


def check(isa: str) -> str:
    if isa not in ISAS:
        raise ValueError(f"{ENV} must be one of {', '.join(ISAS)}, got {isa!r}")
    return isa


def current() -> str:
    """This process's setting (``native`` when unset)."""
    return check(os.environ.get(ENV) or "native")


def apply(isa: str) -> None:
    """Hold this process and its children to ``isa``: call before torch is imported. A library
    variable already set in the environment is left as it is."""
    os.environ[ENV] = check(isa)
    for name, value in _LIBRARY_ENV.get(isa, {}).items():
        os.environ.setdefault(name, value)
    if isa != "native" and "torch" in sys.modules:
        log.warning("BATON_CPU_ISA applied after torch loaded: MKL and ATen keep their choice")


def march(flags: tuple[str, ...]) -> tuple[str, ...]:
    """A C kernel's compiler flags with ``-march=native`` held to this process's setting."""
    target = _MARCH[current()]
    return tuple(target if flag == "-march=native" else flag for flag in flags)


def cpuinfo(*keys: str) -> str | None:
    """The value of the first line of /proc/cpuinfo naming one of ``keys`` (it repeats them
    per core); None where no line does, or there is no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str]:
    return set((cpuinfo("flags", "Features") or "").split())


def computes_bf16() -> bool:
    """Whether bf16 arithmetic runs in hardware here (not emulated, several times slower than
    fp32): the CPU has it and the setting allows it."""
    if current() != "native" and platform.machine() in ("x86_64", "AMD64"):
        return False
    return bool(cpu_flags() & _BF16_FLAGS)
