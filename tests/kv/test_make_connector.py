"""Choosing a transport: one that cannot work fails at start; fallback only when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import BatonConfig
from shared.kv_transfer import (
    FallbackConnector,
    PoolConnector,
    ShmConnector,
    make_connector,
)
from shared.kv_transfer.cuda_ipc import CudaIpcConnector, main
from tests.kv.helpers import SHAPE

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def config(tmp_path: Path, transport: str, **kw: object) -> BatonConfig:
    return BatonConfig(kv_transport=transport, spill_dir=str(tmp_path / "spill"), **kw)  # type: ignore[arg-type]


@no_cuda
def test_cuda_ipc_without_cuda_fails_at_start_naming_the_cause(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as err:
        make_connector(config(tmp_path, "cuda-ipc", device="cuda"))
    msg = str(err.value)
    assert "BATON_KV_TRANSPORT=cuda-ipc needs CUDA: torch.cuda.is_available() is False" in msg
    assert "BATON_KV_FALLBACK=spill" in msg
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaIpcConnector.check_available("cuda")


def test_cuda_ipc_with_a_cpu_cache_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node
    with pytest.raises(RuntimeError, match="needs the KV cache on a CUDA device"):
        make_connector(config(tmp_path, "cuda-ipc", device="cpu"))


@no_cuda
def test_no_fallback_without_the_flag_and_a_counted_one_with_it(tmp_path: Path) -> None:
    cfg = config(tmp_path, "cuda-ipc", device="cuda")
    with pytest.raises(RuntimeError):
        make_connector(cfg, fallback=None)
    conn = make_connector(cfg, fallback="spill")
    assert isinstance(conn, FallbackConnector) and conn.wanted == "cuda-ipc"
    assert "needs CUDA" in conn.reason and conn.num_fallbacks == 0
    conn.register_kv_cache(torch.randn(SHAPE))
    desc = conn.send("r", [0, 1], 8)
    assert desc is not None and desc.transport == "shm"  # any decode can read it
    assert conn.num_fallbacks == 1
    with pytest.raises(ValueError, match="BATON_KV_FALLBACK"):
        make_connector(cfg, fallback="recompute")


def test_pool_on_a_device_cache_fails_unless_falling_back(tmp_path: Path) -> None:
    cfg = config(tmp_path, "pool", device="cuda")
    with pytest.raises(RuntimeError, match="BATON_KV_TRANSPORT=pool"):
        make_connector(cfg)
    assert isinstance(make_connector(cfg, fallback="spill"), FallbackConnector)


def test_known_transports_and_roles(tmp_path: Path) -> None:
    assert type(make_connector(config(tmp_path, "shm"))) is ShmConnector
    tx = make_connector(config(tmp_path, "pool"), role="prefill", worker_id="p0", lease_s=5.0)
    assert isinstance(tx, PoolConnector) and tx.export and tx.lease_s == 5.0
    assert tx.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu")) is not None
    rx = make_connector(config(tmp_path, "pool"), role="decode")
    assert isinstance(rx, PoolConnector) and not rx.export
    assert rx.allocate_kv_cache(SHAPE, torch.float32, torch.device("cpu")) is None
    tx.close()
    with pytest.raises(ValueError, match="not available"):
        make_connector(config(tmp_path, "rdma"))


@no_cuda
def test_the_gpu_selftest_exits_with_the_clear_error_on_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--selftest"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
