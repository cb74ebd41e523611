import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.triton.paged_decode_attention import paged_decode_attention_ref
from kernels.triton.prefill_attention import prefill_attention_ref
from tests.kernels._utils import DEVICE, ON_GPU, assert_close, int32, make_paged_kv

REPO = Path(__file__).resolve().parents[2]


def test_entry_points_are_the_triton_modules_functions() -> None:
    import kernels.triton.prefill_attention as module

    assert kernels.prefill_attention is module.prefill_attention
    assert callable(kernels.paged_decode_attention)
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018 - the lookup itself is what is tested


def test_engine_entry_points_run() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [5, 20]
    k_cache, v_cache, block_tables = make_paged_kv(lens, 16, 2, 32, torch.float32, gen)
    k_new = torch.randn(2, 2, 32, generator=gen).to(DEVICE)
    v_new = torch.randn(2, 2, 32, generator=gen).to(DEVICE)
    # the last token of each sequence: store first, then attend
    slots = [int(block_tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(lens)]
    kernels.store_kv(k_new, v_new, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    assert torch.equal(k_cache.flatten(0, 1)[slots[1]], k_new[1])
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, int32(lens), 0.2)
    assert_close(
        out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, int32(lens), 0.2)
    )
    cu = int32([0, 1, 2])
    out = kernels.prefill_attention(q, k_cache, v_cache, cu, int32(lens), block_tables, 0.2)
    ref = prefill_attention_ref(q, k_cache, v_cache, cu, int32(lens), block_tables, 0.2)
    assert_close(out, ref)


def test_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kernels\n"
        "assert not kernels.triton_available()\n"
        "try:\n"
        "    kernels.store_kv(None, None, None, None, None)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "needs triton" in done.stdout


@pytest.mark.skipif(ON_GPU, reason="on a GPU the benchmark runs for real (scripts/gpu_check.sh)")
def test_bench_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "kernels.triton.bench", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stdout
    assert json.loads(out.read_text())["skipped"] is True


def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter accepts code the GPU compiler rejects: compile for sm_90 for real."""
    pytest.importorskip("triton.backends.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "kernels.triton.compile_check", "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 9  # with the windowed prefill and the int8+fp decode
