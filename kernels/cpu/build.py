"""Compile a C source of ``kernels/cpu/csrc/`` into a shared library, once per machine.

Torch-free on purpose: the MKL dispatch library (``mkl_dispatch.py``) is built before the
process has loaded torch. A library is keyed by its source, flags, compiler and CPU (flags may
say ``-march=native``), cached in :func:`default_cache_dir`, and written under a private name
then renamed into place, so concurrent builders (prefill and decode starting together) never
load half a library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from kernels.cpu import cpu_isa
from shared.config import default_cache_dir

log = structlog.get_logger(__name__)

# The C sources live beside the model execution that loads most of them (shared/runtime).
CSRC = Path(__file__).parent / "csrc"


def build_library(source: Path, flags: tuple[str, ...], cache_dir: Path) -> Path:
    """The compiled library (built if missing); RuntimeError without a working compiler.
    ``-march=native`` in ``flags`` is held to ``BATON_CPU_ISA`` (cpu_isa.py)."""
    flags = cpu_isa.march(flags)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join((*source_texts(source), " ".join(flags), version, cpu_signature())).encode()
    ).hexdigest()[:16]
    path = cache_dir / f"{source.stem}-{key}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built a C library", path=str(path))
    return path


def source_texts(source: Path) -> list[str]:
    """The source and the local headers it includes (``#include "x.h"``, beside it): what a
    library is built from, so a change to a shared header rebuilds every library using it."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return [text, *((source.parent / h).read_text() for h in headers)]


def load_library(
    source: Path, flags: tuple[str, ...], cache_dir: Path | None, fallback: str
) -> tuple[ctypes.CDLL, Path] | None:
    """The library of ``source`` built (once) and loaded, with its path; None, with one warning
    naming what serves instead (``fallback``), if it cannot be built or loaded."""
    try:
        path = build_library(source, flags, cache_dir or default_cache_dir())
        return ctypes.CDLL(str(path)), path
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning(f"{source.name} unavailable; {fallback} serves", error=str(exc))
        return None


K = TypeVar("K")


def load_threaded(
    kernel: Callable[[ctypes.CDLL, Path, int], K], source: Path, flags: tuple[str, ...],
    cache_dir: Path | None, fallback: str, max_threads: int | None,
) -> K | None:  # fmt: skip
    """A kernel whose calls split over threads, its library built and loaded (None where it
    cannot be: ``fallback`` serves). ``max_threads``: the most threads a call may split into
    (default: the cores this process may run on; each call uses at most
    ``torch.get_num_threads()`` of them)."""
    loaded = load_library(source, flags, cache_dir, fallback)
    if loaded is None:
        return None
    return kernel(*loaded, usable_cpus() if max_threads is None else max_threads)


def usable_cpus() -> int:
    """The cores this process may run on: the most threads a native call should split into."""
    return len(os.sched_getaffinity(0))


def split_parts(units: int, min_units: int, threads: int) -> int:
    """How many ranges a native call splits ``units`` of work into on torch's OpenMP team: one
    per thread (``threads``: the caller's ``torch.get_num_threads()``, capped where it caps it),
    none of fewer than ``min_units``, at least one. The rule of every C kernel's split."""
    return max(1, min(threads, units // min_units))


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(keep))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def cpu_vendor() -> str | None:
    """``vendor_id`` of /proc/cpuinfo (``AuthenticAMD``, ``GenuineIntel``); None elsewhere."""
    return cpu_isa.cpuinfo("vendor_id")
