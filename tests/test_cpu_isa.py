"""Every instruction-set path of the C kernels, on whatever CPU runs the suite.

``BATON_CPU_ISA=avx2`` / ``portable`` compile the kernels for AVX2 + FMA or for the x86-64
baseline (kernels/cpu/cpu_isa.py): the kernel tests run again in a session held to each, so
the paths an AVX2-only CPU takes are checked on an AVX-512 machine too. The whole suite runs
under a setting with ``BATON_CPU_ISA=avx2 make test``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import cpu_isa
from shared.runtime.loader import resolve_dtype
from tests.runtime.helpers import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
# Each C kernel's test (one file per op): test_cpu_<op>.py, the quantized linears (rows and
# tiles), the int8 KV.
KERNEL_TESTS = sorted(
    str(p.relative_to(ROOT))
    for pattern in (
        "test_cpu_*.py",
        "test_quant_linear.py",
        "test_quant_tiles.py",
        "test_kv_int8.py",
    )
    for p in (ROOT / "tests" / "runtime").glob(pattern)
)


def test_settings_hold_the_compiler_and_the_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cpu_isa.ENV, "native")
    assert cpu_isa.march(("-O3", "-march=native")) == ("-O3", "-march=native")
    cpu_isa.apply("avx2")
    assert cpu_isa.march(("-O3", "-march=native")) == ("-O3", "-march=x86-64-v3")
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    if platform.machine() == "x86_64":
        assert not cpu_isa.computes_bf16()  # bf16 models compute in fp32
        cpu = torch.device("cpu")
        assert resolve_dtype("bfloat16", tiny_model_dir("llama"), cpu) == torch.float32
    with pytest.raises(ValueError, match="BATON_CPU_ISA must be one of"):
        cpu_isa.apply("avx10")


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_kernels_are_correct_on_every_instruction_set(isa: str) -> None:
    if isa == "avx2" and "avx512f" not in cpu_isa.cpu_flags():
        pytest.skip("this CPU's own build is the AVX2 path: the suite's kernel tests ran it")
    env = {**os.environ, cpu_isa.ENV: isa}
    for name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    # A crash's cause heads stderr (the signal, then the faulting thread's frames).
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[:3000]
