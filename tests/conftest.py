"""Process-wide settings that must precede torch, or any kernel module (``pytest_configure``
runs after this conftest loads and before any test module is collected).

MKL's kernels: the session re-executes itself, before torch loads, with the kernel choice the
services make (kernels/cpu/mkl_dispatch.py), so HF's reference in this process and the
engines it compares against round alike. Output capture stops first: the new process would
otherwise inherit pytest's capture files as its stdout and stderr.

Without CUDA, run the Triton kernels in Triton's CPU interpreter: triton.jit decides at
decoration time whether a kernel is compiled or interpreted, so this must come before any
kernel module is imported. A module that builds a tiny model at import (transformers then
probes for a package named ``kernels`` and finds ours) would otherwise decorate the kernels
first — which is what a clean clone, with no model built yet, did.
"""

import os

import pytest

# The suite serves the built-in tiny model (random weights, fast) unless a test names another;
# the services it starts inherit this. The real default model has its own tests
# (tests/models/test_real_model.py).
os.environ.setdefault("BATON_MODEL", "tiny-random")

from kernels.cpu import cpu_isa, mkl_dispatch
from shared.config import BatonConfig


def pytest_configure(config: pytest.Config) -> None:
    settings = BatonConfig.from_env()
    cpu_isa.apply(settings.cpu_isa)  # BATON_CPU_ISA=avx2 make test: the AVX2 paths throughout
    env = mkl_dispatch.reexec_env(settings.mkl_dispatch)
    if env is not None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        mkl_dispatch.reexec(env)
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
