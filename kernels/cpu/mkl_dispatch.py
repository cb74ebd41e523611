"""Let MKL choose its kernels by CPU features on AMD CPUs, as it does on Intel's.

MKL (torch's BLAS on x86) asks an exported function, ``mkl_serv_intel_cpu_true``, whether the
CPU is Intel's, and on any other vendor runs its generic AVX2 kernels, even on a CPU with AVX-512
(AMD Zen 4/5), at a fraction of the fp32 GEMM rate the AVX-512 kernels reach there
(docs/perf-log.md, "MKL on AMD"). vLLM's CPU backend sends its fp32 linears to oneDNN (its
``dispatch_cpu_unquantized_gemm``), whose packed GEMM reaches the AVX-512 rates too. The answer
is ``kernels/cpu/csrc/mkl_vendor_check.c``, one
function preloaded ahead of torch, so it must be in place when the process starts: a process
that runs torch math calls :func:`ensure` first, which re-executes it with the library in
``LD_PRELOAD`` (its children inherit it).

Different kernels round differently (last bits of a GEMM), so processes whose numbers are
compared must choose alike: the services do at start, the test session does
(``tests/conftest.py``), so HF's reference runs on the engine's kernels. ``BATON_MKL_DISPATCH``:
``features`` (the default; a no-op off AMD x86) or ``stock`` (MKL's own choice).

Where ``MKL_ENABLE_INSTRUCTIONS`` caps MKL (``BATON_CPU_ISA`` below ``native``, or set by hand)
the library stays out and MKL keeps its stock choice under the cap: with the library and
``portable``'s cap, MKL's threaded vector math (torch's ``cos``) now and then ran an AVX-512
kernel on an AVX2-only Zen 3 and died of SIGILL (4 processes in 50; none in 50 with the library
alone, the cap alone, or the library under ``avx2``'s cap). A capped process is a test of an
older CPU's paths, where MKL's own choice is the one to test.

Torch-free: it runs before torch loads.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Mapping

import structlog

from kernels.cpu.build import CSRC, build_library, cpu_vendor, default_cache_dir

log = structlog.get_logger(__name__)

MODES = ("features", "stock")
SOURCE = CSRC / "mkl_vendor_check.c"
CAP = "MKL_ENABLE_INSTRUCTIONS"
FLAGS = ("-O2", "-fPIC", "-shared")


def applies(mode: str) -> bool:
    """Whether ``mode`` asks for the library on this machine (an AMD x86 CPU)."""
    if mode not in MODES:
        raise ValueError(f"BATON_MKL_DISPATCH={mode!r}: one of {MODES}")
    return (
        mode == "features"
        and platform.machine() in ("x86_64", "AMD64")
        and cpu_vendor() == "AuthenticAMD"
    )


def capped(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (this process's environment) caps MKL's instructions: the library then
    stays out."""
    return CAP in (os.environ if env is None else env)


def preloaded(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (this process's environment) preloads the library."""
    return any(_is_ours(p) for p in _entries(os.environ if env is None else env))


def preload_env(mode: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the library preloaded, if ``mode`` asks for it here; None if it does not
    apply, ``env`` caps MKL, or it cannot be built (no compiler: MKL stays stock, one warning)."""
    if not applies(mode) or capped(env):
        return None
    if preloaded(env):
        return dict(env)
    try:
        library = build_library(SOURCE, FLAGS, default_cache_dir())
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("MKL keeps its stock kernels on this AMD CPU", error=str(exc))
        return None
    return {**env, "LD_PRELOAD": " ".join([str(library), *_entries(env)])}


def ensure(mode: str) -> None:
    """Re-execute this process with the library preloaded if ``mode`` asks for it here and it
    is not preloaded yet (without it if ``stock`` or capped and it is); otherwise return. Call
    before torch is imported."""
    env = reexec_env(mode)
    if env is not None:
        reexec(env)


def reexec_env(mode: str) -> dict[str, str] | None:
    """The environment :func:`ensure` would re-execute this process with; None: no need. A
    process started with the library (a parent's choice) under ``stock`` or a cap drops it."""
    if preloaded():
        return stock_env(os.environ) if mode == "stock" or capped() else None
    return preload_env(mode, os.environ)


def reexec(env: dict[str, str]) -> None:
    """Replace this process by itself (same interpreter and argv) under ``env``."""
    if "torch" in sys.modules:
        raise RuntimeError("MKL's kernel choice must be made before torch is imported")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def stock_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the library (MKL's stock kernels in a process started with it)."""
    out = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    keep = [p for p in _entries(env) if not _is_ours(p)]
    if keep:
        out["LD_PRELOAD"] = " ".join(keep)
    return out


def _entries(env: Mapping[str, str]) -> list[str]:
    # ld.so separates LD_PRELOAD entries by spaces or colons.
    return env.get("LD_PRELOAD", "").replace(":", " ").split()


def _is_ours(path: str) -> bool:
    return os.path.basename(path).startswith(SOURCE.stem + "-")
