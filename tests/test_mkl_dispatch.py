"""MKL's kernel choice (kernels/cpu/mkl_dispatch.py): when the library applies, how the
environment is built, and that in a child process it really changes MKL's kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import build, mkl_dispatch

AMD = build.cpu_vendor() == "AuthenticAMD"
AVX512 = "avx512f" in build.cpu_signature().split()

CHILD = """
import hashlib, json, os, sys
from kernels.cpu import mkl_dispatch
mkl_dispatch.ensure(sys.argv[1])
import torch
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 256, generator=g), torch.randn(256, 1152, generator=g)
print(json.dumps({"preload": os.environ.get("LD_PRELOAD", ""),
                  "gemm": hashlib.sha256((a @ b).numpy().tobytes()).hexdigest()}))
"""


def run_child(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != mkl_dispatch.CAP}  # no cap: it applies
    done = subprocess.run(  # this session's environment otherwise, preload included
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_modes_and_where_the_library_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="BATON_MKL_DISPATCH"):
        mkl_dispatch.applies("fast")
    assert not mkl_dispatch.applies("stock")
    monkeypatch.setattr(mkl_dispatch, "cpu_vendor", lambda: "GenuineIntel")
    assert not mkl_dispatch.applies("features")  # MKL already chooses by features there
    assert mkl_dispatch.preload_env("features", {"PATH": "/bin"}) is None
    monkeypatch.setattr(mkl_dispatch, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(mkl_dispatch.platform, "machine", lambda: "x86_64")
    assert mkl_dispatch.applies("features")


def test_the_environment_keeps_other_preloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mkl_dispatch, "applies", lambda mode: True)
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    env = mkl_dispatch.preload_env("features", {"LD_PRELOAD": "/opt/a.so:/opt/b.so", "X": "1"})
    assert env is not None and env["X"] == "1"
    first, *rest = env["LD_PRELOAD"].split()
    assert (
        Path(first).parent == tmp_path
        and Path(first).exists()
        and rest == ["/opt/a.so", "/opt/b.so"]
    )
    assert mkl_dispatch.preloaded(env) and not mkl_dispatch.preloaded({"LD_PRELOAD": "/opt/a.so"})
    assert mkl_dispatch.preload_env("features", env) == env  # already there: unchanged
    assert mkl_dispatch.stock_env(env) == {"LD_PRELOAD": "/opt/a.so /opt/b.so", "X": "1"}
    assert mkl_dispatch.stock_env({"LD_PRELOAD": first}) == {}


def test_stock_drops_an_inherited_library(monkeypatch: pytest.MonkeyPatch) -> None:
    inherited = "/cache/mkl_vendor_check-0123.so /opt/a.so"
    monkeypatch.setenv("LD_PRELOAD", inherited)
    monkeypatch.delenv(mkl_dispatch.CAP, raising=False)  # BATON_CPU_ISA=avx2 make test sets it
    assert mkl_dispatch.reexec_env("stock") == {
        **mkl_dispatch.stock_env(os.environ),
        "LD_PRELOAD": "/opt/a.so",
    }
    assert mkl_dispatch.reexec_env("features") is None  # already there
    monkeypatch.setenv("LD_PRELOAD", "/opt/a.so")
    assert mkl_dispatch.reexec_env("stock") is None


def test_a_cap_on_mkls_instructions_keeps_the_library_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With both, MKL's threaded vector math ran AVX-512 kernels on an AVX2-only CPU (SIGILL).
    monkeypatch.setattr(mkl_dispatch, "applies", lambda mode: True)
    assert mkl_dispatch.preload_env("features", {mkl_dispatch.CAP: "AVX2"}) is None
    monkeypatch.delenv(mkl_dispatch.CAP, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/cache/mkl_vendor_check-0123.so")
    assert mkl_dispatch.reexec_env("features") is None
    monkeypatch.setenv(mkl_dispatch.CAP, "SSE4_2")  # BATON_CPU_ISA=portable in a child
    assert mkl_dispatch.reexec_env("features") == mkl_dispatch.stock_env(os.environ)


def test_no_reexecution_once_torch_is_loaded() -> None:
    with pytest.raises(RuntimeError, match="before torch"):
        mkl_dispatch.reexec(dict(os.environ))  # this test session has torch loaded


@pytest.mark.skipif(not AMD, reason="the library applies to AMD CPUs only")
def test_a_process_reexecutes_itself_and_mkl_changes_kernels() -> None:
    stock, features = run_child("stock"), run_child("features")
    assert not mkl_dispatch.preloaded({"LD_PRELOAD": stock["preload"]})
    assert mkl_dispatch.preloaded({"LD_PRELOAD": features["preload"]})
    if AVX512:  # MKL's AVX-512 kernels instead of its generic AVX2 ones: other rounding
        assert features["gemm"] != stock["gemm"]
